"""The zero-code checks every rank runs, in the order each event reaches them (one line a check).

    python -m distcheck run --nproc 2 -- train.py      # rank/autocheck/core.AutoCheck builds each as Cls(core)

The order matters where two checks act on the same object: ModelWatch registers its forward pre-hook on a wrapped
model before DPInputs prepends its own (which then runs first, at the first training forward); FrozenWatch reads a
step's gradients before AutoRecords gathers them. Each check's name is its key in ``autocheck-rank<R>.json`` and in
analysis/check_table.py.
"""
from __future__ import annotations

from distcheck.contract.autocheck_file import RESERVED
from distcheck.rank.autocheck.async_work import AsyncWatch
from distcheck.rank.autocheck.auto_records import AutoRecords
from distcheck.rank.autocheck.checkpoint_load import LoadWatch
from distcheck.rank.autocheck.dcp_roundtrip import DcpWatch
from distcheck.rank.autocheck.discovery import ModelWatch
from distcheck.rank.autocheck.dp_inputs import DPInputs
from distcheck.rank.autocheck.frozen_step import FrozenWatch
from distcheck.rank.autocheck.module_summaries import ModuleSummaries
from distcheck.rank.autocheck.nan_watch import NanWatch
from distcheck.rank.autocheck.pipeline_schedule import PipelineWatch
from distcheck.rank.autocheck.precision import PrecisionNotes
from distcheck.rank.autocheck.prewrap import PreWrap
from distcheck.rank.autocheck.replica_drift import ReplicaDrift
from distcheck.rank.autocheck.tp_inputs import TPInputs

CHECKS = (
    ModelWatch,  # models: the first-forward model check (discovery.py)
    FrozenWatch,  # frozen: optimizer steps with nothing to update
    AutoRecords,  # auto_records: zero-code compare's records
    ReplicaDrift,  # replica_drift: fingerprints of the replicas after the first steps
    ModuleSummaries,  # modules: per-module summaries of the first step (compare)
    AsyncWatch,  # async_work: async collectives stepped on before their wait
    NanWatch,  # nan_watch: the first NaN/Inf loss or gradient
    PreWrap,  # prewrap: the model compared where it is parallelized
    PrecisionNotes,  # precision: where the rank computed in 16 bits
    LoadWatch,  # checkpoint_load: a load_state_dict(strict=False) that loaded nothing
    DcpWatch,  # dcp_roundtrip: DCP's partial loads, and resumes that do not read back what the run saved
    TPInputs,  # tp_inputs: a TP group's replicated-input layers fed different batches
    DPInputs,  # dp_inputs: data-parallel ranks fed the same first batch
    PipelineWatch,  # pipeline: each stage's schedule
)

assert len({c.name for c in CHECKS}) == len(CHECKS) and not {c.name for c in CHECKS} & set(RESERVED), \
    "every check needs a name of its own, none of the state file's run-level keys"
