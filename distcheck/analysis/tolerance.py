"""Numerical comparison with tolerances that follow the precision the values were computed in (pure).

Float32 (and wider) values are compared element by element, allclose-style, with the dtype's defaults below.
Values computed in bfloat16 or float16 (a 16-bit record, or any record of a run that computed in 16 bits:
autocast, FSDP2's MixedPrecisionPolicy, a DDP compression hook; rank/autocheck/precision.py notes them) are
compared norm-wise: ``||actual - expected|| <= rtol * ||expected|| + atol * sqrt(n)`` with ``NORM_RTOL``. Element-wise
bounds cannot work there: a gradient element near zero has no correct digits after a 16-bit matmul, and Adam's first
update (about ``lr * sign(grad)``) flips with it, so a correct bf16 AdamW step moves a few elements by ``lr`` on one
side only (measured: rel err 0.17 on one element, 0.3% norm-wise). The norm is of one tensor (one parameter or
gradient), so a bug confined to a small tensor (a bias not reduced) still counts fully.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# (rtol, atol) per dtype: loose enough for a different reduction order across ranks, tight enough that a real bug
# (a factor of N, a missing term, a different batch) is always far outside.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}
# A complex number's parts are floats of half its width: the same tolerances, applied to |actual - expected|.
_COMPLEX_PARTS: dict[torch.dtype, torch.dtype] = {torch.complex128: torch.float64, torch.complex64: torch.float32,
                                                   torch.complex32: torch.float16}


# Norm-wise relative error allowed for a tensor computed in 16 bits: about 5x the unit roundoff (bf16 2^-8, fp16
# 2^-11). Measured on the corpus's correct bf16 programs (fixtures/ok/, 3 steps, SGD and AdamW): 0.2% to 0.3%
# norm-wise for bf16, so 2% leaves a margin of 7; a missing gradient all-reduce (half the batch's gradient) is 20%
# and more, a loss summed instead of averaged 100%. Long runs drift further apart (the errors compound every
# step): compare a few steps, or pass --rtol.
NORM_RTOL: dict[torch.dtype, float] = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
NORM_ATOL = 1e-5  # per element, times sqrt(n): an all-zero reference (a gradient that is exactly zero) still passes
_LOW_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Rule:
    """How one tensor is compared, and why: the report shows it for every record."""

    rtol: float
    atol: float
    norm: bool = False  # norm-wise (16-bit computation) rather than element-wise
    why: str = ""

    def text(self) -> str:
        how = f"norm-wise rtol {self.rtol:g}" if self.norm else f"rtol {self.rtol:g}, atol {self.atol:g}"
        return f"{how} ({self.why})" if self.why else how

    def to_json(self) -> dict:
        return {"rule": "norm-wise" if self.norm else "element-wise", "rtol": self.rtol, "atol": self.atol,
                "why": self.why}


@dataclass
class Precision:
    """The lowest precision a run computed in, and the sources that say so (``autocast(cpu, bfloat16) at
    train.py:37``). bfloat16 is lower than float16 (8 bits of mantissa against 11)."""

    dtype: torch.dtype
    sources: list[str] = field(default_factory=list)

    @classmethod
    def from_notes(cls, notes: list[dict]) -> "Precision | None":
        """From the ranks' precision notes (autocheck state ``precision``); None when every note is 32-bit."""
        import os

        low = [n for n in notes if n.get("dtype") in _LOW_NAMES]
        if not low:
            return None
        dtype = torch.bfloat16 if any(n["dtype"] == "bfloat16" for n in low) else torch.float16
        lines: dict[tuple[str, str], list[int]] = {}  # (source, file) -> lines, in the order first seen
        for n in low:
            if _LOW_NAMES[n["dtype"]] == dtype:
                found = lines.setdefault((n.get("source", "?"), os.path.basename(n.get("file") or "")), [])
                if n.get("line") and n["line"] not in found:
                    found.append(n["line"])
        sources = [f"{source} at {file}:{','.join(map(str, ls))}" if file and ls else source
                   for (source, file), ls in lines.items()]
        return cls(dtype, sources)

    def rule(self, stored: torch.dtype) -> Rule:
        name = str(self.dtype).replace("torch.", "")
        return Rule(NORM_RTOL[self.dtype], NORM_ATOL, True,
                    f"computed in {name}: {', '.join(self.sources[:3])}" + (" ..." if len(self.sources) > 3 else ""))


def rule_for(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None,
             precision: Precision | None = None, why: str = "") -> Rule:
    """The rule for a tensor stored in ``dtype``: explicit ``rtol``/``atol`` (with ``why`` saying whose) win and are
    element-wise; else a 16-bit storage dtype or a 16-bit computation (``precision``) is norm-wise; else the dtype's
    element-wise defaults."""
    base = _COMPLEX_PARTS.get(dtype, dtype)
    if not (base.is_floating_point if isinstance(base, torch.dtype) else False):
        return Rule(0.0, 0.0, False, "exact: integers")
    if rtol is not None or atol is not None:
        r, a = tolerance_for(dtype, rtol, atol)
        return Rule(r, a, False, why)
    if base in NORM_RTOL:
        stored = Precision(base, [f"stored in {str(base).replace('torch.', '')}"])
        if precision is None or NORM_RTOL[precision.dtype] < NORM_RTOL[base]:  # the looser one
            precision = stored
    if precision is not None:
        return precision.rule(dtype)
    r, a = tolerance_for(dtype)
    return Rule(r, a, False, f"{str(base).replace('torch.', '')} defaults")


def tolerance_for(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(_COMPLEX_PARTS.get(dtype, dtype), (0.0, 0.0))  # integers and bools: exact
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


@dataclass
class Comparison:
    ok: bool
    max_abs: float
    max_rel: float
    index: list[int]  # the worst element (largest excess over tolerance)
    expected: float
    actual: float
    rtol: float
    atol: float
    note: str = ""
    norm_rel: float | None = None  # norm-wise comparison: ||actual - expected|| / ||expected||
    # Complex tensors: the imaginary parts of the worst element (actual/expected hold the real parts, so the
    # fields stay JSON numbers); None for real tensors.
    actual_imag: float | None = None
    expected_imag: float | None = None

    def _value(self, real: float, imag: float | None, digits: int) -> str:
        if imag is None:
            return f"{real:.{digits}g}"
        return f"{complex(real, imag):.{digits}g}"

    def describe(self) -> str:
        if self.note:
            return self.note
        actual = self._value(self.actual, self.actual_imag, 7 if not self.index else 6)
        expected = self._value(self.expected, self.expected_imag, 7 if not self.index else 6)
        if self.norm_rel is not None:
            where = f"worst element {self.index}: " if self.index else ""
            return (f"{where}{actual} vs reference {expected} (abs err {self.max_abs:.3g}); norm-wise rel err "
                    f"{self.norm_rel:.3g} against norm-wise rtol {self.rtol:g}")
        if not self.index:  # a scalar (a loss)
            return (f"{actual} vs reference {expected} (abs err {self.max_abs:.3g}, rel err "
                    f"{self.max_rel:.3g}; rtol {self.rtol:g}, atol {self.atol:g})")
        return (f"worst element {self.index}: {actual} vs reference {expected} "
                f"(abs err {self.max_abs:.3g}, rel err {self.max_rel:.3g}; rtol {self.rtol:g}, atol {self.atol:g})")


def compare(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None = None,
            atol: float | None = None, norm: bool = False) -> Comparison:
    """allclose semantics (|a - e| <= atol + rtol * |e|), reporting the worst element; NaNs must match NaNs.
    ``norm``: ||a - e|| <= atol * sqrt(n) + rtol * ||e|| instead (16-bit computation), still naming the worst
    element."""
    rtol, atol = tolerance_for(expected.dtype, rtol, atol)
    if tuple(actual.shape) != tuple(expected.shape):
        return Comparison(False, float("inf"), float("inf"), [], float("nan"), float("nan"), rtol, atol,
                          note=f"shape {list(actual.shape)} vs reference {list(expected.shape)}")
    is_complex = actual.is_complex() or expected.is_complex()
    # .double() on a complex tensor drops the imaginary part (with a UserWarning): complex compares in complex128,
    # |a - e| being the modulus of the difference of both parts, as torch.isclose does.
    wide = torch.complex128 if is_complex else torch.float64
    a = actual.detach().cpu().reshape(-1).to(wide)
    e = expected.detach().cpu().reshape(-1).to(wide)
    if a.numel() == 0:
        return Comparison(True, 0.0, 0.0, [], 0.0, 0.0, rtol, atol)
    diff = (a - e).abs()
    both_nan = torch.isnan(a) & torch.isnan(e)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    allowed = atol + rtol * e.abs().nan_to_num(0.0)
    excess = diff - allowed
    worst = int(torch.argmax(excess))
    rel = diff / e.abs().clamp_min(1e-30)
    from distcheck.analysis.replicas import unravel

    if norm:
        nan_ok = bool((torch.isnan(a) == torch.isnan(e)).all())
        finite = ~(torch.isnan(a) & torch.isnan(e))
        d_norm = float((a - e)[finite].abs().norm()) if bool(finite.any()) else 0.0
        e_norm = float(e[finite].abs().norm()) if bool(finite.any()) else 0.0
        ok = nan_ok and d_norm <= atol * math.sqrt(a.numel()) + rtol * e_norm
        worst = int(torch.argmax(diff))
        out = Comparison(ok, float(diff.max()), float(rel[worst]), unravel(worst, tuple(actual.shape)),
                         float(e[worst].real), float(a[worst].real), rtol, atol,
                         norm_rel=d_norm / e_norm if e_norm > 0 else (0.0 if d_norm == 0 else float("inf")))
        if is_complex:
            out.actual_imag, out.expected_imag = float(a[worst].imag), float(e[worst].imag)
        return out
    if is_complex:
        return Comparison(bool((excess <= 0).all()), float(diff.max()), float(rel[worst]),
                          unravel(worst, tuple(actual.shape)), float(e[worst].real), float(a[worst].real), rtol,
                          atol, actual_imag=float(a[worst].imag), expected_imag=float(e[worst].imag))
    return Comparison(bool((excess <= 0).all()), float(diff.max()), float(rel[worst]),
                      unravel(worst, tuple(actual.shape)), float(e[worst]), float(a[worst]), rtol, atol)


def element_ratios(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor | None:
    """``actual / expected`` element by element where the reference is not ~0 (a complex value's real and
    imaginary parts each: a common real factor shows in both), in float64; None when every reference element is ~0."""
    if actual.is_complex() or expected.is_complex():
        actual, expected = torch.view_as_real(actual.to(torch.complex128)), torch.view_as_real(
            expected.to(torch.complex128))
    a = actual.detach().double().reshape(-1)
    e = expected.detach().double().reshape(-1)
    mask = e.abs() > 1e-12
    return a[mask] / e[mask] if bool(mask.any()) else None


def ratio_hint(actual: torch.Tensor, expected: torch.Tensor, world_size: int) -> str:
    """'N x the reference' / '1/N of the reference' when the mismatch is a sum-versus-mean reduction."""
    ratio = element_ratios(actual, expected)
    if world_size < 2 or ratio is None:
        return ""
    r = float(ratio.median())
    if abs(r - world_size) < 0.02 * world_size and bool(((ratio - world_size).abs() < 0.05 * world_size).all()):
        return f"the value is {world_size}x the reference: a sum where a mean was meant (divide by world size)"
    if abs(r * world_size - 1) < 0.02 and bool(((ratio * world_size - 1).abs() < 0.05).all()):
        return f"the value is 1/{world_size} of the reference: divided by the world size once too often"
    return ""
