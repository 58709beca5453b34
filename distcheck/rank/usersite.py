"""The one rule for "the user's line": ``file.py:LINE`` in every message that points into the user's code.

    python -m distcheck run --nproc 2 -- train.py    # collective sites, crash sites, record sites all come from here

A frame is the user's when distcheck's one frame classifier (:mod:`distcheck.analysis.frame_owner`) says ``user``:
not torch, not distcheck, not a third-party library installed as a package (lightning, transformers, ...), not the
standard library and not interpreter machinery (``<frozen runpy>``, ``<string>``). The user's line is the innermost
frame of the user's own code; when the walk out to it passed through a library, :attr:`Site.via` names the library
call under it (``lightning/pytorch/core/module.py:512 in log``). From that one predicate:

* :class:`SiteFinder` / :func:`caller_site`: the innermost user frame of the current call stack (the tracer's
  collective sites, ``distcheck.record``'s site, the automatic loss and step records);
* :func:`traceback_site`: the innermost user frame of an exception (a rank's crash site, torch's mesh errors);
* :func:`param_site`: where the user's class creates a parameter (``self.fc1 = nn.Linear(...)``; for a torch
  layer inside the user's module, the line of the user's parent that assigns it; else the user's ``__init__``),
  used by ``check_model`` (placements, coverage, bad values) and the ``consistency`` check alike;
* :func:`forward_site`: the user's ``forward``.
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
import traceback
from typing import Any

from distcheck.analysis.frame_owner import LIBRARY, USER, is_user, location, owner
from distcheck.contract.site import UNKNOWN, Site


def is_internal(filename: str) -> bool:
    """Whether a frame's file is anything but the user's own code (torch, distcheck, a library, the standard
    library, interpreter machinery): never the user's line."""
    return not is_user(filename)


class SiteFinder:
    """The first user frame of the current stack; cached per (code object, line), since the tracer asks on every
    collective and the same few call sites repeat."""

    def __init__(self) -> None:
        self._owners: dict[str, str] = {}
        self._sites: dict[tuple[Any, ...], Site] = {}

    def _owner(self, filename: str) -> str:
        hit = self._owners.get(filename)
        if hit is None:  # the hot path: one dict lookup per frame after the first time
            hit = self._owners[filename] = owner(filename)
        return hit

    def _is_internal(self, filename: str) -> bool:
        return self._owner(filename) != USER

    def find(self, depth: int = 1) -> Site:
        """Walks out from ``depth`` frames above this call (1: the caller of ``find``)."""
        try:
            frame = sys._getframe(depth)
        except ValueError:
            return UNKNOWN
        owner_of = self._owner
        via = None  # the outermost library frame passed so far: the call the user's line made into the library
        while frame is not None:
            who = owner_of(frame.f_code.co_filename)
            if who == USER:
                break
            if who == LIBRARY:
                via = frame
            frame = frame.f_back
        if frame is None:
            return UNKNOWN
        key = (frame.f_code, frame.f_lineno) if via is None else \
            (frame.f_code, frame.f_lineno, via.f_code, via.f_lineno)
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = Site(frame.f_code.co_filename, frame.f_lineno, _via(via))
        return site


def _via(frame: Any) -> str | None:
    if frame is None:
        return None
    return location(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


_finder: SiteFinder | None = None


def caller_site(depth: int = 1) -> Site:
    """The user's line that (directly or through torch/distcheck) called the function asking."""
    global _finder
    if _finder is None:
        _finder = SiteFinder()
    return _finder.find(depth + 1)


def traceback_site(tb: Any, before: int | None = None) -> Site:
    """The innermost user frame of a traceback (of its first ``before`` frames, when given)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    if before is not None:
        frames = frames[:before]
    via = None
    for frame in reversed(frames):
        who = owner(frame.filename)
        if who == USER:
            return Site(frame.filename, frame.lineno,
                        location(via.filename, via.lineno, via.name) if via is not None else None)
        if who == LIBRARY:
            via = frame
    return UNKNOWN


def _is_user_class(klass: type) -> bool:
    if klass is object:
        return False
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:  # a class defined in C
        return False
    return bool(path) and is_user(path)


def _source_of(obj: Any) -> tuple[str, list[str], int] | None:
    try:
        return _cached_source(obj)
    except TypeError:  # unhashable: not a class or a function, so no source either
        return None


@functools.lru_cache(maxsize=512)
def _cached_source(obj: Any) -> tuple[str, list[str], int] | None:
    """Once per class or function: for a class, inspect parses its whole module (``ast``) on every call, and the
    first-forward checks ask for the same few classes once per parameter."""
    try:
        lines, start = inspect.getsourcelines(obj)
        return inspect.getsourcefile(obj) or "", lines, start
    except (OSError, TypeError):
        return None


def assignment_site(module: Any, attr: str) -> Site:
    """Where the user's class of ``module`` assigns ``self.<attr>``, else its ``__init__``, else the class line.

    fully_shard swaps the module's class for a generated ``FSDP<Name>`` subclass with no source, so the MRO is
    walked to the first class the user wrote. Torch's own classes give UNKNOWN.
    """
    pattern = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=]*)?=(?!=)")
    for klass in type(module).__mro__:
        if not _is_user_class(klass):
            continue
        source = _source_of(klass)
        if source is None:
            continue
        path, lines, start = source
        for i, text in enumerate(lines):
            if pattern.search(text):
                return Site(path, start + i)
        init = klass.__dict__.get("__init__")
        init_source = _source_of(init) if init is not None else None
        if init_source is not None:
            return Site(init_source[0], init_source[2])
        return Site(path, start)
    return UNKNOWN


def param_site(model: Any, tensor_name: str) -> Site:
    """Where the user's code creates the parameter or buffer ``a.b.weight`` of ``model``.

    The owning module's user class assigns it (``self.weight = nn.Parameter``); for a torch layer
    (``nn.Linear`` inside the user's Block) it is the line of the closest user parent that assigns the layer.
    """
    parts = tensor_name.split(".")
    chain: list[tuple[Any, str]] = []  # (module, attribute of the next step)
    module = model
    for part in parts:
        chain.append((module, part))
        child = getattr(module, "_modules", {}).get(part)
        if child is None:
            break
        module = child
    for owner, attr in reversed(chain):
        site = assignment_site(owner, attr)
        if site:
            return site
    return UNKNOWN


def forward_site(model: Any) -> Site:
    """The user's forward method (the outermost user class that defines one)."""
    for klass in type(model).__mro__:
        if "forward" not in klass.__dict__ or not _is_user_class(klass):
            continue
        source = _source_of(klass.__dict__["forward"])
        if source is not None:
            return Site(source[0], source[2])
    return UNKNOWN
