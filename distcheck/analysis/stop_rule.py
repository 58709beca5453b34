"""The stop rule: whether a running job can provably no longer progress, so the watch stops it before its timeout.

    from distcheck.analysis.stop_rule import provably_stuck
    why = provably_stuck(load_traces("report"), finished={1})     # None, or the sentence the report gives
    python -m pytest -q tests/unit/test_trace_align.py -k stuck

The watch loop (supervise/watch.py through supervise/supervised_run.py, and the pytest pool) asks every few seconds
while ranks run: a rank waits at a group position a finished member never issued, or every member of a group issued
a different collective at one position and none completed. A trace cut short by a full disk proves neither. Pure: no
process group, no file.
"""
from __future__ import annotations

from distcheck.analysis.call_signature import signature
from distcheck.analysis.group_sequences import GroupSequence, at_site, collectives_by_group, group_label, trace_cut
from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.progress import progress_by_rank
from distcheck.analysis.trace_events import RankTrace


def provably_stuck(traces: dict[int, RankTrace], finished: set[int]) -> str | None:
    """Why the run can no longer progress, or None: a running rank waits in a collective at a group position
    that a finished member never issued, or every member of a group has issued a different collective at the
    same position and none of them completed."""
    groups = collectives_by_group(traces)
    # A trace cut short by a full disk neither shows where its rank waits nor how far a finished rank got.
    cut = {r for r, t in traces.items() if trace_cut(t)}
    progress = progress_by_rank({r: t for r, t in traces.items() if r not in finished and r not in cut})
    # Per sequence, its finished members' last positions (an untraced collective's number counts every collective
    # of the group, so compare numbers, not how many a member has), and the least of them: once per sequence, not
    # once per waiting rank and member (4096 ranks waiting on a 4096-rank group made 16 million look-ups).
    reached: dict[str, tuple[int, list[tuple[int, int]]]] = {}

    def finished_members(key: str, seq: GroupSequence) -> tuple[int, list[tuple[int, int]]]:
        if key not in reached:
            lasts = []
            for m in seq.members:
                if m in finished and m not in cut:
                    issued = seq.per_rank.get(m)
                    last = issued.last() if issued is not None else None
                    lasts.append((m, last.seq if last is not None else 0))
            reached[key] = (min((n for _, n in lasts), default=-1), lasts)
        return reached[key]

    for rank, p in sorted(progress.items()):
        for ref in p.open:
            e = ref.event
            if e is None or e.op in PEER_OPS or e.extra.get("api") == "functional":
                continue
            seq = groups.get(e.group_key)
            if seq is None:
                continue
            least, lasts = finished_members(e.group_key, seq)
            if not lasts or least >= e.seq:
                continue
            m = next(m for m, n in lasts if n < e.seq)
            return (f"rank {rank} waits in {e.op} #{e.seq} on group {group_label(e.pg)}{at_site(e)}, "
                    f"which rank {m} finished without issuing")
    for seq in groups.values():
        members, per_rank = seq.members, seq.per_rank
        for i in range(seq.start(members), max((len(v) for v in per_rank.values()), default=0)):
            present = {r: per_rank[r].at(i) for r in members if len(per_rank.get(r, ())) > i}
            if len(present) < len(members):
                break
            if len({signature(e) for e in present.values()}) > 1:
                if all(not e.completed for e in present.values()) and not cut & set(present):
                    return f"ranks {','.join(map(str, members))} issued different collectives #{i + 1} and wait"
                break
    return None
