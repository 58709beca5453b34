"""One file, several writers: ranks that ``torch.save`` different contents to the same path.

    python -m distcheck run --nproc 2 -- fixtures/save_shards_one_file.py   # a tensor_divergence naming the path

Each rank notes its saves to named files (rank/save_watch.py, contract/saves_file.py): the path, the host, which
save to that path it was, a digest of the contents and the user's line. Where two or more ranks on one host made
their n-th save to one path with different digests, the file holds whichever rank wrote last: every rank that
resumes from it loads that rank's values (FSDP2 shards saved by every rank to ``ckpt/model.pt``: half the model
then holds the other half's values). Identical contents (every DDP rank saving the same weights) are silent, as
are per-rank paths and a rank-0 save. The same path on two hosts is compared only when the hosts are the same
(a node-local disk holds two files). One finding per path, at its first differing save. Pure.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract.saves_file import Save
from distcheck.contract.site import file_line

FIX = ("save from one rank when every rank holds the same values (if rank == 0: torch.save(...)), give each rank "
       "its own file (f\"model-rank{rank}.pt\"), or save sharded state with torch.distributed.checkpoint")


def several_writers(saves: Mapping[int, Sequence[Save]]) -> list[Finding]:
    """A tensor_divergence per path that several ranks wrote with different contents."""
    by_write: dict[tuple[str, str], dict[int, dict[int, Save]]] = {}  # (host, path) -> n -> rank -> save
    for rank, made in saves.items():
        for s in made:
            by_write.setdefault((s.host, s.path), {}).setdefault(s.n, {})[rank] = s
    findings = []
    for (host, path), writes in sorted(by_write.items()):
        for n in sorted(writes):
            ranks = writes[n]
            digests = {s.digest for s in ranks.values()}
            if len(ranks) < 2 or len(digests) < 2:
                continue
            findings.append(_finding(path, host, n, ranks))
            break
    return findings


def _finding(path: str, host: str, n: int, ranks: Mapping[int, Save]) -> Finding:
    writers = sorted(ranks)
    first = ranks[writers[0]]
    lines = sorted({file_line(s.file, s.line) for s in ranks.values() if s.file and s.line})
    at = f" at {', '.join(lines)}" if lines else ""
    kinds: dict[str, list[int]] = {}
    for r in writers:
        kinds.setdefault(ranks[r].digest, []).append(r)
    which = f"save #{n} to it" if n > 1 else "their first save to it"
    message = (f"{format_ranks(writers)} each torch.save different contents to the same file {path}{at} "
               f"({len(kinds)} different contents, {which}): the file holds whichever rank wrote last, and every "
               f"rank that loads it gets that rank's values. Fix: {FIX}")
    detail = {"path": path, "host": host, "save": n, "file": first.file, "line": first.line,
              "contents": {d: rs for d, rs in kinds.items()}}
    return Finding("tensor_divergence", writers, message, detail)
