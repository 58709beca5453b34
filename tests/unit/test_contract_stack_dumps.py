"""contract/stack_dump_file.py: the files a rank's faulthandler dumps into, and how the supervisor reads them."""
from __future__ import annotations

from distcheck.contract import files, stack_dump_file


def test_stop_dumps_name_the_signal_and_rank_and_skip_empty_files(tmp_path):
    with stack_dump_file.open_stop(tmp_path, 1, "SIGTERM") as fh:
        fh.write('Thread 0x1 (most recent call first):\n  File "train.py", line 9 in main\n')
    stack_dump_file.open_stop(tmp_path, 0, "SIGTERM").close()  # rank 0 was never stopped: its file stays empty
    dumps = stack_dump_file.stop_dumps(tmp_path)
    assert list(dumps) == ["SIGTERM"] and list(dumps["SIGTERM"]) == [1] and "train.py" in dumps["SIGTERM"][1]


def test_the_fallback_dump_is_read_from_its_marker_on(tmp_path):
    with stack_dump_file.open_fallback(tmp_path, 0) as fh:
        fh.write("an earlier dump\n")
    path = files.rank_file(tmp_path, "faulthandler", 0)
    assert stack_dump_file.after_mark(path, "=== m2 ===\n") == ""
    stack_dump_file.mark(path, "=== m2 ===\n")
    with stack_dump_file.open_fallback(tmp_path, 0) as fh:
        fh.write("this dump\n")
    assert stack_dump_file.after_mark(path, "=== m2 ===\n") == "=== m2 ===\nthis dump\n"
