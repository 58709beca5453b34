"""The async-work watch (rank/autocheck/async_work.py) on real tensors and stand-in Works: what counts as waited,
and which readers make a Work not waited for a finding."""
from __future__ import annotations

from types import SimpleNamespace

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
    core = SimpleNamespace(rank=1, emit=found.extend)  # what the watch needs of rank/autocheck/core.AutoCheck
    return AsyncWatch(core), found, model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_gradient_reduction_not_waited_before_the_step_is_named_once():
    watch, found, model, opt = watch_and_model()
    for step in range(2):
        for p in model.parameters():
            watch.issued([Work()], "all_reduce", [p.grad], AT)
        watch.on_optimizer_step(opt, 0)
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
        watch.on_work_waited(work)
    watch.on_optimizer_step(opt, 0)
    assert found == []
    watch.on_work_waited(metric)
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


def test_other_bytes_of_a_flat_buffer_reduced_slice_by_slice_do_not_race():
    watch, found, _, _ = watch_and_model()
    flat = torch.zeros(8)
    first = Work()
    watch.issued([first], "all_reduce", [flat[:4]], Site("/w/train.py", 60))
    watch.issued([Work()], "all_reduce", [flat[4:]], Site("/w/train.py", 61))
    assert found == []
    watch.on_work_waited(first)
    watch.issued([Work()], "all_reduce", [flat[3:5]], Site("/w/train.py", 62))  # overlaps the second, in flight
    (race,) = found
    assert race.detail["line"] == 61 and race.detail["reader_line"] == 62
    watch.finish()


def test_an_op_that_reads_a_tensor_in_flight_is_named_and_one_after_the_wait_is_not():
    watch, found, _, _ = watch_and_model()
    t, other = torch.ones(4), torch.ones(4)
    work = Work()
    watch.issued([work], "all_reduce", [t], Site("/w/train.py", 70), [t])
    assert torch._C._len_torch_function_stack() == 1  # the read watch is on while a Work is pending
    (other * 2).sum()  # other tensors: silent
    t.shape, t[:2], t.view(2, 2)  # metadata and views touch no bytes
    assert found == []
    t[:2].norm()  # reads bytes the all-reduce writes
    (f,) = found
    assert f.detail["cause"] == "async_not_waited" and f.detail["line"] == 70 and f.detail["reader"] == "norm()"
    assert f.detail["reader_file"] == __file__
    assert "all_reduce(..., async_op=True) at train.py:70 reduces a tensor that norm() at test_async_work.py:" \
        in f.message
    # Named, so no longer pending: the watch passes calls through (popped at the next Work: inside its own call the
    # mode is not on top of the stack).
    assert not watch.reads.mode.active
    work = Work()
    watch.issued([work], "all_reduce", [t], Site("/w/train.py", 71), [t])
    watch.on_work_waited(work)
    assert torch._C._len_torch_function_stack() == 0
    t.norm()
    assert len(found) == 1


def test_reading_what_a_gather_sends_is_safe_and_overwriting_it_is_not():
    watch, found, _, _ = watch_and_model()
    shard, out = torch.ones(4), torch.zeros(8)
    watch.issued([Work()], "all_gather_single", [out, shard], Site("/w/train.py", 80), [out])
    shard.norm()
    assert found == []
    shard.add_(1)  # the peers may receive the new values
    (f,) = found
    assert f.detail["reader"] == "add_()" and "gathers into a tensor that add_() at" in f.message
    assert "overwrites what the all_gather_single may still be sending" in f.message
    watch.finish()


def test_a_users_own_function_mode_keeps_its_stack_and_the_watch_stays_off():
    from torch.overrides import TorchFunctionMode

    class Mine(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    watch, found, _, _ = watch_and_model()
    t = torch.ones(4)
    with Mine() as mine:
        watch.issued([Work()], "all_reduce", [t], Site("/w/train.py", 90), [t])
        assert torch.overrides._get_current_function_mode_stack() == [mine]
    assert torch._C._len_torch_function_stack() == 0
    watch.finish()
    assert [f.detail["reader"] for f in found] == ["the end of the script"]


def test_written_tensors_follow_each_collectives_output_argument():
    from distcheck.rank.autocheck.async_reads import written_tensors

    a, b = torch.ones(2), torch.ones(4)
    assert written_tensors("all_gather_single", (b, a), {}, torch.Tensor) == [b]
    assert written_tensors("reduce_scatter_tensor", (), {"output": a, "input": b}, torch.Tensor) == [a]
    assert written_tensors("gather", (a, [b]), {}, torch.Tensor) == [b]
    assert written_tensors("isend", (a, 1), {}, torch.Tensor) == []
    assert written_tensors("custom_op", (a,), {}, torch.Tensor) is None


def test_a_failure_of_the_watch_itself_never_reaches_the_users_op():
    from distcheck.rank.autocheck.async_reads import make_read_mode

    def broken(*args):
        raise RuntimeError("the watch's own bug")

    with make_read_mode(broken):
        assert (torch.ones(4) * 2).sum().item() == 8.0  # the op ran, and its result is right
