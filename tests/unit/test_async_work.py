"""The async-work watch (rank/autocheck/async_work.py) on real tensors and stand-in Works: what counts as waited,
and which readers make a Work not waited for a finding."""
from __future__ import annotations

import torch

from distcheck.rank.autocheck.async_work import AsyncWatch
from distcheck.rank.usersite import Site

AT = Site("/w/train.py", 30)


class Work:
    """Only its identity matters to the watch."""


def watch_and_model():
    found = []
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    return AsyncWatch(1, found.extend), found, model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_gradient_reduction_not_waited_before_the_step_is_named_once():
    watch, found, model, opt = watch_and_model()
    for step in range(2):
        for p in model.parameters():
            watch.issued([Work()], "all_reduce", [p.grad], AT)
        watch.on_optimizer_step(opt)
    (f,) = found  # one per line, however many steps and parameters
    assert f.kind == "tensor_divergence" and f.ranks == [1] and f.detail["cause"] == "async_not_waited"
    assert (f.detail["file"], f.detail["line"]) == ("/w/train.py", 30) and f.detail["reader"] == "SGD.step()"
    assert f.message.startswith("all_reduce(..., async_op=True) at train.py:30 reduces gradients that SGD.step()")


def test_waited_works_and_tensors_that_are_no_gradient_are_silent_at_the_step():
    watch, found, model, opt = watch_and_model()
    works = [Work() for _ in model.parameters()]
    for work, p in zip(works, model.parameters()):
        watch.issued([work], "all_reduce", [p.grad], AT)
    metric = Work()
    watch.issued([metric], "all_reduce", [torch.tensor([1.0])], Site("/w/train.py", 40))
    for work in works:
        watch.waited(work)
    watch.on_optimizer_step(opt)
    assert found == []
    watch.waited(metric)
    watch.finish()
    assert found == []


def test_a_work_never_waited_is_named_at_the_end_and_a_second_reduction_of_its_tensor_at_once():
    watch, found, _, _ = watch_and_model()
    t = torch.zeros(4)
    watch.issued([Work()], "all_reduce", [t], Site("/w/train.py", 50))
    watch.issued([Work()], "broadcast", [t[:2]], Site("/w/train.py", 51))  # a view: the same storage
    (race,) = found
    assert race.detail["line"] == 50 and race.detail["reader_line"] == 51
    assert "the next broadcast on the same tensor at train.py:51" in race.message
    watch.finish()
    assert [f.detail["line"] for f in found] == [50, 51] and found[1].detail["reader"] == "the end of the script"
