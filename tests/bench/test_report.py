"""bench.report: the generated docs' template filling and their --check."""

import pytest

from bench import report


def test_check_writes_nothing_and_says_what_regenerates_a_stale_doc(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    assert report.write_or_check(doc, "new\n", "python -m x", check=True) == 1
    assert not doc.exists()
    assert capsys.readouterr().err == f"{doc} is stale: python -m x\n"
    assert report.write_or_check(doc, "new\n", "python -m x", check=False) == 0
    assert doc.read_text() == "new\n"
    assert report.write_or_check(doc, "new\n", "python -m x", check=True) == 0
    assert report.write_or_check(doc, "new\n", "python -m x", check=True,
                                 misses=["a target missed"]) == 1
    assert capsys.readouterr().err == "a target missed\n"


def test_fill_replaces_every_part_and_a_missing_one_is_an_error():
    text = report.fill("memory.md.tmpl", {"table": "| the table |"})
    assert text.endswith("| the table |\n") and "{{" not in text
    with pytest.raises(KeyError, match="table"):
        report.fill("memory.md.tmpl", {})


def test_a_piece_is_its_lines_up_to_the_next_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "TEMPLATES", tmp_path)
    (tmp_path / "t.tmpl").write_text("<!-- a -->\nfirst {{x}}\n\n<!-- b -->\nsecond\n")
    assert report.fill("t.tmpl", {"x": 1}, "a") == "first 1\n\n"
    assert report.fill("t.tmpl", {}, "b") == "second\n"
    with pytest.raises(KeyError, match="c"):
        report.fill("t.tmpl", {}, "c")


def test_a_table_is_its_head_its_rule_and_a_line_per_row():
    text = report.table(["a", "b", "c"], [[1, "", "x"], ["", 2.5, ""]], align="lr")
    assert text.splitlines() == ["| a | b | c |", "|---|---:|---|", "| 1 | | x |",
                                 "| | 2.5 | |"]
    assert report.table(["only"], []) == "| only |\n|---|"
