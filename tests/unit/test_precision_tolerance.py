"""Tolerances follow the precision a value was computed in (analysis/tolerance.py), and the gradient hint names a
factor of the world size only when the ratio is near it (analysis/record_explain.py)."""
from __future__ import annotations

import torch

from distcheck.analysis.record_compare import Row
from distcheck.analysis.record_explain import hints, observed_factor
from distcheck.analysis.tolerance import NORM_RTOL, Precision, compare, rule_for


def test_float32_without_a_16_bit_computation_keeps_element_wise_defaults():
    rule = rule_for(torch.float32)
    assert not rule.norm and (rule.rtol, rule.atol) == (1e-4, 1e-5) and rule.why == "float32 defaults"
    assert rule_for(torch.int64).why == "exact: integers"


def test_a_16_bit_computation_makes_float32_records_norm_wise_and_says_where():
    notes = [{"source": "torch.autocast(cpu, bfloat16)", "dtype": "bfloat16", "file": "/x/train.py", "line": 12},
             {"source": "torch.autocast(cpu, bfloat16)", "dtype": "bfloat16", "file": "/x/train.py", "line": 30},
             {"source": "DDP comm hook fp16_compress_hook", "dtype": "float16", "file": "/x/train.py", "line": 9}]
    precision = Precision.from_notes(notes)
    assert precision.dtype == torch.bfloat16  # the lower of the two (8 bits of mantissa)
    rule = rule_for(torch.float32, precision=precision)
    assert rule.norm and rule.rtol == NORM_RTOL[torch.bfloat16]
    assert rule.why == "computed in bfloat16: torch.autocast(cpu, bfloat16) at train.py:12,30"
    assert Precision.from_notes([{"source": "x", "dtype": "float32"}]) is None


def test_explicit_tolerances_win_and_stay_element_wise():
    precision = Precision(torch.bfloat16, ["autocast"])
    rule = rule_for(torch.float32, 1e-3, None, precision, why="--rtol/--atol")
    assert not rule.norm and (rule.rtol, rule.atol) == (1e-3, 1e-5) and rule.why == "--rtol/--atol"


def test_a_16_bit_stored_tensor_is_norm_wise_even_without_notes():
    assert rule_for(torch.bfloat16).norm and "stored in bfloat16" in rule_for(torch.bfloat16).why
    fp16 = Precision(torch.float16, ["fp16 hook"])
    assert rule_for(torch.bfloat16, precision=fp16).rtol == NORM_RTOL[torch.bfloat16]  # the looser one


def test_norm_wise_passes_rounding_noise_and_catches_a_factor():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 64, generator=gen)
    noisy = (ref.to(torch.bfloat16).float() + 1e-3 * torch.randn(64, 64, generator=gen))
    noisy[0, 0] = 0.0  # one element with no correct digit (a near-zero gradient): element-wise fails, norm passes
    assert not compare(noisy, ref).ok
    ok = compare(noisy, ref, NORM_RTOL[torch.bfloat16], 1e-5, norm=True)
    assert ok.ok and ok.norm_rel < 2e-2 and "norm-wise rel err" in ok.describe()
    half = compare(ref * 0.5, ref, NORM_RTOL[torch.bfloat16], 1e-5, norm=True)
    assert not half.ok and abs(half.norm_rel - 0.5) < 1e-6
    zeros = torch.zeros(8)
    assert compare(zeros, zeros, 2e-2, 1e-5, norm=True).ok
    nan = torch.tensor([1.0, float("nan")])
    assert not compare(torch.tensor([1.0, 2.0]), nan, 2e-2, 1e-5, norm=True).ok


def _grad_row(actual, expected):
    return Row(("auto/grads", 0, 0), "MISMATCH", part="w", part_role="gradient", actual=actual, expected=expected)


def test_the_gradient_hint_names_a_factor_only_near_it():
    e = torch.tensor([1.0, -2.0, 3.0, 0.5])
    loss = Row(("auto/loss", 0, 0), "ok")
    [two] = [h for h in hints(_grad_row(e * 2, e), [loss], 2) if "loss matches" in h]
    assert "2x the reference: summed over the ranks and not divided by 2" in two
    [half] = [h for h in hints(_grad_row(e / 2, e), [loss], 2) if "loss matches" in h]
    assert "divided by 2 once too often" in half
    [near] = [h for h in hints(_grad_row(e * 1.004, e), [loss], 2) if "loss matches" in h]
    assert "not divided by" not in near and "1/2" not in near and "1.004x the reference" in near
    assert observed_factor(_grad_row(e * 3, e)) == 3.0
