"""Environment diffs and tolerance comparisons (pure)."""
import pytest
import torch

from distcheck.analysis.envdiff import diff_env, render_env_table
from distcheck.analysis.tolerance import compare, ratio_hint, tolerance_for
from distcheck.rank.checks.envinfo import HOST_SPECIFIC, snapshot


def test_env_diff_names_key_and_ranks():
    snaps = {r: {"version.torch": "2.13", "env.NCCL_ALGO": "Ring", "hostname": f"node{r // 2}"} for r in range(5)}
    snaps[3]["env.NCCL_ALGO"] = "Tree"
    del snaps[2]["env.NCCL_ALGO"]
    findings = diff_env(snaps, HOST_SPECIFIC)
    assert len(findings) == 1  # hostname differs but is host-specific
    f = findings[0]
    assert f.kind == "env_mismatch" and f.ranks == [2, 3]
    assert "NCCL_ALGO" in f.message and "'Tree'" in f.message and "<unset>" in f.message
    table = render_env_table(snaps, HOST_SPECIFIC)
    assert "(host-specific)" in table and "(DIFFERS)" in table


def test_env_equal_no_findings_and_snapshot_keys():
    snap = snapshot(torch.device("cpu"), "gloo", {"parallel": "fsdp"})
    assert diff_env({0: snap, 1: dict(snap)}, HOST_SPECIFIC) == []
    assert snap["version.torch"] == torch.__version__ and snap["config.parallel"] == "fsdp"


def test_compare_by_dtype():
    a = torch.ones(10)
    assert compare(a + 1e-7, a).ok
    bad = a.clone()
    bad[7] = 1.1
    c = compare(bad, a)
    assert not c.ok and c.index == [7] and abs(c.max_abs - 0.1) < 1e-6
    assert tolerance_for(torch.bfloat16)[0] > tolerance_for(torch.float32)[0]
    assert compare(torch.tensor([float("nan")]), torch.tensor([float("nan")])).ok
    assert not compare(torch.tensor([float("nan")]), torch.tensor([1.0])).ok
    assert not compare(torch.zeros(2), torch.zeros(3)).ok
    assert not compare(torch.tensor([3]), torch.tensor([2])).ok  # integers: exact


def test_ratio_hint():
    ref = torch.tensor([1.0, -2.0, 3.0])
    assert "2x the reference" in ratio_hint(ref * 2, ref, 2)
    assert "1/4" in ratio_hint(ref / 4, ref, 4)
    assert ratio_hint(ref + 1, ref, 2) == ""


def test_complex_tensors_compare_real_and_imaginary_parts_without_a_warning():
    import warnings

    freqs = torch.polar(torch.ones(2, 3), torch.arange(6.0).reshape(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards the imaginary part"
        assert compare(freqs, freqs.clone()).ok
        assert tolerance_for(torch.complex64) == tolerance_for(torch.float32)  # not an exact compare
        assert compare(freqs * (1 + 1e-6), freqs).ok
        bad = freqs.clone()
        bad[1, 2] = complex(bad[1, 2].real, -bad[1, 2].imag)  # only the imaginary part differs
        c = compare(bad, freqs)
        assert not c.ok and c.index == [1, 2] and c.actual == pytest.approx(c.expected)
        assert c.actual_imag == pytest.approx(-c.expected_imag) and abs(c.expected_imag) > 0.9
        assert "j vs reference" in c.describe()
        assert "2x the reference" in ratio_hint(freqs * 2, freqs, 2)
