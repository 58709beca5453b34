"""Run distcheck over real, unmodified training clients on 2 gloo CPU ranks and say whether each met its expectation.

    .venv/bin/python tools/real_clients.py --examples /tmp/ex --torchtitan /tmp/torchtitan
    .venv/bin/python tools/real_clients.py --examples /work/.mirror/pytorch+examples/repo --only tp_example,sp_example
    .venv/bin/python tools/real_clients.py --venv /tmp/other-venv --rebuild --only hf_trainer

--examples is a checkout (or unpacked copy, or bare git directory) of pytorch/examples; --torchtitan one of
pytorch/torchtitan (only its tests/assets/tokenizer is used; tests/assets/c4_test/data.json too when present, else a
small synthetic data set in the same JSON-lines format). A client whose source is not given is SKIPPED; nothing is
downloaded at run time.

First it builds (or reuses) a scratch venv, default /tmp/distcheck-clients-venv, never the project's .venv:
torch==2.13.0 first, then, each with --no-deps and pinned (PACKAGES below), distcheck's dependencies, transformers,
accelerate, lightning, torchtitan and the dependencies they need at run time; distcheck itself is this working tree,
put on the venv's path by a .pth file (an editable install without the C-extension rebuild into distcheck/, so the
tool always runs the distcheck you are editing). Then each client runs as

    OMP_NUM_THREADS=1 VENV/bin/python -m distcheck run --nproc 2 --report-dir TMP --timeout 120 -- SCRIPT ARGS

(subprocess timeout 300 s) and report.json is read:
  tp_example, sp_example   pytorch/examples distributed/tensor_parallelism/{tensor,sequence}_parallel_example.py,
                           with only the GPU-count gate (-> ``if False:``) and the device type (-> "cpu") substituted.
                           Expected: no finding.
  fsdp2_example            pytorch/examples distributed/FSDP2/example.py, with the GPU gate substituted and
                           ``device_id=device`` dropped from init_process_group (gloo on CPU rejects a device_id that is
                           not an accelerator). Its Transformer.reset_parameters() does not recurse into model.layers,
                           so after meta-device init + to_empty() every block holds uninitialized memory.
                           Expected: a bad_values finding (uninitialized parameters).
  fsdp2_example_initialized  the same, with model.reset_parameters() replaced by a call of reset_parameters() on
                           every submodule that has one (the control). Expected: no finding.
  hf_trainer, accelerate_loop, lightning_ddp   tools/real_clients/*.py (tiny models, synthetic data). Expected: no
                           finding.
  torchtitan               torchtitan.train with --module llama3 --config llama3_debugmodel, 3 steps, through
                           tools/real_clients/torchtitan_train.py (which only makes torchtitan's device "cpu"). Its
                           language models' attention cannot train on CPU (flex: no CPU backward; varlen: CUDA flash
                           attention): that rank failure is reported as SKIPPED with torchtitan's own message.
One line per client: name, package and version, PASS/FAIL/SKIPPED, distcheck's exit code, seconds, and the first
finding (kind and message, 300 characters). Exit status 0 only when every client that ran met its expectation.
A tool run by hand: not part of the test suite.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
CLIENT_DIR = Path(__file__).resolve().parent / "real_clients"
DEFAULT_VENV = Path("/tmp/distcheck-clients-venv")
TORCH = "torch==2.13.0"
DISTCHECK_TIMEOUT = 120
RUN_TIMEOUT = 300.0
MESSAGE = 300

# Installed with --no-deps after TORCH, so pip never replaces torch. Pinned to a set that imports and runs together
# (transformers 5.24 wants huggingface-hub>=1.31, datasets 4.7 (torchtitan) wants <2.0; torchtitan imports triton,
# tensorboard and datasets at import time). To move a client forward, bump its pin and the tool reinstalls.
PACKAGES = {
    "distcheck": ["numpy==2.4.6", "py-spy==0.4.3", "filelock==4.3.1"],
    "huggingface": [
        "transformers==5.24.0", "accelerate==1.15.0", "huggingface-hub==1.33.0", "safetensors==0.8.0",
        "tokenizers==0.23.3", "packaging==26.4", "pyyaml==6.0.4", "regex==2026.11.19", "tqdm==4.70.1",
        "psutil==7.2.2", "fsspec==2026.2.0", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0", "anyio==4.16.0",
        "sniffio==1.3.1", "idna==3.20", "certifi==2026.10.19.post1", "click==8.5.1", "typer==0.29.2",
        "rich==15.0.0", "markdown-it-py==4.3.0", "mdurl==0.1.2", "pygments==2.21.0", "shellingham==1.5.4",
        "annotated-doc==0.0.7", "typing-extensions==4.16.0",
    ],
    "lightning": ["lightning==2.6.6", "lightning-utilities==0.15.3", "torchmetrics==1.9.0"],
    "torchtitan": [
        "torchtitan==0.3.0", "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1", "einops==0.8.2",
        "torchdata==0.11.0", "requests==2.34.2", "urllib3==2.8.0", "charset-normalizer==3.5.3",
        "torch-checkpointing==0.1.1", "spmd-types==0.2.3", "datasets==4.7.0", "pyarrow==26.0.1", "pandas==3.1.1",
        "python-dateutil==4.0.0", "six==1.17.0", "pytz==2026.6", "tzdata==2026.6", "dill==0.4.0",
        "multiprocess==0.70.18", "xxhash==4.1.0", "triton==3.9.0", "tensorboard==2.21.0", "protobuf==7.36.2",
        "absl-py==2.5.1",
    ],
}

# torchtitan rank failures that mean "this cannot train on a CPU", not a distcheck or torchtitan bug.
CPU_LIMITS = (
    "FlexAttention does not support backward on CPU",
    "'aten::_flash_attention_forward' with arguments from the 'CPU' backend",
    "module 'torch._C' has no attribute '_cuda_setDevice'",
    "Torch not compiled with CUDA enabled",
)


# ---------------------------------------------------------------------------------------------------------- venv
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pip(venv: Path, args: list[str], timeout: float = 1200) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        noise = "is ignored: it is neither a file nor a directory"
        out = "\n".join(l for l in (proc.stdout + proc.stderr).splitlines() if noise not in l)
        raise SystemExit(f"pip failed ({' '.join(args)[:200]}):\n{out[-3000:]}")


def build_venv(venv: Path, python: str, rebuild: bool) -> None:
    packages = [p for group in PACKAGES.values() for p in group]
    spec = hashlib.sha256("\n".join([TORCH, *packages, str(ROOT)]).encode()).hexdigest()[:16]
    marker = venv / ".distcheck-clients-built"
    if rebuild and venv.exists():
        shutil.rmtree(venv)
    if marker.is_file() and marker.read_text().strip() == spec:
        log(f"reusing {venv}")
        return
    start = time.monotonic()
    if not (venv / "bin" / "python").exists():
        log(f"creating {venv} with {python}")
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    log(f"installing {TORCH}, then {len(packages)} packages with --no-deps (a few minutes the first time)")
    pip(venv, [TORCH])
    pip(venv, ["--no-deps", *packages])
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(out) / "distcheck-working-tree.pth").write_text(f"{ROOT}\n")
    marker.write_text(spec + "\n")
    log(f"venv ready in {time.monotonic() - start:.0f}s")


def versions(venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for d in ('torch', 'transformers', 'accelerate', 'lightning', 'torchtitan'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: out[d] = 'missing'\n"
            "import distcheck; out['distcheck'] = distcheck.__version__ + ' @ ' + distcheck.__file__\n"
            "print(json.dumps(out))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise SystemExit(f"the venv at {venv} is broken (rerun with --rebuild):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


# ------------------------------------------------------------------------------------------------------- sources
def source_tree(path: str | None, subdirs: list[str], work: Path, label: str) -> tuple[Path | None, str]:
    """A directory holding `subdirs` from a checkout, an unpacked copy or a bare git dir; (None, why) if not."""
    if not path:
        return None, f"no {label} given (--{label} PATH)"
    p = Path(path).expanduser().resolve()
    if (p / "HEAD").is_file() and (p / "objects").is_dir():  # a bare (or mirror) git directory: read it
        dest = work / f"{label}-src"
        dest.mkdir(exist_ok=True)
        for sub in subdirs:
            archive = subprocess.run(["git", "--git-dir", str(p), "archive", "HEAD", sub], capture_output=True,
                                     timeout=120)
            if archive.returncode == 0:
                subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=120)
        return dest, ""
    if not p.is_dir():
        return None, f"{label} path {p} does not exist"
    return p, ""


def substituted(src: Path, dest: Path, subs: list[tuple[str, str]]) -> str:
    """Copy src to dest with each (old, new) replaced; '' or what no longer matches upstream."""
    text = src.read_text()
    for old, new in subs:
        n = text.count(old)
        if n != 1:
            return f"substitution target found {n} times in {src.name}: {old!r}"
        text = text.replace(old, new)
    dest.write_text(text)
    return ""


GPU_GATE = ("if not verify_min_gpu_count(min_gpus=_min_gpu_count):", "if False:")
TP_DEVICE = ("device_type = torch.accelerator.current_accelerator().type", 'device_type = "cpu"')
FSDP2_DEVICE_ID = ("init_process_group(backend=backend, device_id=device)", "init_process_group(backend=backend)")
FSDP2_FULL_INIT = ("        model.reset_parameters()\n",
                   "        for _module in model.modules():  # distcheck control: initialize every submodule\n"
                   "            if hasattr(_module, \"reset_parameters\"):\n"
                   "                _module.reset_parameters()\n")


@dataclass
class Client:
    name: str
    package: str
    expect: str  # "pass" or a finding kind that must be found (and only findings of that kind)
    prepare: Callable[["Context"], tuple[list[str], Path] | str]  # (script + args, cwd), or why it is skipped
    note: str = ""


@dataclass
class Context:
    work: Path
    examples: str | None
    torchtitan: str | None
    _cache: dict = field(default_factory=dict)

    def examples_dir(self, sub: str) -> Path | str:
        key = ("examples", sub)
        if key not in self._cache:
            tree, why = source_tree(self.examples, [f"distributed/{sub}"], self.work, "examples")
            if tree is None:
                self._cache[key] = why
            else:
                for cand in (tree / "distributed" / sub, tree / sub):
                    if cand.is_dir():
                        self._cache[key] = cand
                        break
                else:
                    self._cache[key] = f"no distributed/{sub} under {tree}"
        return self._cache[key]


def example_client(sub: str, script: str, subs: list[tuple[str, str]], tag: str):
    def prepare(ctx: Context):
        src = ctx.examples_dir(sub)
        if isinstance(src, str):
            return src
        dest = ctx.work / tag
        shutil.copytree(src, dest)  # a fresh copy per client: FSDP2's example writes checkpoints/ into its cwd
        why = substituted(src / script, dest / script, subs)
        return why or ([script], dest)
    return prepare


def own_client(script: str):
    def prepare(ctx: Context):
        return [str(CLIENT_DIR / script)], ctx.work
    return prepare


def torchtitan_client(ctx: Context):
    tree, why = source_tree(ctx.torchtitan, ["tests/assets/tokenizer", "tests/assets/c4_test"], ctx.work, "torchtitan")
    if tree is None:
        return why
    tokenizer = tree / "tests" / "assets" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        return f"no tests/assets/tokenizer/tokenizer.json under {tree}"
    data = tree / "tests" / "assets" / "c4_test"
    if not (data / "data.json").is_file():  # absent from some mirrors (large file): same format, synthetic text
        data = ctx.work / "c4_synthetic"
        data.mkdir()
        rng = random.Random(0)
        words = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
                 "have an they you were her she there been one all we their has would when if so no more out up "
                 "into do about other time").split()
        with open(data / "data.json", "w") as f:
            for i in range(400):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 300)))
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T00:00:00Z", "url": f"synthetic/{i}"}) + "\n")
    args = [str(CLIENT_DIR / "torchtitan_train.py"), "--module", "llama3", "--config", "llama3_debugmodel",
            "--training.steps", "3", "--training.seq_len", "128", "--training.local_batch_size", "2",
            "--comm.init_timeout_seconds", "120", "--hf_assets_path", str(tokenizer),
            "--dataloader.dataset_path", str(data), "--dump_folder", str(ctx.work / "torchtitan-out"),
            # torchtitan 0.3.0's default spmd_backend "spmd_types" needs a newer torch: torch 2.13.0's fully_shard
            # raises "When dp_mesh_dims is provided, all parameters must be DTensors". The DTensor path:
            "--parallelism.spmd_backend", "partial_dtensor"]
    return args, ctx.work


CLIENTS = [
    Client("tp_example", "torch", "pass",
           example_client("tensor_parallelism", "tensor_parallel_example.py", [GPU_GATE, TP_DEVICE], "tp")),
    Client("sp_example", "torch", "pass",
           example_client("tensor_parallelism", "sequence_parallel_example.py", [GPU_GATE, TP_DEVICE], "sp")),
    Client("fsdp2_example", "torch", "bad_values",
           example_client("FSDP2", "example.py", [GPU_GATE, FSDP2_DEVICE_ID], "fsdp2")),
    Client("fsdp2_example_initialized", "torch", "pass",
           example_client("FSDP2", "example.py", [GPU_GATE, FSDP2_DEVICE_ID, FSDP2_FULL_INIT], "fsdp2-init")),
    Client("hf_trainer", "transformers", "pass", own_client("hf_trainer.py")),
    Client("accelerate_loop", "accelerate", "pass", own_client("accelerate_loop.py")),
    Client("lightning_ddp", "lightning", "pass", own_client("lightning_ddp.py")),
    Client("torchtitan", "torchtitan", "pass", torchtitan_client),
]


# -------------------------------------------------------------------------------------------------------- running
@dataclass
class Result:
    status: str  # PASS, FAIL, SKIPPED
    rc: int | None = None
    seconds: float = 0.0
    detail: str = ""


def first_line(text: str) -> str:
    return " ".join(text.split())[:MESSAGE]


def run_client(client: Client, ctx: Context, venv: Path, timeout: float) -> Result:
    prepared = client.prepare(ctx)
    if isinstance(prepared, str):
        return Result("SKIPPED", detail=prepared)
    argv, cwd = prepared
    report_dir = ctx.work / f"report-{client.name}"
    cmd = [str(venv / "bin" / "python"), "-m", "distcheck", "run", "--nproc", "2", "--report-dir", str(report_dir),
           "--timeout", str(DISTCHECK_TIMEOUT), "--", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    log_path = ctx.work / f"{client.name}.log"
    start = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this run started: its supervisor and its ranks
            proc.wait()
            return Result("FAIL", None, time.monotonic() - start, f"no result within {timeout:.0f}s (log {log_path})")
    seconds = time.monotonic() - start
    report = report_dir / "report.json"
    if not report.is_file():
        tail = log_path.read_text(errors="replace")[-MESSAGE:]
        return Result("FAIL", rc, seconds, f"no report.json: {first_line(tail)}")
    findings = json.loads(report.read_text()).get("findings", [])
    first = f"[{findings[0]['kind']}] {first_line(findings[0]['message'])}" if findings else ""
    if client.name == "torchtitan" and findings and findings[0]["kind"] == "rank_failure":
        limit = next((m for m in CPU_LIMITS if m in findings[0]["message"]), None)
        if limit:
            return Result("SKIPPED", rc, seconds, f"cannot train on CPU: {first}")
    if client.expect == "pass":
        ok = rc == 0 and not findings
        return Result("PASS" if ok else "FAIL", rc, seconds, "no findings" if ok else (first or f"exit {rc}"))
    kinds = {f["kind"] for f in findings}
    ok = rc == 1 and kinds == {client.expect}
    prefix = "expected finding: " if ok else f"expected only {client.expect}, got: "
    return Result("PASS" if ok else "FAIL", rc, seconds, prefix + (first or "no findings"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help="scratch venv to build or reuse (default %(default)s)")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter that creates the venv; must be CPython 3.11 for the local torch wheel")
    ap.add_argument("--rebuild", action="store_true", help="delete and rebuild the venv")
    ap.add_argument("--examples", help="pytorch/examples checkout, unpacked copy or bare git dir")
    ap.add_argument("--torchtitan", help="pytorch/torchtitan checkout or bare git dir (for tests/assets)")
    ap.add_argument("--only", help="comma-separated client names: " + ",".join(c.name for c in CLIENTS))
    ap.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per client (default %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, reports) and print it")
    args = ap.parse_args(argv)
    clients = CLIENTS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {c.name for c in CLIENTS})
        if unknown:
            ap.error(f"unknown client(s) {unknown}; known: {[c.name for c in CLIENTS]}")
        clients = [c for c in CLIENTS if c.name in names]

    start = time.monotonic()
    venv = Path(args.venv).expanduser().resolve()
    if venv == (ROOT / ".venv").resolve():
        ap.error("refusing to install into the project's own .venv: choose a scratch --venv")
    build_venv(venv, args.python, args.rebuild)
    vers = versions(venv)
    log(f"torch {vers['torch']}; distcheck {vers['distcheck']}")
    work = Path(tempfile.mkdtemp(prefix="distcheck-clients-"))
    ctx = Context(work, args.examples, args.torchtitan)
    failed = 0
    try:
        for client in clients:
            res = run_client(client, ctx, venv, args.timeout)
            failed += res.status == "FAIL"
            version = f"{client.package} {vers.get(client.package, '?')}"
            rc = "-" if res.rc is None else str(res.rc)
            print(f"{client.name:<26} {version:<22} {res.status:<8} exit={rc:<2} {res.seconds:5.0f}s  {res.detail}",
                  flush=True)
    finally:
        if args.keep:
            log(f"logs and reports kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    log(f"total {time.monotonic() - start:.0f}s; {failed} client(s) did not meet their expectation")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
