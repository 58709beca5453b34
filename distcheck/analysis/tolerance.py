"""Numerical comparison with dtype-dependent tolerances (pure)."""
from __future__ import annotations

from dataclasses import dataclass

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
        if not self.index:  # a scalar (a loss)
            return (f"{actual} vs reference {expected} (abs err {self.max_abs:.3g}, rel err "
                    f"{self.max_rel:.3g}; rtol {self.rtol:g}, atol {self.atol:g})")
        return (f"worst element {self.index}: {actual} vs reference {expected} "
                f"(abs err {self.max_abs:.3g}, rel err {self.max_rel:.3g}; rtol {self.rtol:g}, atol {self.atol:g})")


def compare(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None = None,
            atol: float | None = None) -> Comparison:
    """allclose semantics (|a - e| <= atol + rtol * |e|), reporting the worst element; NaNs must match NaNs."""
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

    if is_complex:
        return Comparison(bool((excess <= 0).all()), float(diff.max()), float(rel[worst]),
                          unravel(worst, tuple(actual.shape)), float(e[worst].real), float(a[worst].real), rtol,
                          atol, actual_imag=float(a[worst].imag), expected_imag=float(e[worst].imag))
    return Comparison(bool((excess <= 0).all()), float(diff.max()), float(rel[worst]),
                      unravel(worst, tuple(actual.shape)), float(e[worst]), float(a[worst]), rtol, atol)


def ratio_hint(actual: torch.Tensor, expected: torch.Tensor, world_size: int) -> str:
    """'N x the reference' / '1/N of the reference' when the mismatch is a sum-versus-mean reduction."""
    if actual.is_complex() or expected.is_complex():  # a common real factor shows in both parts
        actual, expected = torch.view_as_real(actual.to(torch.complex128)), torch.view_as_real(
            expected.to(torch.complex128))
    a = actual.detach().double().reshape(-1)
    e = expected.detach().double().reshape(-1)
    mask = e.abs() > 1e-12
    if world_size < 2 or not bool(mask.any()):
        return ""
    ratio = (a[mask] / e[mask])
    r = float(ratio.median())
    if abs(r - world_size) < 0.02 * world_size and bool(((ratio - world_size).abs() < 0.05 * world_size).all()):
        return f"the value is {world_size}x the reference: a sum where a mean was meant (divide by world size)"
    if abs(r * world_size - 1) < 0.02 and bool(((ratio * world_size - 1).abs() < 0.05).all()):
        return f"the value is 1/{world_size} of the reference: divided by the world size once too often"
    return ""
