"""What only a rank knows about the torch error it raised, for analysis/torch_errors.py to translate.

    python -m distcheck run --nproc 2 -- train.py                        # recorded with the error, translated by the report
    torchrun --nproc-per-node 2 -m distcheck consistency --parallel ddp  # translated in the rank (rank/checks/consistency.py)
    pytest -n 2 tests/                                                   # translated in the rank (testing/pool_worker.py)

DDP's errors number parameters in DDP's own order; only the rank holding the model can turn the indices into names
and the names into the lines that create them. Everything else a translation needs is in torch's text (and, for
``run``, the trace the report reads).
"""
from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

log = logging.getLogger("distcheck")


def ddp_param_names(module: Any, ignored: set[str] | frozenset = frozenset()) -> list[str]:
    """The parameter names of ``module`` (the model inside DistributedDataParallel) in DDP's index order."""
    seen: set[int] = set()
    names: list[str] = []
    for module_name, sub in module.named_modules():  # DDP's own order (_build_params_for_reducer)
        for param_name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                names.append(full)
    return names


def _watched_ddp_model() -> Any:
    """The user's module inside the DDP wrapper the zero-code checks found in this rank, or None."""
    from distcheck.rank import autocheck

    check = autocheck.current()
    if check is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    for model in check.models.alive():
        if isinstance(model, DistributedDataParallel):
            return model
    return None


def error_context(exc_type: str, message: str, script: Path | None = None, ddp_model: Any = None) -> dict | None:
    """``{"ddp_params": [...], "param_sites": {name: "file.py:LINE"}}`` for a DDP error the translation recognizes,
    else None. ``ddp_model``: the model trained under DDP (default: the DDP wrapper the zero-code checks found);
    ``script``: the script `run` executed as ``__main__`` (its classes' source lines are found through it)."""
    try:
        from distcheck.analysis.torch_errors import translate

        wrapper = _watched_ddp_model() if ddp_model is None else None
        module = ddp_model if ddp_model is not None else getattr(wrapper, "module", None)
        if module is None:
            return None
        ignored = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
        context: dict = {"ddp_params": ddp_param_names(module, ignored)}
        translated = translate(exc_type, message, context)
        if translated is None:
            return None
        from distcheck.rank.usersite import param_site

        main = sys.modules.get("__main__")
        if script is not None:
            # The script ran as __main__ through runpy, which has removed that module by now: classes defined in
            # the script find their source through a stand-in with the script's path.
            stand_in = types.ModuleType("__main__")
            stand_in.__file__ = str(script)
            sys.modules["__main__"] = stand_in
        try:
            context["param_sites"] = {n: param_site(module, n).site for n in translated["detail"]["params"]}
        finally:
            sys.modules["__main__"] = main
        return context
    except Exception as err:  # the diagnosis must never hide the script's own error
        log.debug("error context failed: %s", err)
        return None


def explain(exc: BaseException, ddp_model: Any = None) -> dict[str, Any] | None:
    """The translation of an error this rank just caught (``{"message", "detail"}``), or None for an unknown one;
    for paths with no report to translate later (the consistency checks, the pytest pool)."""
    from distcheck.analysis.torch_errors import translate

    exc_type, message = type(exc).__name__, str(exc)
    try:
        return translate(exc_type, message, error_context(exc_type, message, ddp_model=ddp_model) or {})
    except Exception as err:
        log.debug("error translation failed: %s", err)
        return None
