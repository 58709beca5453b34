"""Point-to-point ops paired per (sender, receiver): the k-th send from a to b against the k-th receive on b from a.

    from distcheck.analysis.p2p_pairs import find_p2p_mismatches
    findings = find_p2p_mismatches(load_traces("report"), outcomes)
    python -m pytest -q tests/unit/test_trace_align.py -k p2p

Sends and receives pair per peer, not by a group's position (analysis/trace_align.py aligns the rest): a pair differs
in shape or dtype, or one side issued one more than the other while both ranks finished their scripts (a trace cut
short by a full disk says nothing of what its rank issued after). ``batch_isend_irecv`` counts each of its items.
Pure: no process group, no file.
"""
from __future__ import annotations

from distcheck.analysis.group_sequences import at_site, trace_cut
from distcheck.analysis.rank_outcomes import STATE_OK, STATE_UNKNOWN, RankOutcome
from distcheck.analysis.trace_events import P2P_OPS, RankTrace, TraceEvent
from distcheck.contract.findings import Finding


def find_p2p_mismatches(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome]) -> list[Finding]:
    """The k-th send from a to b must match the k-th receive on b from a in shape and dtype."""
    sends: dict[tuple[int, int], list[tuple[TraceEvent, list[int], str]]] = {}
    recvs: dict[tuple[int, int], list[tuple[TraceEvent, list[int], str]]] = {}
    for rank, trace in traces.items():
        for e in trace.events:
            items: list[tuple[str, int | None, list[int], str]] = []
            if e.op in P2P_OPS and e.shapes:
                items.append((e.op, e.peer, e.shapes[0], e.dtypes[0] if e.dtypes else ""))
            elif e.op == "batch_isend_irecv":
                for item in e.extra.get("p2p") or []:
                    items.append((str(item.get("op")), item.get("peer"), item.get("shape") or [], item.get("dtype") or ""))
            for op, peer, shape, dtype in items:
                if peer is None or op.endswith("object_list"):
                    continue
                if "send" in op:
                    sends.setdefault((rank, int(peer)), []).append((e, list(shape), dtype))
                else:
                    recvs.setdefault((int(peer), rank), []).append((e, list(shape), dtype))
    out: list[Finding] = []
    for pair in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        src, dst = pair
        for k, (s, r) in enumerate(zip(s_list, r_list), start=1):
            if s[1] != r[1] or s[2] != r[2]:
                se, re_ = s[0], r[0]
                message = (f"send #{k} from rank {src} to rank {dst} does not match its receive: rank {src} sends "
                           f"{s[1]} {s[2]}{at_site(se)}; rank {dst} receives {r[1]} {r[2]}{at_site(re_)}")
                detail = {"pair": [src, dst], "position": k, "send": se.to_json(), "recv": re_.to_json()}
                if se.line is not None:
                    detail.update(file=se.file, line=se.line)
                out.append(Finding("collective_mismatch", [src, dst], message, detail))
                break
        else:
            both_ok = all(outcomes.get(r, RankOutcome(r, STATE_UNKNOWN)).state == STATE_OK for r in pair)
            if len(s_list) != len(r_list) and both_ok and not any(trace_cut(traces.get(r)) for r in pair):
                k = min(len(s_list), len(r_list)) + 1
                extra, side = (s_list[k - 1], "send") if len(s_list) > len(r_list) else (r_list[k - 1], "receive")
                e = extra[0]
                owner = src if side == "send" else dst
                message = (f"rank {owner} issued an unmatched {e.op} #{k} ({side} {src}->{dst}) {extra[1]} "
                           f"{extra[2]}{at_site(e)}: rank {dst if side == 'send' else src} finished without the "
                           f"matching {'receive' if side == 'send' else 'send'}")
                detail = {"pair": [src, dst], "position": k, "divergence": "extra", side: e.to_json()}
                if e.line is not None:
                    detail.update(file=e.file, line=e.line)
                out.append(Finding("collective_mismatch", [owner], message, detail))
    return out
