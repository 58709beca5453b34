"""One file, several torch.save writers (analysis/shared_files.py) and the digest of what a rank saved."""
from __future__ import annotations

import torch

from distcheck.analysis.shared_files import several_writers
from distcheck.contract.saves_file import Save
from distcheck.rank.save_watch import digest


def save(path: str, digest: str, n: int = 1, host: str = "h", line: int = 40) -> Save:
    return Save(path, host, n, digest, "/w/train.py", line)


def test_ranks_that_write_one_path_with_different_contents_are_one_finding_at_the_first_differing_save():
    saves = {0: [save("/c/a.pt", "x"), save("/c/a.pt", "y", n=2), save("/c/b.pt", "p")],
             1: [save("/c/a.pt", "x"), save("/c/a.pt", "z", n=2), save("/c/b.pt", "q")],
             2: [save("/c/a.pt", "x"), save("/c/a.pt", "z", n=2)]}
    a, b = several_writers(saves)
    assert (a.kind, a.ranks, a.detail["path"], a.detail["save"]) == ("tensor_divergence", [0, 1, 2], "/c/a.pt", 2)
    assert a.detail["contents"] == {"y": [0], "z": [1, 2]} and a.detail["line"] == 40
    assert a.message.startswith("ranks 0-2 each torch.save different contents to the same file /c/a.pt at "
                                "train.py:40 (2 different contents, save #2 to it)")
    assert b.ranks == [0, 1] and "their first save to it" in b.message


def test_the_same_contents_per_rank_paths_one_writer_and_other_hosts_are_silent():
    assert several_writers({0: [save("/c/a.pt", "x")], 1: [save("/c/a.pt", "x")]}) == []
    assert several_writers({0: [save("/c/m-rank0.pt", "x")], 1: [save("/c/m-rank1.pt", "y")]}) == []
    assert several_writers({0: [save("/c/a.pt", "x")], 1: []}) == []
    assert several_writers({0: [save("/c/a.pt", "x", host="a")], 1: [save("/c/a.pt", "y", host="b")]}) == []


def test_the_digest_follows_values_shapes_and_other_saved_values():
    w = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"w": w, "b": torch.zeros(3)}, "step": 7}
    same = {"model": {"w": w.clone(), "b": torch.zeros(3)}, "step": 7}
    assert digest(state) == digest(same)
    changed = {"model": {"w": w.clone(), "b": torch.zeros(3)}, "step": 7}
    changed["model"]["w"][1, 2] += 1
    assert digest(changed) != digest(state)
    assert digest({**state, "step": 8}) != digest(state)
    assert digest({"model": {"w": w.reshape(3, 2), "b": torch.zeros(3)}, "step": 7}) != digest(state)
    module = torch.nn.Linear(3, 2)
    assert digest(module) == digest(module.state_dict())
