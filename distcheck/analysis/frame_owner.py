"""The one rule for "whose frame is this": every frame distcheck names, collapses or skips is classified here.

    from distcheck.analysis.frame_owner import owner, is_user, native_owner, location

    owner("/home/me/proj/train.py")                                                    # "user"
    owner("/venv/lib/python3.11/site-packages/lightning/pytorch/core/module.py")       # "library"
    owner("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")  # "torch"
    owner("/work/main/distcheck/rank/autocheck/patches.py")                            # "distcheck"
    owner("/usr/lib/python3.11/threading.py"), owner("<frozen runpy>")                 # "python", "python"
    native_owner("libtorch_cpu.so", "c10d::ProcessGroupGloo::wait")                    # "torch"
    location("/venv/lib/python3.11/site-packages/lightning/pytorch/core/module.py", 512, "log")
    # -> "lightning/pytorch/core/module.py:512 in log"

The rule for a Python frame's file, in order of precedence (the first owner that applies wins):

1. ``python``: no file, or interpreter machinery named ``<...>`` (``<frozen runpy>``, ``<string>``);
2. ``distcheck``: any file of the distcheck package at any depth, installed or an (editable) checkout;
3. ``torch``: torch, functorch, torchgen, triton;
4. ``library``: anything else installed as a package (site-packages / dist-packages): lightning, transformers,
   torchtitan, pytest, ..., and the console scripts installed into this interpreter's scripts directory
   (``.venv/bin/pytest``, ``torchrun``);
5. ``python``: the standard library;
6. ``user``: everything else: the user's scripts and project, their tests, and this repository's fixtures/ and
   tests/ (they are not part of the distcheck package).

Each owner is recognized both by path patterns, so that stack dumps taken on another machine or venv classify the
same, and by this interpreter's real install roots when they are known (a torch built from source, a venv laid out
unusually, symlinked installs). Only ``user`` frames are ever "the user's line"; a library's frames are shown as
the call the user's line made into it (``via``), never as the line itself.

Native frames (``py-spy --native``) are never the user's line: torch's and its backends' libraries are ``torch``,
the interpreter's (libpython, ctypes/ffi plumbing) are ``python``, a native file inside a classified install keeps
that owner, and everything else (libc, libstdc++, a BLAS) is ``library``: shown, because it is often what blocks.
"""
from __future__ import annotations

import functools
import os
import re
import sys

USER, LIBRARY, TORCH, DISTCHECK, PYTHON = "user", "library", "torch", "distcheck", "python"
OWNERS = (USER, LIBRARY, TORCH, DISTCHECK, PYTHON)
# Where two rules disagree (a venv's platstdlib holds its site-packages; torch lives inside site-packages), the
# more specific owner wins.
_PRECEDENCE = (DISTCHECK, TORCH, LIBRARY, PYTHON, USER)

_TORCH_PACKAGES = frozenset({"torch", "functorch", "torchgen", "triton"})
_INSTALL_DIRS = frozenset({"site-packages", "dist-packages"})
# Top-level entries of torch that identify a source checkout of it (/opt/pytorch/torch/distributed/...) on a machine
# where torch's own directory is unknown; the local torch's listing is added when torch is installed here.
_TORCH_CORE = frozenset({"__init__.py", "_tensor.py", "_ops.py", "functional.py", "overrides.py", "_utils.py",
                         "distributed", "nn", "autograd", "cuda", "utils", "optim", "fx", "_dynamo", "_inductor",
                         "_functorch", "_higher_order_ops", "_subclasses", "_prims", "_refs", "_C", "csrc"})
_STDLIB = re.compile(r"(^|/)lib(64)?/(python|pypy)3\.\d+t?/")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this distcheck's own directory

_TORCH_NATIVE = re.compile(r"^(libtorch|libc10|libgloo|libnccl|libshm|libcudart|libcuda|libcudnn|libcublas|libnvrtc|"
                           r"libtriton|_C\.)")
_TORCH_NATIVE_SOURCE = re.compile(r"(^|/)(torch/csrc|c10|aten/src|third_party/(gloo|nccl|kineto|tensorpipe))/")
# Interpreter and ctypes plumbing: collapsed, so that the frame that actually blocks stays visible.
_PYTHON_NATIVE = re.compile(r"^(libpython|python3|libffi|_ctypes|callproc\.c|_ctypes\.c|ceval\.c|call\.c)")
_PYTHON_NATIVE_SOURCE = re.compile(r"(^|/)(Python|Objects|Modules|Parser|Include)/[^/]+\.[ch]$")


@functools.lru_cache(maxsize=None)
def owner(filename: str) -> str:
    """``user``, ``library``, ``torch``, ``distcheck`` or ``python`` for a Python frame's file (cached per name)."""
    if not filename or filename.startswith("<"):
        return PYTHON
    path = filename.replace("\\", "/")
    found = {_by_pattern(path), _by_root(path)}
    if os.path.isabs(filename):  # symlinked installs: the real path may be the one under a known root
        found.add(_by_root(os.path.realpath(filename)))
    return next(o for o in _PRECEDENCE if o in found)


def is_user(filename: str) -> bool:
    """Whether a frame's file is the user's own code: the only frames that can be "the user's line"."""
    return owner(filename) == USER


def native_owner(filename: str, name: str = "") -> str:
    """The owner of a native frame: its library (``libtorch_cpu.so``) or C source file, and its function name."""
    base = os.path.basename(filename)
    if _TORCH_NATIVE.match(base) or _TORCH_NATIVE_SOURCE.search(filename):
        return TORCH
    if (_PYTHON_NATIVE.match(base) or _PYTHON_NATIVE_SOURCE.search(filename)
            or name.startswith(("_Py", "Py", "0x"))):
        return PYTHON
    if "/" in filename:  # site-packages/torch/lib/..., distcheck's own extension, the stdlib's lib-dynload
        placed = owner(filename)
        if placed != USER:
            return placed
    return LIBRARY


@functools.lru_cache(maxsize=None)
def display_path(filename: str) -> str:
    """The file as a reader recognizes it: its path inside its package for installed and known code
    (``lightning/pytorch/core/module.py``, ``distcheck/rank/tracer.py``), else its base name (``train.py``)."""
    if not filename or filename.startswith("<"):
        return filename
    path = filename.replace("\\", "/")
    parts = path.split("/")
    installed = _install_index(parts)
    if installed is not None and installed + 1 < len(parts):
        return "/".join(parts[installed + 1:])
    start = _checkout_index(parts)
    if start is not None:
        return "/".join(parts[start:])
    for form in (path, os.path.realpath(filename) if os.path.isabs(filename) else path):
        for root, who in _local_roots():
            if form.startswith(root):
                # distcheck's and torch's roots are the package directory itself: keep its name in front
                base = os.path.dirname(root.rstrip("/")) if who in (DISTCHECK, TORCH) else root.rstrip("/")
                return os.path.relpath(form, base).replace("\\", "/")
    return os.path.basename(path)


def package(filename: str) -> str:
    """The top-level package a library frame belongs to (``lightning``), or the native library's file name."""
    return display_path(filename).split("/", 1)[0]


def location(filename: str, line: int | None, name: str | None = None) -> str:
    """``lightning/pytorch/core/module.py:512 in log``: how a frame that is not the user's is named."""
    text = display_path(filename) + (f":{line}" if line else "")  # contract/site.with_line's form (see above)
    return f"{text} in {name}" if name else text


# The parts of torch whose frames say what a rank is doing (the sampler's phases, the optimizer step's frame).
_TORCH_PHASES = (("/torch/utils/data/", "data loading"), ("/torch/autograd/", "backward"),
                 ("/torch/optim/", "optimizer step"))


def torch_phase(filename: str) -> str | None:
    """What a frame of torch's says its rank is doing: "data loading", "backward", "optimizer step", "host sync"
    (printing a tensor), or None (another part of torch, or not torch)."""
    path = filename.replace("\\", "/")
    for part, phase in _TORCH_PHASES:
        if part in path:
            return phase
    return "host sync" if path.endswith("/torch/_tensor_str.py") else None


def in_torch_nn(filename: str) -> bool:
    """A frame of torch.nn (a module's forward machinery)."""
    return "/torch/nn/" in filename.replace("\\", "/")


# --- the two kinds of evidence -------------------------------------------------------------------------------


def _install_index(parts: list[str]) -> int | None:
    """Index of the last site-packages / dist-packages directory of a path (an .egg directory counts with it)."""
    index = None
    for i, part in enumerate(parts[:-1]):
        if part in _INSTALL_DIRS:
            index = i
    if index is not None:
        while index + 2 < len(parts) and parts[index + 1].endswith(".egg"):
            index += 1
    return index


def _checkout_index(parts: list[str]) -> int | None:
    """Index of the ``distcheck`` or ``torch`` directory of a source checkout in a path, recognized by what it
    holds (``distcheck/rank/...``), so that a user's directory that happens to be named so is not taken for it."""
    for i in range(len(parts) - 1):
        if parts[i] == "distcheck" and parts[i + 1] in _distcheck_entries():
            return i
        if parts[i] == "torch" and parts[i + 1] in _torch_entries():
            return i
    if parts and parts[0] in _TORCH_PACKAGES and len(parts) > 1:  # py-spy's short names: torch/distributed/...
        return 0
    return None


def _by_pattern(path: str) -> str:
    parts = path.split("/")
    installed = _install_index(parts)
    if installed is not None:  # the first directory under site-packages names the package
        top = parts[installed + 1]
        top = top[:-3] if top.endswith(".py") else top
        if top == "distcheck":
            return DISTCHECK
        return TORCH if top in _TORCH_PACKAGES else LIBRARY
    start = _checkout_index(parts)
    if start is not None:
        return DISTCHECK if parts[start] == "distcheck" else TORCH
    return PYTHON if _STDLIB.search(path) else USER


def _by_root(path: str) -> str:
    for root, who in _local_roots():
        if path.startswith(root):
            return who
    return USER


@functools.lru_cache(maxsize=1)
def _local_roots() -> tuple[tuple[str, str], ...]:
    """(directory ending in "/", owner) of this interpreter's installs, most specific first: torch lies inside
    site-packages, and a system Python's site-packages inside its standard library."""
    import site
    import sysconfig

    found = [(_PACKAGE_DIR, DISTCHECK)]
    for name in sorted(_TORCH_PACKAGES):
        found += [(d, TORCH) for d in _package_dirs(name)]
    paths = sysconfig.get_paths()
    sites = [paths.get("purelib"), paths.get("platlib")]
    try:
        sites += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    # The interpreter's scripts directory (a venv's bin/) holds the console scripts packages install (pytest,
    # torchrun): their frame is the entry point of an installed package, never the user's code.
    found += [(d, LIBRARY) for d in sites + [paths.get("scripts")] if d]
    found += [(d, PYTHON) for d in (paths.get("stdlib"), paths.get("platstdlib")) if d]
    out: list[tuple[str, str]] = []
    for directory, who in found:
        for form in (os.path.abspath(directory), os.path.realpath(directory)):
            entry = (os.path.join(form, ""), who)
            if entry not in out:
                out.append(entry)
    return tuple(out)


def _package_dirs(name: str) -> list[str]:
    """Where a top-level package is installed here, without importing it (classifying must not import torch)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if spec is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
    return list(spec.submodule_search_locations or []) if spec is not None else []


def _listing(directory: str) -> set[str]:
    """A package directory's modules and subpackages."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {n for n in names if n.endswith(".py") or os.path.isfile(os.path.join(directory, n, "__init__.py"))}


@functools.lru_cache(maxsize=1)
def _distcheck_entries() -> frozenset[str]:
    # The package's own listing is the truth about its layout, for every checkout of this version.
    return frozenset(_listing(_PACKAGE_DIR))


@functools.lru_cache(maxsize=1)
def _torch_entries() -> frozenset[str]:
    local: set[str] = set()
    for directory in _package_dirs("torch"):
        local |= _listing(directory)
    return _TORCH_CORE | frozenset(local)
