"""Pure tests of stack parsing, collapsing, grouping and the hang diagnosis: no processes are launched."""
from __future__ import annotations

from distcheck.analysis.hang import CollectiveRef, RankProgress, compose_hang_finding, diagnose, progress_from_events
from distcheck.analysis.stack_groups import (
    FAULTHANDLER_MARKER, Frame, RankStack, ThreadStack, collapse, frame_owner, group_stacks, innermost_user_frame,
    parse_faulthandler, parse_pyspy_json, render_groups, stack_collective, user_frame_via,
)
from distcheck.analysis.trace_events import parse_lines

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
TRAIN = "/home/u/proj/train.py"
SITE = "/venv/lib/python3.11/site-packages"
LIGHTNING = f"{SITE}/lightning/pytorch"


def pyspy_thread(pid, frames, name="MainThread", owns_gil=False):
    return {"pid": pid, "thread_id": 1, "thread_name": name, "os_thread_id": pid, "active": False,
            "owns_gil": owns_gil,
            "frames": [{"name": n, "filename": f, "short_filename": f.rsplit("/", 1)[-1], "line": ln,
                        "module": None, "locals": None, "is_entry": False} for n, f, ln in frames]}


def in_allreduce(line=88):
    # py-spy order: innermost first; the c10d logging wrapper sits between the user's call and all_reduce.
    return [("all_reduce", f"{TORCH}/distributed_c10d.py", 2806), ("wrapper", f"{TORCH}/c10d_logger.py", 81),
            ("train_step", TRAIN, line), ("main", TRAIN, 120), ("<module>", TRAIN, 130)]


def in_load_shard():
    return [("load_shard", TRAIN, 41), ("train_step", TRAIN, 80), ("main", TRAIN, 120), ("<module>", TRAIN, 130)]


def rank_stack(rank, frames, method="py-spy", owns_gil=False):
    pid = 1000 + rank
    return RankStack(rank, pid, "node0", method, parse_pyspy_json([pyspy_thread(pid, frames, owns_gil=owns_gil)], pid))


def test_frame_owners_and_collapse_keep_user_frames_visible():
    stack = rank_stack(0, in_allreduce()).main_thread()
    assert [frame_owner(f) for f in stack.frames] == ["torch", "torch", "user", "user", "user"]
    shown = collapse(stack.frames)
    # two torch frames collapse to one, represented by the collective the user called, not the logging wrapper
    assert shown[0].owner == "torch" and shown[0].name == "all_reduce" and shown[0].count == 2
    assert [s.name for s in shown[1:]] == ["train_step", "main", "<module>"]
    assert stack_collective(stack) == "all_reduce"
    assert frame_owner(Frame("run", "/usr/lib/python3.11/threading.py", 982)) == "python"
    assert frame_owner(Frame("clock_nanosleep", "libc.so.6", 0, native=True)) == "library"
    assert frame_owner(Frame("ffi_call", "libffi.so.8.1.2", 0, native=True)) == "python"
    assert frame_owner(Frame("c10d::ProcessGroupGloo::wait", "libtorch_cpu.so", 0, native=True)) == "torch"


def test_distcheck_frames_at_any_depth_are_distcheck_wherever_installed():
    # The package is nested (rank/autocheck/, supervise/, ...): a rule written for a flat package called these
    # "user" and named distcheck's own hooks as where a rank was.
    for path in ("/x/site-packages/distcheck/rank/autocheck/patches.py", "/x/site-packages/distcheck/replicas.py",
                 "/work/main/distcheck/supervise/watch.py", "/ci/src/distcheck/distcheck/testing/pool_worker.py",
                 "/x/dist-packages/distcheck/rank/checks/replicas.py", "/x/site-packages/distcheck/contract/report.py"):
        assert frame_owner(Frame("f", path, 3)) == "distcheck", path
    # ...while the repo's fixtures and tests are the user's code, and an installed library is a library
    assert frame_owner(Frame("main", "/work/main/fixtures/hang_python.py", 3)) == "user"
    assert frame_owner(Frame("log", f"{LIGHTNING}/core/module.py", 512)) == "library"


def test_a_hang_in_ddp_backward_names_the_users_backward_line_not_distchecks_hook():
    frames = [("wait", f"{TORCH}/distributed_c10d.py", 4800), ("_run_backward", f"{SITE}/torch/autograd/graph.py", 825),
              ("backward", f"{SITE}/torch/autograd/__init__.py", 347),
              ("backward_wrapper", f"{SITE}/distcheck/rank/autocheck/patches.py", 233),
              ("train_step", TRAIN, 57), ("main", TRAIN, 120), ("<module>", TRAIN, 130)]
    main = rank_stack(0, frames).main_thread()
    user = innermost_user_frame(main)
    assert (user.name, user.file, user.line) == ("train_step", TRAIN, 57)
    assert [s.owner for s in collapse(main.frames)] == ["torch", "distcheck", "user", "user", "user"]
    d = diagnose([rank_stack(0, frames), rank_stack(1, in_load_shard())], {}, world_size=2)
    assert "patches.py" not in d.message and "backward_wrapper" not in d.message
    assert "train.py:57" in d.message


def test_a_lightning_stack_names_the_users_training_step_and_shows_the_library_call_under_it():
    frames = [("all_reduce", f"{TORCH}/distributed_c10d.py", 2806), ("wrapper", f"{TORCH}/c10d_logger.py", 81),
              ("reduce", f"{LIGHTNING}/strategies/ddp.py", 330), ("_sync", f"{LIGHTNING}/core/module.py", 640),
              ("log", f"{LIGHTNING}/core/module.py", 512), ("training_step", TRAIN, 40),
              ("_call_impl", f"{SITE}/torch/nn/modules/module.py", 1750),
              ("training_step", f"{LIGHTNING}/strategies/strategy.py", 390),
              ("run", f"{LIGHTNING}/loops/training_epoch_loop.py", 150),
              ("fit", f"{LIGHTNING}/trainer/trainer.py", 544),
              ("main", TRAIN, 120), ("<module>", TRAIN, 130)]
    main = rank_stack(0, frames).main_thread()
    user, via = user_frame_via(main)
    assert (user.name, user.line) == ("training_step", 40) and innermost_user_frame(main) is user
    assert (via.name, via.line) == ("log", 512)  # the call the user's line made, not lightning's innermost frame
    shown = collapse(main.frames)
    assert [s.owner for s in shown] == ["torch", "library", "user", "torch", "library", "user", "user"]
    # the library run is represented by the call the user made into it, with its path inside the package
    assert shown[1].text() == "[library] log (lightning/pytorch/core/module.py:512, 3 frames)"
    assert shown[4].text() == "[library] fit (lightning/pytorch/trainer/trainer.py:544, 3 frames)"
    assert stack_collective(main) == "all_reduce"
    text = render_groups(group_stacks([rank_stack(0, frames)]), [])
    assert text.index("[library] log (lightning/pytorch/core/module.py:512") < text.index("training_step (train.py:40)")


def test_identical_stacks_group_and_minority_is_flagged():
    stacks = [rank_stack(0, in_allreduce()), rank_stack(1, in_load_shard()), rank_stack(2, in_allreduce()),
              rank_stack(3, in_allreduce())]
    groups = group_stacks(stacks)
    assert [g.ranks for g in groups] == [[0, 2, 3], [1]]
    assert [g.minority for g in groups] == [False, True]
    text = render_groups(groups, stacks)
    assert "!! rank 1 (1)  <-- MINORITY" in text and "== ranks 0,2-3 (3)" in text
    assert "load_shard (train.py:41)" in text and "[torch] all_reduce (distributed_c10d.py:2806, 2 frames)" in text


def test_torch_internal_line_differences_do_not_split_groups():
    other = in_allreduce()
    other[0] = ("all_reduce", f"{TORCH}/distributed_c10d.py", 2810)  # same collective, another waiting line
    groups = group_stacks([rank_stack(0, in_allreduce()), rank_stack(1, other)])
    assert len(groups) == 1 and groups[0].ranks == [0, 1]
    # ...but a different user line does split them
    groups = group_stacks([rank_stack(0, in_allreduce(88)), rank_stack(1, in_allreduce(90))])
    assert len(groups) == 2 and not any(g.minority for g in groups)


def test_hang_message_names_odd_rank_and_both_sites_with_trace_seq():
    stacks = [rank_stack(r, in_load_shard() if r == 1 else in_allreduce()) for r in range(4)]
    progress = {r: RankProgress(r, CollectiveRef("all_reduce", 57, [0, 1, 2, 3], "train.py:88", TRAIN, 88),
                                CollectiveRef("all_reduce", 56, [0, 1, 2, 3], "train.py:88", TRAIN, 88, completed=True))
                for r in (0, 2, 3)}
    progress[1] = RankProgress(1, None, CollectiveRef("all_reduce", 56, [0, 1, 2, 3], "train.py:88", TRAIN, 88,
                                                      completed=True))
    progress[1].last_started = progress[1].last_completed
    f = compose_hang_finding(stacks, progress, world_size=4, timeout=30)
    assert f.kind == "hang" and f.ranks == [1]
    assert f.message == ("no progress for 30s: rank 1 is in load_shard (train.py:41) "
                         "while ranks 0,2-3 wait in all_reduce #57 (train.py:88)")
    assert f.detail["file"] == TRAIN and f.detail["line"] == 41
    assert f.detail["last_collectives"]["0"]["last_started"]["seq"] == 57
    assert set(f.detail["stacks"]) == {"0", "1", "2", "3"} and f.detail["methods"]["1"] == "py-spy"


def test_two_rank_tie_is_broken_by_the_collective_the_other_rank_is_missing_from():
    d = diagnose([rank_stack(0, in_allreduce()), rank_stack(1, in_load_shard())], {}, world_size=2)
    assert d.odd_ranks == [1] and d.waiting.ranks == [0]
    assert d.message == "rank 1 is in load_shard (train.py:41) while rank 0 waits in all_reduce (train.py:88)"


def test_two_ranks_in_different_world_collectives_single_out_nobody():
    d = diagnose([rank_stack(0, in_allreduce(88)), rank_stack(1, in_allreduce(90))], {}, world_size=2)
    assert d.odd_ranks == [] and d.waiting is None
    f = d.to_finding([], {})
    assert f.ranks == [0, 1] and "rank 0 is in all_reduce (train.py:88); rank 1 is in all_reduce (train.py:90)" == f.message


def test_all_ranks_in_one_place():
    d = diagnose([rank_stack(r, in_allreduce()) for r in range(3)], {}, world_size=3, timeout=5)
    assert d.odd_ranks == [] and d.message == "no progress for 5s: all 3 ranks wait in all_reduce (train.py:88)"


def test_subgroup_location_names_absent_member():
    sub = [("all_reduce", f"{TORCH}/distributed_c10d.py", 2806), ("main", TRAIN, 40), ("<module>", TRAIN, 50)]
    world = [("all_reduce", f"{TORCH}/distributed_c10d.py", 2806), ("main", TRAIN, 41), ("<module>", TRAIN, 50)]
    stacks = [rank_stack(0, sub)] + [rank_stack(r, world) for r in (1, 2, 3)]
    progress = {0: RankProgress(0, CollectiveRef("all_reduce", 1, [0, 1], "train.py:40", TRAIN, 40))}
    for r in (1, 2, 3):
        progress[r] = RankProgress(r, CollectiveRef("all_reduce", 2, [0, 1, 2, 3], "train.py:41", TRAIN, 41))
    d = diagnose(stacks, progress, world_size=4)
    assert d.odd_ranks == [0]
    assert d.message == ("rank 0 is in all_reduce #1 on group 0,1 (train.py:40) where rank 1 never arrived "
                         "while ranks 1-3 wait in all_reduce #2 (train.py:41)")


def test_gil_holder_and_undumped_rank_are_reported():
    stacks = [rank_stack(0, in_allreduce()), rank_stack(1, in_load_shard(), owns_gil=True),
              rank_stack(2, in_allreduce())]
    d = diagnose(stacks, {}, world_size=4, errors_by_rank={3: "pid 1003 exited during the dump"})
    assert d.odd_ranks == [1]
    assert "rank 1 is in load_shard (train.py:41) holding the GIL while ranks 0,2 wait in all_reduce" in d.message
    assert d.message.endswith("; rank 3 not dumped (pid 1003 exited during the dump)")


def test_an_undumped_rank_missing_from_the_others_collective_is_the_one_named():
    # A loaded host: py-spy could not dump rank 1 in time, and its trace shows no open collective. Rank 0 waits in
    # all_gather #28, which rank 1 never entered: the finding names rank 1, and says where its trace ends.
    progress = {0: RankProgress(0, CollectiveRef("all_gather", 28, None, "train.py:88", TRAIN, 88)),
                1: RankProgress(1, last_completed=CollectiveRef("all_gather", 27, None, "train.py:88", TRAIN, 88,
                                                                completed=True))}
    d = diagnose([rank_stack(0, in_allreduce())], progress, world_size=2, timeout=6,
                 errors_by_rank={1: "pid 1001: py-spy did not finish within 8s"})
    f = d.to_finding([], progress)
    assert f.ranks == [1] and d.extra["absent_ranks"] == [1]
    assert f.message == ("no progress for 6s: rank 0 waits in all_gather #28 (train.py:88); rank 1 not dumped "
                         "(pid 1001: py-spy did not finish within 8s): rank 1 never arrived in all_gather #28 "
                         "(rank 1's trace ends after all_gather #27 (train.py:88))")
    # A trace that shows rank 1 completed #28 says it did arrive: then it is not named for it.
    passed = dict(progress)
    passed[1] = RankProgress(1, last_completed=CollectiveRef("all_gather", 28, None, "train.py:88", TRAIN, 88,
                                                             completed=True))
    d2 = diagnose([rank_stack(0, in_allreduce())], passed, world_size=2, timeout=6,
                  errors_by_rank={1: "pid 1001: py-spy did not finish within 8s"})
    assert "absent_ranks" not in d2.extra and "never arrived" not in d2.message
    # Every rank in the collective: nobody is singled out.
    both = diagnose([rank_stack(r, in_allreduce()) for r in (0, 1)], {}, world_size=2)
    assert "absent_ranks" not in both.extra and both.to_finding([], {}).ranks == [0, 1]


def test_rank_without_stack_is_placed_by_its_trace():
    progress = {1: RankProgress(1, CollectiveRef("barrier", 3, None, "train.py:60", TRAIN, 60))}
    d = diagnose([rank_stack(0, in_load_shard()), rank_stack(2, in_load_shard())], progress, world_size=3,
                 errors_by_rank={1: "permission denied"})
    assert d.odd_ranks == [1] and "rank 1 is in barrier #3 (train.py:60)" in d.message


def test_progress_from_trace_lines_of_the_tracer_format():
    lines = [
        '{"ev":"start","id":1,"seq":1,"pg":"0,1","op":"all_reduce","shapes":[[8]],"dtypes":["float32"],'
        '"reduce_op":"SUM","peer":null,"site":"train.py:88","file":"/p/train.py","line":88,"t":1.0}',
        '{"ev":"end","id":1,"t":1.1}',
        '{"ev":"start","id":2,"seq":2,"pg":"0,1","op":"barrier","shapes":[],"dtypes":[],"reduce_op":null,'
        '"peer":null,"site":"train.py:90","file":"/p/train.py","line":90,"t":2.0}',
        '{"ev":"end","id":',  # the rank was killed mid-write
    ]
    p = progress_from_events(0, parse_lines(lines, 0).events)
    assert p.last_completed.op == "all_reduce" and p.last_completed.seq == 1
    assert p.pending.op == "barrier" and p.pending.pg == [0, 1] and p.pending.line == 90


def test_faulthandler_parse_takes_the_last_dump_and_finds_main_thread():
    text = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/old.py", line 1 in old\n\n'
        f"{FAULTHANDLER_MARKER} pid 5 t=1 ===\n"
        "Thread 0x00007f02 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        '  File "/p/train.py", line 6 in tick\n\n'
        "Current thread 0x00007f03 (most recent call first):\n"
        '  File "/p/train.py", line 12 in hold_gil\n'
        '  File "/p/train.py", line 15 in <module>\n'
    )
    threads = parse_faulthandler(text)
    assert len(threads) == 2
    main = [t for t in threads if t.main]
    assert len(main) == 1 and main[0].frames[0].name == "hold_gil" and main[0].frames[0].line == 12


def test_rank_stack_json_round_trip():
    rs = rank_stack(2, in_allreduce())
    rs.note = "fallback"
    again = RankStack.from_json(rs.to_json())
    assert again == rs and isinstance(again.threads[0], ThreadStack)


def test_a_dumped_rank_whose_stack_shows_nothing_is_never_called_not_dumped():
    """A stack with only interpreter frames (no user code, no collective) was still dumped: the message must not
    contradict the stack printed next to it."""
    idle = [("wait", "/usr/lib/python3.11/threading.py", 320), ("<module>", "<frozen runpy>", 88)]
    d = diagnose([rank_stack(0, idle)], {}, world_size=2, errors_by_rank={1: "pid 1001 exited during the dump"})
    assert "rank 0 not dumped" not in d.message and "no rank could be dumped" not in d.message
    assert d.message.startswith("rank 0 dumped, but no stack shows user code or a collective")
    assert d.message.endswith("; rank 1 not dumped (pid 1001 exited during the dump)")


def test_the_stacks_summary_is_rendered_again_from_stacks_json_not_read_back_from_stacks_txt(tmp_path):
    """The pytest marker shows a hang's summary: rendered from stacks.json's structure, it is stacks.txt's text up
    to the uncollapsed threads, with the 1-1 tie the diagnosis broke still highlighted."""
    from distcheck.supervise.stacks import summary_of_document, write_stack_artifacts

    stacks = [rank_stack(0, in_allreduce()), rank_stack(1, in_load_shard())]
    progress = {0: RankProgress(0, CollectiveRef("all_reduce", 3, [0, 1], "train.py:88", TRAIN, 88), None)}
    diag = diagnose(stacks, progress, world_size=2, timeout=30)
    assert [g.minority for g in diag.groups] == [False, True]  # the tie, broken by the diagnosis
    write_stack_artifacts(tmp_path, stacks, [], progress=progress, title="distcheck watchdog: no progress for 30s",
                          groups=diag.groups, summary=diag.message)
    summary = summary_of_document(tmp_path / "stacks.json")
    text = (tmp_path / "stacks.txt").read_text()
    assert text.startswith(summary) and text[len(summary):].startswith("\nall threads, uncollapsed:\n")
    assert summary.startswith("distcheck watchdog: no progress for 30s\ndiagnosis: no progress for 30s: rank 1 is in")
    assert "!! rank 1 (1)  <-- MINORITY" in summary
