"""Pure parts of issue 27's zero-code checks: the frozen-model finding, the before-parallelizing finding, grouped
divergences, and one dispatch per optimizer step whatever wraps the optimizer."""
from __future__ import annotations

import torch

from distcheck.analysis.replica_drift import frozen_finding
from distcheck.analysis.replicas import group_findings
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck.prewrap import prewrap_finding


def _frozen_row(step, cause="gradient_sync_off"):
    return {"step": step, "cause": cause, "params": 4, "backwards": 2, "optimizer": "SGD",
            "site": ["/x/train.py", 30], "built": ["/x/train.py", 20], "sync_off": ["/x/train.py", 25]}


def test_frozen_finding_names_the_sync_line_and_needs_every_checked_step_frozen():
    states = {r: [_frozen_row(0), _frozen_row(1)] for r in (0, 1)}  # {rank: the frozen check's rows}
    f = frozen_finding(states)
    assert f.kind == "bad_values" and f.ranks == [0, 1] and f.detail["cause"] == "gradient_sync_off"
    assert (f.detail["file"], f.detail["line"]) == ("/x/train.py", 25) and "train.py:25" in f.message
    states[1][1]["cause"] = None  # rank 1 updated something at step 1: only rank 0 is frozen
    assert frozen_finding(states).ranks == [0]
    states[0][1]["cause"] = None
    assert frozen_finding(states) is None


def test_frozen_causes_point_at_the_optimizer():
    f = frozen_finding({0: [_frozen_row(0, "requires_grad_false")]})
    assert f.detail["line"] == 20 and "requires_grad=False" in f.message
    assert "no parameters" in frozen_finding({0: [_frozen_row(0, "no_params")]}).message


def _pending(name, rank_seeds=(1234, 1235)):
    return {"name": name, "role": "parameter", "ranks": [0, 1], "blamed": [0, 1], "reference": 0, "point": 0,
            "how": "fully_shard", "site": ["/x/t.py", 33], "max_abs_diff": 0.5 if name == "b" else 0.1,
            "diff_rank": 1, "built": ["/x/t.py", 12], "seeds": {"0": rank_seeds[0], "1": rank_seeds[1]},
            "seed_sites": {"0": ["/x/t.py", 29], "1": ["/x/t.py", 29]}}


def test_prewrap_finding_is_one_for_all_parameters_and_names_the_seed_line():
    f = prewrap_finding({0: [_pending("a"), _pending("b")], 1: [_pending("a"), _pending("b")]})
    assert f.kind == "tensor_divergence" and f.ranks == [0, 1]
    assert f.detail["params"] == ["a", "b"] and f.detail["count"] == 2 and f.detail["max_abs_diff"] == 0.5
    assert f.detail["cause"] == "rank_seeded" and f.detail["line"] == 29 and "t.py:29" in f.message
    same = prewrap_finding({0: [_pending("a", (0, 0))]})
    assert same.detail["cause"] == "rank_dependent_init" and same.detail["line"] == 12
    assert prewrap_finding({0: [], 1: []}) is None


def test_group_findings_makes_one_finding_per_cause():
    found = [Finding("tensor_divergence", [1], f"parameter '{n}' differs", {"name": n, "role": "parameter", "max_abs_diff": d})
             for n, d in (("w", 0.5), ("b", 2.0), ("c", 0.1))]
    [g] = group_findings(found, "at the first forward (t.py:9)", "They were identical at DDP.")
    assert g.detail["params"] == ["w", "b", "c"] and g.detail["count"] == 3 and g.detail["max_abs_diff"] == 2.0
    assert g.message.startswith("3 parameters that must be identical across ranks differ at the first forward")
    assert g.message.endswith("They were identical at DDP.")
    [one] = group_findings(found[:1], "x")
    assert one.detail["params"] == ["w"]


class _Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer in small: an Optimizer whose step() steps its inner optimizers."""

    def __init__(self, params):
        params = list(params)
        self.inner = [torch.optim.SGD(params[:1], lr=0.1), torch.optim.AdamW(params[1:], lr=0.1)]
        super().__init__(params, {})

    def step(self, closure=None):
        for opt in self.inner:
            opt.step()


def test_one_dispatch_per_optimizer_step_whatever_wraps_it(tmp_path, monkeypatch):
    from distcheck.rank import autocheck
    from distcheck.rank.autocheck.auto_records import AutoRecords

    done = []  # the core binds the handlers when it is built: patch the class before
    monkeypatch.setattr(AutoRecords, "on_optimizer_step_done", lambda self, opt, step: done.append(type(opt).__name__))
    check = autocheck.install(tmp_path, 0)
    try:
        model = torch.nn.Linear(2, 2)
        opt = _Container(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt.inner[0], 1)
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            sched.step()
        assert done == ["_Container"] * 3 and check.opt_steps == {id(opt): 3}
        assert [r["cause"] for r in check.checks["frozen"].rows] == [None, None, None]
    finally:
        autocheck.uninstall()


def test_a_frozen_model_is_its_own_check_and_hides_the_drift_check():
    """The frozen finding is the ``frozen_model`` check's; replicas that no step updated are not said identical."""
    from distcheck.analysis.check_table import judge

    def drift(rank):  # the baseline, then two steps after which rank 1's replica of "w" differs
        return {"checked": [{"step": s, "params": [["w", ["ddp", [0, 1]], "float32", [2], [0, 2], [rank * (s + 1)]]]}
                            for s in (-1, 0, 1)], "seconds": 0.0}

    run = {"steps": 2, "counter": "optimizer.step", "backwards": 2}
    frozen = {r: dict(run, rank=r, frozen=[_frozen_row(0), _frozen_row(1)], replica_drift=drift(r)) for r in (0, 1)}
    found = judge(frozen)
    assert [f.kind for f in found.findings] == ["bad_values"]
    assert found.findings[0].detail["cause"] == "gradient_sync_off"
    checks = {c.name: c.ok for c in found.checks}
    assert checks["frozen_model"] is False and "replica_drift" not in checks
    for state in frozen.values():
        for r in state["frozen"]:
            r["cause"] = None
    found = judge(frozen)
    assert [f.kind for f in found.findings] == ["tensor_divergence"]  # not frozen: the drift is judged again
    assert {c.name: c.ok for c in found.checks}["frozen_model"] is True


def test_a_closure_step_is_one_step_whose_loss_belongs_to_it(tmp_path, monkeypatch):
    """Lightning and LBFGS call optimizer.step(closure): forward and backward() run inside the step. The step is
    still dispatched once (its params recorded, its replicas checked), its loss labelled with its own step; a step
    that raised (caught by the user) does not make the next one count as nested."""
    from distcheck.rank import autocheck

    from distcheck.rank.autocheck.auto_records import AutoRecords

    done, loss_steps = [], []  # the core binds the handlers when it is built: patch the class before
    monkeypatch.setattr(AutoRecords, "on_optimizer_step_done", lambda self, opt, step: done.append(type(opt).__name__))
    monkeypatch.setattr(AutoRecords, "on_backward", lambda self, loss: loss_steps.append(self.core.loss_step))
    check = autocheck.install(tmp_path, 0)
    try:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(1, 2)).sum()
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        assert done == ["SGD"] * 3 and loss_steps == [0, 1, 2] and check.opt_steps == {id(opt): 3}
        # The gradients come from the closure, inside the step: no step is taken for one with nothing to update.
        assert [r["cause"] for r in check.checks["frozen"].rows] == [None, None, None]

        def failing():
            raise RuntimeError("caught by the user")

        try:
            opt.step(failing)
        except RuntimeError:
            pass
        opt.step(closure)  # a step of its own, not nested in the one that raised
        assert done == ["SGD"] * 4 and loss_steps[-1] == 4
    finally:
        autocheck.uninstall()


def test_prewrap_compares_meta_tensors_by_structure_only():
    from distcheck.rank.autocheck.prewrap import _structure_divergences

    real, meta = (None, (4, 2), "float32", "parameter"), (None, (4, 2), "float32", "parameter")
    assert _structure_divergences({0: {"w": real}, 1: {"w": meta}}, {"w"}) == []  # never "missing", values unread
    [missing] = _structure_divergences({0: {"w": real}, 1: {}}, {"w"})
    assert missing.structural.startswith("missing on rank 1")
    [wider] = _structure_divergences({0: {"w": real}, 1: {"w": (None, (5, 2), "float32", "parameter")}}, {"w"})
    assert wider.structural and wider.name == "w"


def test_prewrap_drops_values_overwritten_between_the_wrap_and_the_first_forward(tmp_path):
    import weakref

    import torch

    from distcheck.rank.autocheck import AutoCheck

    core = AutoCheck(tmp_path, 0)
    pw = core.checks["prewrap"]
    m = torch.nn.Linear(2, 2)
    pw.points.append({"how": "fully_shard"})
    pw._modules.append((weakref.ref(m), 0))
    kept, loaded = {"name": "weight", "point": 0}, {"name": "bias", "point": 0}
    pw.pending, pw._after = [kept, loaded], [kept, loaded]
    with core.inside_wrap():  # the parallelizing call: its end notes each pending tensor's fingerprint
        pass
    with torch.no_grad():
        m.bias.copy_(torch.tensor([3.0, 4.0]))  # a checkpoint loaded after the wrap
    assert pw._still_pending() == [kept]


def test_prewrap_settles_what_a_tensor_parallel_call_scattered_kept_or_left_plain(tmp_path):
    """parallelize_module's styles scatter rank 0's values (src_data_rank=0): those rows go; a tensor converted with
    src_data_rank=None or left plain by the plan stays, with the reason the message gives."""
    import torch

    from distcheck.rank.autocheck import AutoCheck
    from distcheck.rank.autocheck.prewrap import tensor_ident, why_text

    core = AutoCheck(tmp_path, 0)
    pw = core.checks["prewrap"]
    pw.points.append({"how": "parallelize_module", "identical": False})
    scattered, kept, plain = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    rows = [{"name": n, "point": 0, "how": "parallelize_module", "site": ["t.py", 7]} for n in ("a", "b", "c")]
    pw.pending = list(rows)
    for row, t in zip(rows, (scattered, kept, plain)):
        pw._idents[id(row)] = tensor_ident(t)
    with core.inside_wrap():  # distribute_module passes param.data: an alias
        core.fire("distribute_tensor", scattered.detach(), None, None, 0)
        core.fire("distribute_tensor", kept, None, None, None)
    assert [(r["name"], r["why"]) for r in pw.pending] == [("b", "src_none"), ("c", "left_plain")]
    assert not pw.points[0]["identical"]
    text = why_text(pw.pending)
    assert "src_data_rank=None" in text and "no ParallelStyle of the plan converts them" in text
    pw.pending = [pw.pending[0]]  # a point whose every row was scattered counts as identical
    pw._idents[id(pw.pending[0])] = tensor_ident(kept)
    pw.pending[0].pop("why")
    with core.inside_wrap():
        core.fire("distribute_tensor", kept, None, None, 0)
    assert pw.pending == [] and pw.points[0]["identical"]
