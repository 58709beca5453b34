"""Where this rank computed in less than float32, so that compare judges its records at that precision.

    python -m distcheck compare --nproc 2 -- train.py      # the ranks note it; analysis/tolerance.py uses it

A record is often stored wider than it was computed: float32 parameters and losses of a model that ran its matmuls
under ``torch.autocast(dtype=torch.bfloat16)``, all-gathered in bf16 by FSDP2's ``MixedPrecisionPolicy`` or whose
gradients a DDP compression hook rounded to bf16. Their 1-rank and N-rank values then agree only to that precision.
The hooks (rank/autocheck/patches.py) note each such source once, with the user's line:
- ``torch.autocast`` entered with a 16-bit ``dtype`` (CPU and CUDA; ``torch.cuda.amp.autocast`` is the same class);
- ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))`` and FSDP1's
  ``FullyShardedDataParallel(..., mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=...))``;
- ``DistributedDataParallel.register_comm_hook`` with torch's ``fp16/bf16_compress_hook`` or ``_wrapper``;
- a watched model whose parameters are stored in a 16-bit dtype.
Not seen: an autocast region entered inside a ``torch.compile``d function (Dynamo runs it without calling
``__enter__``), a user's own ``.to(torch.bfloat16)`` of activations. Those runs keep float32 tolerances; pass
``--rtol``/``--atol`` (or ``distcheck.record(..., rtol=...)``) for them.
"""
from __future__ import annotations

from typing import Any

from distcheck.rank.autocheck.discovery import FirstForward
from distcheck.rank.autocheck.protocol import Check

LOW = ("bfloat16", "float16")
MAX_NOTES = 16  # one per (source, dtype, line): a loop entering autocast each step notes it once


class PrecisionNotes(Check):
    name = "precision"

    def __init__(self, core: Any) -> None:
        super().__init__(core)
        self.notes: list[dict[str, Any]] = []
        self._seen: set[tuple] = set()

    def note(self, source: str, dtype: Any) -> None:
        """``source`` computed in ``dtype`` at the user's current line (nothing when ``dtype`` is not 16-bit)."""
        name = str(dtype).replace("torch.", "")
        if name not in LOW or len(self.notes) >= MAX_NOTES:
            return
        from distcheck.rank.usersite import caller_site

        site = caller_site()
        key = (source, name, site.file, site.line)
        if key in self._seen:
            return
        self._seen.add(key)
        self.notes.append({"source": source, "dtype": name, "file": site.file, "line": site.line})

    def on_autocast(self, ctx: Any) -> None:
        if getattr(ctx, "_enabled", False):
            self.note(f"torch.autocast({getattr(ctx, 'device', '?')}, {str(ctx.fast_dtype).replace('torch.', '')})",
                      ctx.fast_dtype)

    def on_mp_policy(self, policy: Any, label: str) -> None:
        """FSDP2's ``MixedPrecisionPolicy`` or FSDP1's ``MixedPrecision`` (the same two fields)."""
        if policy is None:
            return
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(policy, field, None)
            if dtype is not None:
                self.note(f"{label}({field}={str(dtype).replace('torch.', '')})", dtype)

    def on_comm_hook(self, hook: Any) -> None:
        name = getattr(hook, "__qualname__", getattr(hook, "__name__", "")) or ""
        for prefix, dtype in (("bf16_compress", "bfloat16"), ("fp16_compress", "float16")):
            if prefix in name:
                self.note(f"DDP comm hook {name.split('.')[0]}", dtype)

    def on_model_wrapped(self, module: Any, how: str) -> None:
        self.note_module(module)

    def on_first_forward(self, ctx: FirstForward) -> None:
        self.note_module(ctx.root)  # a model found at its first forward: 16-bit parameters?

    def note_module(self, module: Any) -> None:
        try:
            dtypes = {str(p.dtype).replace("torch.", "") for p in module.parameters()}
        except Exception:
            return
        for name in sorted(dtypes & set(LOW)):
            self.note(f"parameters stored in {name}", name)

    def state(self) -> list[dict[str, Any]]:
        return self.notes
