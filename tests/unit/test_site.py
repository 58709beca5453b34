"""The one file:line formatter (contract/site.py): every message names a line of code the same way."""
from __future__ import annotations

from distcheck.contract.site import Site, base_name, file_line
from distcheck.rank.usersite import Site as RankSite


def test_file_line_names_the_base_name_and_the_line_or_nothing():
    assert file_line("/home/u/proj/train.py", 88) == "train.py:88"
    assert file_line("C:\\proj\\train.py", 3) == "train.py:3"  # a report written on another machine
    assert file_line("/home/u/train.py", None) is None and file_line(None, 88) is None and file_line("", 1) is None
    assert base_name("/a/b/model.py") == "model.py"


def test_one_site_type_for_every_process():
    assert RankSite is Site
    site = Site("/w/train.py", 30, via="lightning/pytorch/core/module.py:512 in log")
    assert site.site == "train.py:30" and str(site) == "train.py:30" and bool(site)
    assert site.detail() == {"file": "/w/train.py", "line": 30, "via": "lightning/pytorch/core/module.py:512 in log"}
    assert str(Site(None, None)) == "?" and not Site(None, None)


def test_no_module_formats_a_file_and_a_line_by_hand():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "distcheck"
    by_hand = re.compile(r"basename\([^)]*\)\}:\{")
    wrong = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_hand.search(line)]
    assert not wrong, f"use contract/site.file_line: {wrong}"
