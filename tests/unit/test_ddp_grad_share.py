"""Which rank of a DDP group checks a step's gradients (rank/autocheck/ddp_grad_share.py), on a module standing in
for DDP (its forward calls the inner module, as DDP's does): no process group, no rank launched.

    python -m pytest tests/unit/test_ddp_grad_share.py
"""
from __future__ import annotations

import contextlib

import torch

from distcheck.rank.autocheck.ddp_grad_share import DdpGradShare


class FakeDDP(torch.nn.Module):
    """The attributes of DDP that decide whether its gradients are all-reduced."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner
        self.require_backward_grad_sync = True
        self._comm_hooks: list = []

    def forward(self, x):
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True


def setup(rank: int = 1, size: int = 2):
    model = FakeDDP(torch.nn.Linear(4, 2))
    share = DdpGradShare(group_of=lambda m: (rank, size, list(range(size))))
    share.watch(model)
    return model, share, torch.optim.SGD(model.parameters(), lr=0.1)


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def step(model, forward, x=None):
    forward(torch.ones(3, 4) if x is None else x).sum().backward()


def test_synced_steps_are_checked_by_one_rank_in_turn():
    model, share, opt = setup(rank=1)
    turns = []
    for i in range(4):
        step(model, model)
        s = share.share(opt, params_of(opt), i)
        turns.append(s.mine)
        assert s.ranks == [0, 1]
    assert turns == [False, True, False, True]


def test_a_step_whose_gradients_may_differ_across_ranks_is_checked_by_every_rank():
    model, share, opt = setup()
    step(model, model.module)  # model.module(x): DDP's forward never ran, nothing was all-reduced
    assert share.share(opt, params_of(opt), 0) is None
    step(model, model)
    step(model, model.module)  # one synced forward, one that bypassed DDP: the accumulated gradients are local too
    assert share.share(opt, params_of(opt), 1) is None
    with model.no_sync():
        step(model, model)
    assert share.share(opt, params_of(opt), 2) is None  # a step after no_sync() alone: nothing was all-reduced
    with torch.no_grad():
        model(torch.ones(1, 4))  # an evaluation forward arms no all-reduce
    assert share.share(opt, params_of(opt), 3) is None
    step(model, model)
    assert share.share(opt, params_of(opt), 4) is not None  # a plain synced step again
    model._comm_hooks.append((lambda state, bucket: None, None))  # post-local SGD reduces within subgroups only
    step(model, model)
    assert share.share(opt, params_of(opt), 5) is None


def test_parameters_outside_the_ddp_model_or_a_second_ddp_model_end_the_sharing():
    model, share, _ = setup()
    extra = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    step(model, model)
    # the optimizer also steps a parameter only this rank's code touched
    assert share.share(opt, params_of(opt), 0) is None
    single, share, opt = setup(size=1)
    step(single, single)
    assert share.share(opt, params_of(opt), 0) is None  # a group of one: nobody to share with
    model, share, opt = setup()
    share.watch(FakeDDP(torch.nn.Linear(4, 2)))
    step(model, model)
    assert share.share(opt, params_of(opt), 0) is None and share.off
    assert not model._forward_pre_hooks and not model.module._forward_pre_hooks  # its hooks are gone


def test_gradient_accumulation_under_no_sync_is_shared_once_the_synced_backward_reduced_it():
    """Micro-batches under no_sync(), then one synced forward and backward: DDP all-reduces the accumulated
    gradients, identical on every rank (a call of model.module inside no_sync() is accumulated and reduced too)."""
    model, share, opt = setup(rank=0)
    with model.no_sync():
        step(model, model)
        step(model, model.module)
    step(model, model)
    s = share.share(opt, params_of(opt), 0)
    assert s is not None and s.mine
