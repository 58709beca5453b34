"""What one live straggler look costs the supervisor (supervise/live_stragglers.counts_at_one_moment, once a second
while the ranks run), over status files of 8, 64 and 512 ranks that each look at their own phase.

    .venv/bin/python bench/bench_live_look.py

Two shapes of job: steps of 0.25 s (the ranks' changes leave quiet moments between them) and of 0.11 s, about one
look of a rank's status thread (every look of every rank sees a change: no moment may decide). The figure is the
median wall time of one look's computation over 20 (the files' reading is apart: one small read per rank).
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distcheck.contract.flight_status_file import FlightStatus  # noqa: E402
from distcheck.supervise.live_stragglers import counts_at_one_moment  # noqa: E402


def statuses(ranks: int, step: float, rng: random.Random) -> dict[int, FlightStatus]:
    """Each rank's last 1.2 s of looks (what a status file carries), seen at its own lag after each change."""
    out = {}
    for rank in range(ranks):
        lag = rng.uniform(0.0, 0.1)
        looks = [(k * step + lag, {"c10d:0": k}, k * step + lag - 0.1) for k in range(int(1.2 / step) + 1)]
        out[rank] = FlightStatus(0, looks[-1][1], looks)
    return out


def main() -> int:
    rng = random.Random(0)
    for ranks in (8, 64, 512):
        for step in (0.25, 0.11):
            files = statuses(ranks, step, rng)
            now = max(s.looks[-1][0] for s in files.values()) + 0.01
            times = []
            for _ in range(20):
                for s in files.values():  # a fresh read each look: no index kept from the last one
                    s._times = None
                began = time.perf_counter()
                result = counts_at_one_moment(files, now)
                times.append(time.perf_counter() - began)
            decided = "no moment decides" if result is None else f"behind: {sorted(result[1]) or 'no one'}"
            print(f"{ranks:4d} ranks, {step:.2f} s steps: {statistics.median(times) * 1000:6.1f} ms a look ({decided})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
