"""The live straggler line (supervise/live_stragglers.py) over status files written as ranks write them."""
from __future__ import annotations

from distcheck.contract import files, flight_status_file
from distcheck.supervise.live_stragglers import LiveStragglers, behind


def write(report_dir, rank: int, enqueued: dict[str, int]) -> None:
    path = files.rank_file(report_dir, "flight_status", rank)
    path.write_text(flight_status_file.text({g: (n, n - 1) for g, n in enqueued.items()}))


def test_behind_is_the_rank_whose_group_enqueued_fewer_collectives_than_a_peer():
    assert behind({0: {"gloo:0": 5}, 1: {"gloo:0": 4}}) == {1}
    assert behind({0: {"gloo:0": 5}, 1: {"gloo:0": 5}}) == set()
    # groups only one rank is in say nothing; each group is compared on its own
    assert behind({0: {"gloo:0": 5, "gloo:1": 9}, 1: {"gloo:0": 5}, 2: {"gloo:0": 3, "gloo:1": 2}}) == {2}
    # counts known as ranges (at least, at most): behind only when even its most is below a peer's least
    assert behind({0: {"g": 5}, 1: {"g": 4}}, {0: {"g": 6}, 1: {"g": 4}}) == {1}
    assert behind({0: {"g": 5}, 1: {"g": 4}}, {0: {"g": 5}, 1: {"g": 5}}) is None  # rank 1 may have come level
    assert behind({0: {"g": 5}, 1: {"g": 5}}, {0: {"g": 6}, 1: {"g": 5}}) is None  # rank 0 may have gone ahead


def test_one_line_once_a_rank_alone_is_behind_and_moving_for_n_looks(tmp_path, caplog):
    live = LiveStragglers(tmp_path, looks=4, every=1.0)
    lines = []
    for step in range(8):  # rank 0 always one collective ahead, waiting; rank 1 comes a step later each look
        write(tmp_path, 0, {"gloo:0": step + 2})
        write(tmp_path, 1, {"gloo:0": step + 1})
        lines.append(live.look(float(step)))
    said = [(i, line) for i, line in enumerate(lines) if line]
    assert len(said) == 1 and said[0][0] == 3, lines  # the 4th look; once
    assert said[0][1].startswith("rank 1 is the straggler: at 4 of the last 4 looks (1 s apart) it alone had not "
                                 "reached the collective rank 0 waited in")
    assert "rank 1 is the straggler" in caplog.text


def test_a_look_that_sees_both_ranks_at_one_count_does_not_hide_a_straggler(tmp_path):
    """The files are rewritten at their own moments: on a loaded machine some looks find the ranks level."""
    live = LiveStragglers(tmp_path, looks=5, every=1.0)
    said = []
    for step in range(10):
        level = step % 4 == 2  # one look in four sees rank 1 caught up
        write(tmp_path, 0, {"gloo:0": step + 2})
        write(tmp_path, 1, {"gloo:0": step + (2 if level else 1)})
        said.append(live.look(float(step)))
    (line,) = [x for x in said if x]
    assert line.startswith("rank 1 is the straggler: at 4 of the last 5 looks")


def test_a_balanced_job_and_a_stuck_rank_get_no_line(tmp_path):
    live = LiveStragglers(tmp_path, looks=3, every=1.0)
    for step in range(10):  # whoever is ahead changes from look to look
        write(tmp_path, 0, {"gloo:0": step + (step % 2)})
        write(tmp_path, 1, {"gloo:0": step + 1 - (step % 2)})
        assert live.look(float(step)) is None
    stuck = LiveStragglers(tmp_path / "stuck", looks=3, every=1.0)
    (tmp_path / "stuck").mkdir()
    write(tmp_path / "stuck", 1, {"gloo:0": 3})  # rank 1 never moves: a hang, the watch loop's
    for step in range(10):
        write(tmp_path / "stuck", 0, {"gloo:0": 4})
        assert stuck.look(float(step)) is None


def test_looks_closer_than_the_interval_read_nothing_and_zero_looks_is_off(tmp_path, monkeypatch):
    write(tmp_path, 0, {"gloo:0": 2})
    write(tmp_path, 1, {"gloo:0": 1})
    live = LiveStragglers(tmp_path, looks=1, every=1.0)
    assert live.look(0.0) is None and live.previous  # the first look: nothing moved yet
    assert live.look(0.5) is None and live.last_look == 0.0
    monkeypatch.setenv("DISTCHECK_STRAGGLER_LOOKS", "0")
    off = LiveStragglers(tmp_path)
    assert off.looks == 0 and off.look(100.0) is None


def test_the_status_file_keeps_its_progress_token_and_reads_an_older_one_line_file(tmp_path):
    path = tmp_path / "flight-rank0.status"
    path.write_text(flight_status_file.text({"gloo:0": (7, 6), "gloo:1": (2, -1)}))
    status = flight_status_file.read(path)
    assert status.progress == 15 and status.enqueued == {"gloo:0": 7, "gloo:1": 2}
    assert files.flight_progress(tmp_path, 0) == 15
    path.write_text("12\n")
    assert flight_status_file.read(path).enqueued == {} and files.flight_progress(tmp_path, 0) == 12
    path.write_text("")
    assert flight_status_file.read(path).progress == 0


def test_the_ranks_counts_are_compared_at_one_moment_not_as_last_written():
    """Steps shorter than the time between two rewrites: rank 1, the late one, rewrote its file after it caught up,
    rank 0's file is older. As last written they are level; at the latest moment both files cover (10.0), rank 1
    had not reached the all-reduce rank 0 had been waiting in since 9.75."""
    from distcheck.contract.flight_status_file import FlightStatus
    from distcheck.supervise.live_stragglers import counts_at_one_moment

    rank0 = FlightStatus(0, {"gloo:0": 6}, [(9.5, {"gloo:0": 5}, 9.4), (9.75, {"gloo:0": 6}, 9.65),
                                            (10.0, {"gloo:0": 6}, 10.0)])
    rank1 = FlightStatus(0, {"gloo:0": 6}, [(9.8, {"gloo:0": 5}, 9.7), (10.2, {"gloo:0": 6}, 10.1),
                                            (10.45, {"gloo:0": 6}, 10.45)])
    assert behind({0: rank0.enqueued, 1: rank1.enqueued}) == set()  # as last written: level
    assert counts_at_one_moment({0: rank0, 1: rank1}, now=10.5) == ({0: {"gloo:0": 6}, 1: {"gloo:0": 5}}, {1})
    # A rank whose counts did not move is not rewritten: its counts hold until WRITE_S + POLL_S ago.
    stuck = FlightStatus(0, {"gloo:0": 5}, [(3.0, {"gloo:0": 5}, 2.9)])
    assert counts_at_one_moment({0: rank0, 1: stuck}, now=10.5) == ({0: {"gloo:0": 6}, 1: {"gloo:0": 5}}, {1})
    # An older writer's file (no looks): its last counts.
    assert counts_at_one_moment({0: rank0, 1: FlightStatus(0, {"gloo:0": 4})}, now=10.5)[0][1] == {"gloo:0": 4}


def test_a_moment_inside_a_change_the_ranks_did_not_see_yet_is_not_the_one_compared():
    """Recorded from a 2-rank run (straggler_data_loading.py --delay 0.25): rank 1 enters all-reduce k when rank 0
    completes k - 1 and enters k + 1, and rank 1's status thread looked 0.03 s before rank 0's each time. At the
    moment both files covered (rank 1's last look, 551.95) rank 0's change had happened but its look had not come:
    counted as seen, the two were level at every look of that stretch. Rank 0's count is 24 or 25 from its look
    before (551.88) to the one that saw the change, rank 1's 23 or 24 from 551.85; the latest moment that decides it
    is 551.85."""
    from distcheck.contract.flight_status_file import FlightStatus
    from distcheck.supervise.live_stragglers import counts_at_one_moment

    def status(times: list[float], first: int) -> FlightStatus:
        looks = [(t, {"c10d:0": first + i}, round(t - 0.1, 2)) for i, t in enumerate(times)]
        return FlightStatus(0, looks[-1][1], looks)

    rank0 = status([550.66, 550.96, 551.17, 551.47, 551.67, 551.98], 20)
    rank1 = status([550.63, 550.93, 551.13, 551.44, 551.64, 551.95], 19)
    seen_by_then = {r: [c for t, c, _ in s.looks if t <= 551.95][-1] for r, s in ((0, rank0), (1, rank1))}
    assert behind(seen_by_then) == set()  # what the look compared before
    assert counts_at_one_moment({0: rank0, 1: rank1}, now=552.37) == ({0: {"c10d:0": 24}, 1: {"c10d:0": 23}}, {1})
    # every look of each saw a change, half a look apart: no moment in the files decides who is behind
    busy = [FlightStatus(0, {}, [(t, {"g": n}, t - 0.1) for n, t in enumerate((1.0, 1.1, 1.2))]) for _ in range(2)]
    busy[1].looks[1:] = [(1.05, {"g": 1}, 0.95), (1.15, {"g": 2}, 1.05)]
    assert counts_at_one_moment({0: busy[0], 1: busy[1]}, now=1.3) is None


def test_a_balanced_job_whose_ranks_look_at_different_moments_has_no_one_behind():
    """Both ranks enter collective k at 0.15 k s (a balanced job); rank 0's status thread sees each change 0.02 s
    after it, rank 1's 0.05 s after. The moment every file covers is rank 0's last look, when rank 1 had entered
    too but not looked yet: compared as seen, rank 1 was behind at every look (a run of the same shape named a rank
    of a balanced job the straggler, 1 run in 3). Its count there is a range (k - 1 or k), the look goes back to
    where both are known: level."""
    from distcheck.contract.flight_status_file import FlightStatus
    from distcheck.supervise.live_stragglers import counts_at_one_moment

    def status(lag: float, last: int) -> FlightStatus:
        looks = [(0.15 * k + lag, {"gloo:0": k}, 0.15 * k + lag - 0.1) for k in range(last - 7, last + 1)]
        return FlightStatus(0, looks[-1][1], looks)

    for last in range(8, 20):
        now = 0.15 * last + 0.06  # both have looked at collective `last`; rank 0 first
        rank0, rank1 = status(0.02, last), status(0.05, last)
        until = min(rank0.looks[-1][0], rank1.looks[-1][0])
        seen = {r: [c for t, c, _ in s.looks if t <= until][-1] for r, s in ((0, rank0), (1, rank1))}
        assert behind(seen) == {1}  # what the look compared before
        counts, late = counts_at_one_moment({0: rank0, 1: rank1}, now)
        assert late == set() and counts == {0: {"gloo:0": last - 1}, 1: {"gloo:0": last - 1}}


def test_many_ranks_are_compared_at_the_latest_moment_no_count_is_in_doubt():
    """64 ranks, each looking at its own phase: the latest MOMENTS moments all fall inside some rank's change (each
    look of each rank sees one), so the look goes back to the latest moment no rank's count is in doubt. Rank 7 is
    0.25 s late at each all-reduce (the others enter collective k as it enters k - 1), then the same ranks balanced.
    Trying every moment instead took seconds a look on 512 ranks."""
    import random

    from distcheck.contract.flight_status_file import FlightStatus
    from distcheck.supervise.live_stragglers import MOMENTS, counts_at_one_moment

    rng = random.Random(0)

    def status(late: bool) -> FlightStatus:
        lag = rng.uniform(0.0, 0.1)  # when this rank's looks come
        looks = [(0.25 * (k + late) + lag, {"g": k}, 0.25 * (k + late) + lag - 0.1) for k in range(1, 9)]
        return FlightStatus(0, looks[-1][1], looks)

    for straggler in (7, None):
        statuses = {r: status(r == straggler) for r in range(64)}
        until = min(s.looks[-1][0] for s in statuses.values())
        moments = {x for s in statuses.values() for look in s.looks for x in (look[0], look[2]) if x < until}
        assert len(moments) > MOMENTS
        counts, late = counts_at_one_moment(statuses, now=until + 0.05)
        assert late == ({7} if straggler == 7 else set())
        assert len({c["g"] for r, c in counts.items() if r != 7}) == 1  # the others known level at that moment


def test_a_rank_with_one_look_and_a_look_that_fails_do_not_end_the_run(tmp_path, monkeypatch, caplog):
    """A rank's first look has no look before it (its ``since`` is its own time): at that very moment its counts
    are those it saw. A look that raises anyway turns the line off for the run, with a warning, and returns."""
    from distcheck.contract.flight_status_file import FlightStatus
    from distcheck.supervise import live_stragglers
    from distcheck.supervise.live_stragglers import counts_at_one_moment

    first = FlightStatus(0, {"gloo:0": 1}, [(5.0, {"gloo:0": 1}, 5.0)])
    assert first.bounds(5.0) == ({"gloo:0": 1}, {"gloo:0": 1})
    other = FlightStatus(0, {"gloo:0": 2}, [(4.0, {"gloo:0": 1}, 3.9), (5.2, {"gloo:0": 2}, 5.1)])
    assert counts_at_one_moment({0: first, 1: other}, now=5.3) == ({0: {"gloo:0": 1}, 1: {"gloo:0": 1}}, set())

    write(tmp_path, 0, {"gloo:0": 2})
    write(tmp_path, 1, {"gloo:0": 1})
    live = LiveStragglers(tmp_path, looks=2, every=1.0)

    def broken(*_):
        raise IndexError("list index out of range")

    monkeypatch.setattr(live_stragglers, "counts_at_one_moment", broken)
    assert live.look(0.0) is None and live.looks == 0 and live.look(5.0) is None
    assert "the live straggler look failed (IndexError: list index out of range)" in caplog.text


def test_the_rank_looks_ten_times_a_second_and_rewrites_its_file_at_most_twice(tmp_path, monkeypatch):
    from distcheck.contract import flight_status_file as fsf
    from distcheck.rank import flight_recorder as fr

    counters = {"gloo:0": (0, 0)}
    monkeypatch.setattr(fr, "read_status", lambda: dict(counters))
    monkeypatch.setattr(fr, "_group_names", lambda: {})
    sink = fr.Sink(tmp_path, 0)
    path = files.rank_file(tmp_path, "flight_status", 0)
    writes = []
    for i in range(30):  # 3 s of looks; a collective enqueued every 0.2 s, completed 0.1 s later
        now = 100.0 + i * fsf.POLL_S
        n = i // 2 + 1
        counters["gloo:0"] = (n, n - 1 if i % 2 == 0 else n)
        before = path.read_text() if path.exists() else None
        sink.poll(now)
        if path.read_text() != before:
            writes.append(now)
    assert len(writes) == 6 and all(b - a >= fsf.WRITE_S - 1e-9 for a, b in zip(writes, writes[1:]))
    status = fsf.read(path)
    assert status.enqueued == {"gloo:0": 13} and status.progress == 13 + 13  # the last write: 13 enqueued, 13 done
    times = [t for t, _, _ in status.looks]
    assert times[-1] == round(writes[-1], 3) and times == sorted(times)
    assert writes[-1] - times[0] <= fsf.HISTORY_S + 0.2 + 1e-9  # the window and the change that starts it
    # every change the rank saw in the window, at the look that saw it, after the look before it
    assert [c["gloo:0"] for _, c, _ in status.looks] == [7, 8, 9, 10, 11, 12, 13, 13]
    assert all(abs(t - since - fsf.POLL_S) < 1e-6 for t, _, since in status.looks[:-1])
    assert status.looks[-1][2] == status.looks[-1][0]  # the last: the counts still held then, no change
    # between a change's look and the look before it the count is a range, elsewhere one number
    t, _, since = status.looks[-2]
    assert status.bounds((t + since) / 2) == ({"gloo:0": 12}, {"gloo:0": 13})
    assert status.bounds(since - 0.01) == ({"gloo:0": 12}, {"gloo:0": 12})
    assert status.bounds(status.looks[0][0] - 1) is None  # before the file's first look
    assert not list(tmp_path.glob(".*.tmp"))  # replaced whole, no temporary file left
