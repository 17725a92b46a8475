"""Tables never cut a value or the columns that tell plans apart, at any width, piped or not."""

import json
import re

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.report import Column, render_table

COLUMNS = (Column("", numeric=False), Column("layout", numeric=False), Column("tokens/s"),
           Column("peak/usable GiB"))
ROWS = [["#1", "pp4 vpp2 dp2 sp8 ep8 a2a mbs1", "1,065,853", "72.8/73.6"],
        ["megatron", "pp4 vpp4 dp2 tp8 etp8 mbs4", "345,561", "29.0/73.6"]]


@pytest.mark.parametrize("width", [None, 20, 40, 60, 80, 200])
def test_every_value_appears_whole(width):
    text = render_table("Plans", COLUMNS, ROWS, width)
    for row in ROWS:
        for value in row:
            if width is None or len(value) <= width:
                assert value in text, (value, text)
    if width is not None:  # wrapped between values: no line longer than the width, unless a
        longest = max(len(v) for r in ROWS for v in r)  # value alone is wider
        assert all(len(line) <= max(width, longest + 12) for line in text.splitlines())


def test_plain_rows_when_they_fit():
    text = render_table("Plans", COLUMNS, ROWS, None)
    lines = text.splitlines()
    assert lines[1].split() == ["layout", "tokens/s", "peak/usable", "GiB"]
    assert re.search(r"mbs1\s+1,065,853\s+72.8/73.6$", lines[3])  # one row a line, aligned


@pytest.mark.parametrize("columns", ["40", "80", "250"])
def test_search_output_keeps_every_value(columns):
    args = ["search", "mixtral-8x7b", "h100", "--gpus", "16", "--global-batch", "32",
            "--seq-len", "4096", "--top", "3"]
    runner = CliRunner(env={"COLUMNS": columns})
    doc = json.loads(runner.invoke(app, [*args, "--json"]).output)
    text = runner.invoke(app, args).output
    header = " ".join(text.split("Best plans")[0].split())  # the job, restated (maybe wrapped)
    assert header.startswith("Mixtral-8x7B (46.7B total, 12.9B active) on 16 x H100-SXM "
                             "(2 nodes of 8): global batch 32 x 4,096 tokens = 131,072 "
                             "tokens/step, bf16")
    for ranked in [*doc["top"], doc["baseline"]]:
        for token in ranked["notation"].split():  # every part of the plan notation, whole
            assert re.search(rf"(^|\s){re.escape(token)}(\s|$)", text, re.M), token
        assert f"{ranked['tokens_per_s']:,.0f}" in text
        peak, usable = ranked["peak_memory_gib"], ranked["usable_memory_gib"]
        assert f"{peak:.1f}/{usable:.1f}" in text
    if columns != "250":
        assert max(len(line) for line in text.splitlines()) <= int(columns) + 20


def test_low_headroom_is_warned():
    from planner.report import HEADROOM_WARNING, headroom_warnings

    class E:  # an Evaluation's memory, duck-typed
        def __init__(self, peak):
            self.memory = type("M", (), {"peak_bytes": peak, "capacity_bytes": 100.0})()

    assert headroom_warnings([("#1", E(100 * (1 - HEADROOM_WARNING) + 1)), ("#2", E(50))])[0] \
        .startswith("warning: #1 (")
    assert headroom_warnings([("#2", E(50))]) == []


def test_piped_output_without_a_width_is_read_at_80_columns():
    from planner.report import PIPED_COLUMNS

    args = ["search", "mixtral-8x7b", "h100", "--gpus", "16", "--global-batch", "32",
            "--seq-len", "4096", "--top", "3"]
    text = CliRunner(env={"COLUMNS": ""}).invoke(app, args).output  # not a terminal, no COLUMNS
    assert PIPED_COLUMNS == 80
    assert max(len(line) for line in text.splitlines()) <= PIPED_COLUMNS


def test_a_tie_is_within_the_tolerance_either_way():
    """A row faster than #1 (a baseline of another target can be) is a tie only within the
    cost model's error, as a slower one is."""
    from types import SimpleNamespace

    from planner.report import TIE_TOLERANCE, is_tie

    best = SimpleNamespace(step_time_s=10.0)
    for ratio, tie in ((1.0, True), (1 + TIE_TOLERANCE / 2, True), (1 - TIE_TOLERANCE / 2, True),
                       (1 + 2 * TIE_TOLERANCE, False), (0.77, False)):
        assert is_tie(best, SimpleNamespace(step_time_s=10.0 * ratio)) is tie, ratio
