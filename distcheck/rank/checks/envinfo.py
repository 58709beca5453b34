"""This rank's environment snapshot: versions, devices, and the settings that change distributed behaviour."""
from __future__ import annotations

import os
import platform
import socket

import torch

from distcheck.contract import env

# Environment variables that change how collectives, kernels or threads behave. Prefixes match whole families.
ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHELASTIC_", "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "GLOO_", "CUBLAS_",
                "CUDNN_", "NVIDIA_", "FI_", "UCX_", "MKL_", "KMP_", env.BACKEND)
ENV_NAMES = ("OMP_NUM_THREADS", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LD_PRELOAD")

# Keys that legitimately differ between hosts or ranks: shown in the report, never flagged. CUDA_VISIBLE_DEVICES
# differs per rank in one-GPU-per-task launches (Slurm); what must agree is the device count, which is compared.
HOST_SPECIFIC = frozenset({
    "hostname", "env.TORCHELASTIC_ERROR_FILE", "env.CUDA_VISIBLE_DEVICES", "env.TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "env.MASTER_ADDR", "device.index",
})


def _relevant_env(environ: dict[str, str]) -> dict[str, str]:
    return {f"env.{k}": v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def snapshot(device: torch.device, backend: str, config: dict[str, str] | None = None) -> dict[str, str]:
    """Everything two ranks should agree on (plus host-specific keys shown for context), as strings."""
    import numpy

    from distcheck.contract.version import __version__

    cuda = torch.cuda.is_available()
    nccl = ""
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            nccl = "unavailable"
    info = {
        "version.torch": torch.__version__,
        "version.python": platform.python_version(),
        "version.numpy": numpy.__version__,
        "version.cuda": str(torch.version.cuda or "none"),
        "version.nccl": nccl or "none",
        "version.distcheck": __version__,
        "hostname": socket.gethostname(),
        "device.type": device.type,
        "device.count": str(torch.cuda.device_count() if cuda else 0),
        "device.index": str(device.index if device.index is not None else ""),
        "device.name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),  # processor() runs `uname -p` in a subprocess
        "backend": backend,
        "torch.default_dtype": str(torch.get_default_dtype()),
        "torch.deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "torch.num_threads": str(torch.get_num_threads()),
        "torch.matmul_precision": torch.get_float32_matmul_precision(),
    }
    if cuda:
        info["torch.cuda.matmul.allow_tf32"] = str(torch.backends.cuda.matmul.allow_tf32)
        info["torch.cudnn.allow_tf32"] = str(torch.backends.cudnn.allow_tf32)
    info.update(_relevant_env(dict(os.environ)))
    for key, value in (config or {}).items():
        info[f"config.{key}"] = value
    return info
