"""Keep every process group that ``destroy_process_group`` lets go of referenced from Python until the rank ends.

    python -m distcheck run --nproc 2 -- train.py      # every rank installs it (rank_bootstrap, the test pool)

Why: a deadlock in torch (2.13, gloo) at the end of an ordinary DDP script. The script calls
``dist.destroy_process_group()``, then returns, and its DDP model is freed. pybind frees the Reducer with the GIL
held. If the Reducer holds the last reference to the process group, ProcessGroupGloo's destructor runs under that
GIL and joins its worker threads. A worker may still be destroying the last backward's allreduce Work. That Work's
ThreadLocalState holds the ``contextvars.Context`` that autograd stashes for every backward, and dropping it needs
the GIL. Neither thread moves again. This suite caught it with ``py-spy dump --native``: the rank stuck in
``<module>`` at ``main()`` of fixtures/cmp_dropout_rng.py, under load, about one run of the suite in three.

When Python drops the last reference instead, torch's binding releases the GIL before the destructor runs
(``intrusive_ptr_no_gil_destructor``). Ranks end with ``os._exit`` (runtime.end_rank), so a group kept here is
never destroyed at all. The pytest pool, which runs many tests in one process, calls ``release()`` after each test,
once the test's own objects are gone.
"""
from __future__ import annotations

import functools
import gc
import logging
from typing import Any

log = logging.getLogger("distcheck")

_kept: list[Any] = []
_installed = False


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (both names users reach it by); once per process."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        try:
            _kept.extend(_groups_destroyed_by(c10d, group))
        except Exception as exc:  # torch's bookkeeping changed: destroy as before, without the keep-alive
            log.debug("cannot keep the destroyed process groups: %s", exc)
        return original(group)

    for module in (c10d, dist):
        if getattr(module, "destroy_process_group", None) is original:
            module.destroy_process_group = destroy_process_group
    _installed = True


def _groups_destroyed_by(c10d: Any, group: Any) -> list[Any]:
    if group is None or group is c10d.GroupMember.WORLD:
        return list(c10d._world.pg_map)  # every group goes, the default one too
    return [group]


def release() -> None:
    """Drop the kept groups, from Python (so with the GIL released), once nothing else of the test's is alive."""
    if not _kept:
        return
    gc.collect()  # a test's models caught in reference cycles go first: their Reducers then drop their references
    _kept.clear()


def kept() -> int:
    """How many destroyed process groups are held (for tests)."""
    return len(_kept)
