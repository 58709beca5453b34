"""No bug: torchtitan's own trainer (``python -m torchtitan.train``) with its llama3 debug model, on 2 CPU ranks.

    cd TORCHTITAN_CHECKOUT && python -m distcheck run --nproc 2 --timeout 120 -- \
        /path/to/tools/real_clients/torchtitan_train.py --module llama3 --config llama3_debugmodel \
        --training.steps 3 --training.seq_len 128 --training.local_batch_size 2 --comm.init_timeout_seconds 120

Runs ``torchtitan.train.main()`` with the given arguments, unchanged, except for the device when this machine has
no accelerator. torchtitan picks its device once, at import of torchtitan.tools.utils, as
``torch._utils._get_available_device_type() or "cuda"``: on a CPU-only torch it takes "cuda" and the first thing
the Trainer does, ``torch.cuda.set_device(...)``, raises (AttributeError: module 'torch._C' has no attribute
'_cuda_setDevice'). So, as pytorch/examples' device lines are substituted for CPU, this wrapper makes that device
"cpu" (torchtitan then uses gloo through ``default_device_backend_map``, a "cpu" device mesh and CPU
tensors) and gives ``torch.cpu`` stand-ins for the five memory-statistics calls of torchtitan's
DeviceMemoryMonitor, which torch.cpu lacks. Model, parallelization (FSDP2 over the 2 ranks), data loader,
loss and optimizer are torchtitan's own. Set DISTCHECK_TORCHTITAN_NO_CPU_SHIM=1 to run it without the stand-ins.
"""
import os
import types

import torch
import torch._utils


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("torch_cpu_for_torchtitan")
    mod.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    props = types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: props
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_stats = lambda device=None: {}
    return mod


def main() -> None:
    if not torch.accelerator.is_available() and not os.environ.get("DISTCHECK_TORCHTITAN_NO_CPU_SHIM"):
        cpu = _cpu_device_module()
        torch._utils._get_available_device_type = lambda: "cpu"
        original = torch._utils._get_device_module
        torch._utils._get_device_module = lambda device_type: cpu if device_type == "cpu" else original(device_type)
        import torchtitan.tools.utils as tt_utils  # binds device_type/device_module now, from the two above
        assert tt_utils.device_type == "cpu", tt_utils.device_type
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
