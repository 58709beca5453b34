"""The one classifier of frames (analysis/frame_owner.py): user / library / torch / distcheck / python."""
from __future__ import annotations

import ast
import inspect
import os
import threading
from pathlib import Path

import pytest
import torch

import distcheck
from distcheck.analysis.frame_owner import display_path, is_user, location, native_owner, owner

PKG = Path(os.path.dirname(distcheck.__file__))
REPO = Path(__file__).resolve().parents[2]
SITE = "/opt/venv/lib/python3.11/site-packages"


def _package_files() -> list[Path]:
    files = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 50 and any(len(p.relative_to(PKG).parts) >= 3 for p in files)  # nested: rank/autocheck/
    return files


def test_every_file_of_the_installed_package_is_distcheck():
    wrong = [str(p) for p in _package_files() if owner(str(p)) != "distcheck"]
    assert not wrong


def test_every_file_of_the_package_is_distcheck_wherever_it_is_installed():
    """Stack dumps come from other machines and venvs: a site-packages install, an editable checkout elsewhere."""
    for p in _package_files():
        rel = p.relative_to(PKG).as_posix()
        for path in (f"{SITE}/distcheck/{rel}", f"/usr/lib/python3/dist-packages/distcheck/{rel}",
                     f"/ci/src/distcheck/distcheck/{rel}", f"/home/me/tools/dc/distcheck/{rel}"):
            assert owner(path) == "distcheck", path
            assert display_path(path) == f"distcheck/{rel}"


def test_this_repos_fixtures_and_tests_are_user_code():
    """They sit next to the package, not in it: a hang in a fixture must name the fixture's line."""
    files = list((REPO / "fixtures").glob("*.py")) + list((REPO / "tests").rglob("*.py"))
    assert files
    assert [str(p) for p in files if owner(str(p)) != "user"] == []
    assert owner("/work/main/fixtures/hang_python.py") == "user" and is_user("/work/main/fixtures/hang_python.py")
    assert owner("/home/me/proj/train.py") == "user"
    # a user's directory that merely shares a name with distcheck or torch is still the user's
    assert owner("/home/me/distcheck/train.py") == "user" and owner("/home/me/torch/train.py") == "user"


def test_torch_files():
    torch_dir = Path(torch.__file__).parent
    real = [torch_dir / "__init__.py", torch_dir / "nn" / "modules" / "module.py",
            torch_dir / "distributed" / "distributed_c10d.py", Path(inspect.getfile(inspect.unwrap(torch.autograd.backward)))]  # distcheck may wrap it
    for p in real:
        assert p.exists() and owner(str(p)) == "torch", p
    for path in (f"{SITE}/torch/distributed/distributed_c10d.py", f"{SITE}/functorch/_src/vmap.py",
                 f"{SITE}/torchgen/model.py", f"{SITE}/triton/runtime/jit.py",
                 "/opt/pytorch/torch/distributed/fsdp/_fully_shard/_fsdp_state.py",  # a source build elsewhere
                 "torch/distributed/distributed_c10d.py"):  # py-spy's short file name
        assert owner(path) == "torch", path
    assert display_path(f"{SITE}/torch/distributed/distributed_c10d.py") == "torch/distributed/distributed_c10d.py"


def test_standard_library_and_interpreter_machinery_are_python():
    for path in (threading.__file__, inspect.__file__, ast.__file__, "/usr/lib/python3.11/threading.py",
                 "/usr/lib64/python3.12/concurrent/futures/thread.py", "/opt/conda/lib/python3.13t/runpy.py",
                 "<frozen runpy>", "<frozen importlib._bootstrap>", "<string>", "<stdin>", ""):
        assert owner(path) == "python", path
        assert not is_user(path)


def test_third_party_packages_are_libraries_not_user_code():
    for path in (f"{SITE}/lightning/pytorch/core/module.py", f"{SITE}/transformers/trainer.py",
                 f"{SITE}/torchtitan/train.py", f"{SITE}/six.py",
                 "/usr/lib/python3/dist-packages/numpy/core/numeric.py",
                 # a system Python: its site-packages lies inside the standard library's directory
                 "/usr/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py",
                 "/home/me/.local/lib/python3.11/site-packages/accelerate/accelerator.py",
                 str(Path(pytest.__file__))):
        assert owner(path) == "library", path
        assert not is_user(path)
    assert location(f"{SITE}/lightning/pytorch/core/module.py", 512, "log") == \
        "lightning/pytorch/core/module.py:512 in log"
    assert location("/home/me/proj/train.py", 40) == "train.py:40"


def test_console_scripts_of_this_interpreter_are_libraries():
    """``.venv/bin/pytest`` or ``torchrun`` is the entry point of an installed package: when a checkout holds its
    venv (``/work/proj/.venv/bin/pytest``), the path alone would say "user"."""
    import sysconfig

    scripts = sysconfig.get_paths()["scripts"]
    assert owner(os.path.join(scripts, "pytest")) == owner(os.path.join(scripts, "torchrun")) == "library"


def test_a_symlinked_install_is_classified_by_where_it_really_is(tmp_path):
    (tmp_path / "dc").symlink_to(PKG, target_is_directory=True)
    assert owner(str(tmp_path / "dc" / "rank" / "usersite.py")) == "distcheck"
    (tmp_path / "train.py").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "train.py")
    assert owner(str(tmp_path / "link.py")) == "user"


def test_native_frames():
    assert native_owner("libtorch_cpu.so", "c10d::ProcessGroupGloo::wait") == "torch"
    assert native_owner("libc10.so", "c10::ThreadPool::run") == "torch"
    assert native_owner("libgloo.so", "gloo::transport::tcp::UnboundBuffer::waitRecv") == "torch"
    assert native_owner("libnccl.so.2", "ncclAllReduce") == "torch"
    assert native_owner("_C.cpython-311-x86_64-linux-gnu.so", "THPModule_x") == "torch"
    assert native_owner("/pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp", "wait") == "torch"
    assert native_owner(f"{SITE}/torch/lib/libgomp-a34b3233.so.1", "gomp_barrier_wait") == "torch"
    assert native_owner("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault") == "python"
    assert native_owner("python3.11", "main") == "python"
    assert native_owner("libffi.so.8.1.2", "ffi_call") == "python"
    assert native_owner("Python/ceval.c", "_PyEval_EvalFrameDefault") == "python"
    assert native_owner("libc.so.6", "PyObject_Call") == "python"  # by its name: the interpreter's C API
    assert native_owner("?", "0x7f3a2b1c") == "python"
    # what blocks is often here: never the user's line, but shown
    assert native_owner("libc.so.6", "clock_nanosleep") == "library"
    assert native_owner("libstdc++.so.6", "std::condition_variable::wait") == "library"


def test_the_classifier_does_not_import_torch():
    """It runs in the supervisor and in `distcheck stacks`/`report`, which must not pay for torch."""
    source = (PKG / "analysis" / "frame_owner.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported and "distcheck" not in imported, imported


def test_the_pytest_pool_drops_only_its_own_runner_frames_from_a_failing_tests_traceback():
    from traceback import FrameSummary

    from distcheck.testing.pool_worker import _without_runner

    runner = str(PKG / "testing" / "pool_worker.py")
    stack = [FrameSummary(runner, 160, "main"),
             FrameSummary("/home/me/proj/tests/pool_worker.py", 12, "test_allreduce"),  # the user's, same name
             FrameSummary(f"{SITE}/torch/distributed/distributed_c10d.py", 2806, "all_reduce"),
             FrameSummary(str(PKG / "rank" / "tracer.py"), 500, "wrapper")]
    assert [f.name for f in _without_runner(stack)] == ["test_allreduce", "all_reduce", "wrapper"]
    assert [f.name for f in _without_runner(stack[:1])] == ["main"]  # nothing of the test's: keep what there is


def test_torchs_frames_name_the_phase_their_rank_is_in():
    from distcheck.analysis.frame_owner import in_torch_nn, torch_phase

    site = "/venv/lib/python3.11/site-packages/torch"
    assert torch_phase(f"{site}/utils/data/dataloader.py") == "data loading"
    assert torch_phase(f"{site}/autograd/__init__.py") == "backward"
    assert torch_phase("C:\\venv\\Lib\\site-packages\\torch\\optim\\adamw.py") == "optimizer step"
    assert torch_phase(f"{site}/_tensor_str.py") == "host sync"
    assert torch_phase(f"{site}/distributed/distributed_c10d.py") is None and torch_phase("/w/train.py") is None
    assert in_torch_nn(f"{site}/nn/modules/module.py") and not in_torch_nn(f"{site}/optim/sgd.py")
