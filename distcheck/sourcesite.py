"""Where in the user's code a module, parameter or forward is defined: ``file.py:LINE`` for messages."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Site:
    file: str
    line: int

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    def detail(self) -> dict:
        return {"file": self.file, "line": self.line}


def _site_of(obj) -> Site | None:
    try:
        lines, start = inspect.getsourcelines(obj)
        return Site(inspect.getsourcefile(obj) or "", start)
    except (OSError, TypeError):
        return None


def owner_of(model: nn.Module, tensor_name: str) -> nn.Module:
    """The submodule that holds ``a.b.weight`` (the model itself for a top-level name)."""
    path = tensor_name.rsplit(".", 1)[0] if "." in tensor_name else ""
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return model


def init_site(model: nn.Module, tensor_name: str) -> Site | None:
    """The ``__init__`` of the user class that creates this parameter (or the class, if __init__ is inherited).

    For a torch layer (nn.Linear inside the user's Block), the user's line is the parent class that built it.
    """
    parts = tensor_name.split(".")[:-1]
    chain = [model]
    for part in parts:
        try:
            chain.append(chain[-1].get_submodule(part))
        except AttributeError:
            break
    for module in reversed(chain):
        cls = type(module)
        if cls.__module__.startswith("torch."):
            continue
        init = cls.__dict__.get("__init__")
        return _site_of(init) if init is not None else _site_of(cls)
    return None


def forward_site(model: nn.Module) -> Site | None:
    """The user's forward method (the outermost non-torch class that defines one)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("torch.") or "forward" not in cls.__dict__:
            continue
        return _site_of(cls.__dict__["forward"])
    return None
