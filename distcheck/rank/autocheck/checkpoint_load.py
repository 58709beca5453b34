"""A resume that loads nothing: ``load_state_dict(strict=False)`` whose keys do not match the model's.

    python -m distcheck run --nproc 2 -- fixtures/resume_loads_nothing.py

A checkpoint saved from a wrapper (``DDP(model).state_dict()``: every key starts with ``module.``; a compiled
model's ``_orig_mod.``; FSDP1's ``_fsdp_wrapped_module.``) loaded into the bare model with ``strict=False`` loads
nothing and raises nothing: training resumes from the fresh initialization. ``nn.Module.load_state_dict`` is
patched (rank/autocheck/patches.py), so this also sees torch's own callers, such as
``torch.distributed.checkpoint.state_dict.set_model_state_dict(..., options=StateDictOptions(strict=False))``, at
the user's line. A non-strict load is a finding when

- missing keys are in the checkpoint under a wrapper's prefix (or the checkpoint lacks one the model has): the
  cause and the fix are named;
- nothing at all was loaded into the module.

A load that leaves a few keys missing with no such explanation is a partial load by design (a new head on a
pretrained backbone) and stays silent. Pure but for the module's key list. DCP's ``allow_partial_load`` gets the
same finding, and a DCP resume the same cause when the loaded values do not reach the model (dcp_roundtrip.py, a
check of its own).
"""
from __future__ import annotations

from typing import Any

from distcheck.contract.findings import Finding
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site

# Wrapper segments torch puts into state-dict keys, and where they come from.
WRAPPERS = {
    "module.": "DistributedDataParallel (or DataParallel): save model.module.state_dict()",
    "_orig_mod.": "torch.compile's wrapper: save model._orig_mod.state_dict()",
    "_fsdp_wrapped_module.": "FSDP1's wrapper: save with FSDP's state_dict_type, or torch.distributed.checkpoint",
    "_checkpoint_wrapped_module.": "the activation-checkpoint wrapper: save the unwrapped module's state_dict()",
}
SHOWN = 3


def _bare(key: str) -> tuple[str, list[str]]:
    """The key without any wrapper segment, and the segments removed."""
    found = []
    for prefix in WRAPPERS:
        while f".{prefix}" in f".{key}":
            where = f".{key}".index(f".{prefix}")
            key = (f".{key}"[:where] + "." + f".{key}"[where + 1 + len(prefix):])[1:]
            found.append(prefix)
    return key, found


def _names(keys: list[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:SHOWN])
    return shown + (f" (+{len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")


def load_finding(module_name: str, model_keys: int, missing: list[str], unexpected: list[str],
                 site: Site, call: str = "load_state_dict(strict=False)",
                 held: str = "parameters and buffers") -> Finding | None:
    """The finding for a non-strict load into a module with ``model_keys`` keys, or None. ``call`` and ``held``
    name the load (DCP's partial load passes its own: rank/autocheck/dcp_roundtrip.py)."""
    if not missing:
        return None
    bare_unexpected: dict[str, tuple[str, list[str]]] = {}
    for key in unexpected:
        bare, segments = _bare(key)
        bare_unexpected.setdefault(bare, (key, segments))
    matched = []
    for key in missing:
        bare, segments = _bare(key)
        hit = bare_unexpected.get(bare)
        if hit is not None:
            matched.append((key, hit[0], hit[1] or segments, bool(hit[1])))
    at = f" at {site.site}" if site.file else ""
    what = f"{call}{at} left {len(missing)} of {module_name}'s {model_keys} {held} unloaded"
    if matched:
        key, theirs, segments, checkpoint_has_it = matched[0]
        prefix = segments[0]
        if checkpoint_has_it:
            why = (f"the checkpoint has them under the prefix '{prefix}' ('{key}' is '{theirs}' there): it was saved "
                   f"from {WRAPPERS[prefix].split(':')[0]}. Fix: {WRAPPERS[prefix].split(': ', 1)[1]}, or strip "
                   f"'{prefix}' from its keys")
        else:
            why = (f"the model's keys carry the prefix '{prefix}' the checkpoint lacks ('{key}' is '{theirs}' there): "
                   f"it is loaded into the wrapper. Fix: load into the wrapped module (model.module, "
                   f"model._orig_mod), or add the prefix")
        cause = "prefix"
    elif len(missing) >= model_keys:
        why = (f"none of the checkpoint's keys is one of the model's ({_names(unexpected)}): renamed keys, or "
               f"another model's checkpoint" if unexpected else "the state dict was empty")
        cause = "nothing_loaded"
    else:
        return None
    message = f"{what}: {_names(missing)}; {why}. Training resumes from the initial values, not the checkpoint"
    return Finding("bad_values", [], message,
                   {"cause": "state_dict_not_loaded", "why": cause, "missing": missing[:64],
                    "missing_count": len(missing), "unexpected": unexpected[:64], "module": module_name,
                    "file": site.file, "line": site.line})


class LoadWatch(Check):
    name = "checkpoint_load"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the rank and emit(): its findings go to the run's findings file at once
        self.reported: set[tuple] = set()

    def on_load_state_dict(self, module: Any, result: Any, site: Site) -> None:
        missing = list(getattr(result, "missing_keys", []) or [])
        if not missing or (site.file, site.line) in self.reported:
            return
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        finding = load_finding(type(module).__name__, len(module.state_dict()), missing, unexpected, site)
        if finding is not None:
            self.reported.add((site.file, site.line))
            finding.ranks = [self.core.rank]
            self.core.emit([finding])
