"""bench/fidelity/fidelity_report.py: the committed docs/fidelity.md is what the committed results
give, and the whole pipeline (fit on micro-benchmarks only, price the suite's plans, table, targets)
works end to end on synthetic results generated from the cost model (tests/bench/
fidelity_fixture.py: a test fixture, never committed as results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from fidelity_fixture import true_cluster, write_suite  # noqa: E402

from bench.fidelity import fidelity_report  # noqa: E402
from bench.fidelity.fidelity_cases import CASES, PROFILED, plan_path  # noqa: E402


def test_the_committed_document_is_current():
    text, _ = fidelity_report.render()
    assert fidelity_report.DOC.read_text() == text, (
        "docs/fidelity.md is stale: run python -m bench.fidelity.fidelity_report")


def test_every_suite_plan_is_written_by_the_generator():
    for name, build in CASES.items():
        assert plan_path(name).read_text() == build().model_dump_json(indent=2) + "\n", name


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Results 3% off the truth, both signs; peak memory 1% above the prediction."""
    results = tmp_path_factory.mktemp("fidelity")
    write_suite(results, {n: plan_path(n) for n in CASES}, true_cluster(), noise=0.03,
                profiled=PROFILED)
    return results


def test_the_fit_on_micro_benchmarks_recovers_the_truth_and_the_table_meets_the_targets(
        synthetic, tmp_path):
    at_scale = tmp_path / "at_scale.md"
    at_scale.write_text("# At scale\n\nthe scale12 section\n")
    text, s = fidelity_report.render(synthetic, at_scale)
    assert s["measured"] == len(CASES) >= 12 and s["missing"] == 0
    assert s["median_abs"] == pytest.approx(0.03, abs=0.01)
    assert s["worst_abs"] < 0.05 and s["slow"] > 0 and s["fast"] > 0
    assert s["memory_lowest"] == pytest.approx(-0.01, abs=0.002)
    assert fidelity_report.meets(s)
    for name in CASES:
        assert f"| {name} |" in text
    assert "## At scale\n\n## At scale\n\nthe scale12 section" in text
    # the profiled step set elementwise; the fit without it is reported beside
    assert f"Fitted from `calibration_h200.json`, `profile_{PROFILED}.json`" in text
    assert "Fitted from the micro-benchmarks alone" in text
    doc = tmp_path / "fidelity.md"
    # --check writes nothing: a missing document is stale
    assert fidelity_report.main(["--check", "--results", str(synthetic), "--doc",
                                 str(doc)]) == 1
    assert not doc.exists()
    assert fidelity_report.main(["--results", str(synthetic), "--doc", str(doc)]) == 0
    assert doc.read_text() == fidelity_report.render(synthetic)[0]
    before = doc.stat().st_mtime_ns
    assert fidelity_report.main(["--check", "--results", str(synthetic), "--doc",
                                 str(doc)]) == 0
    assert doc.stat().st_mtime_ns == before


def test_check_fails_on_a_missed_target(tmp_path):
    """15% off every plan: the worst error misses 10% and --check exits 1."""
    write_suite(tmp_path, {n: plan_path(n) for n in CASES}, true_cluster(), noise=0.15)
    _, s = fidelity_report.render(tmp_path)
    assert s["worst_abs"] > fidelity_report.WORST and not fidelity_report.meets(s)
    doc = tmp_path / "d.md"
    fidelity_report.main(["--results", str(tmp_path), "--doc", str(doc)])
    assert fidelity_report.main(["--check", "--results", str(tmp_path), "--doc",
                                 str(doc)]) == 1


def test_the_campaign_measures_every_suite_plan_after_the_micro_benchmarks():
    """h200_fidelity: the sweep first, then every case of bench/fidelity/fidelity_cases.py on its
    GPU count, results where the report reads them; every 2-GPU plan in a launch of its own (the
    peak memory of a plan measured after others in one launch carries theirs)."""
    from bench.campaign import Script, TrainStep, load_manifest

    campaign = load_manifest().campaigns["h200_fidelity"]
    assert ROOT / campaign.results == fidelity_report.RESULTS
    first = campaign.steps[0]
    assert isinstance(first, Script) and first.module == "runtime.sweep"
    assert first.result == fidelity_report.SWEEP
    launched = {}
    for step in campaign.steps:
        if isinstance(step, Script) and step.module == "bench.steps.train_step":
            plans = step.args[step.args.index("--plans") + 1:]
            for p in plans:
                launched[Path(p).stem] = step.ranks()
            assert all(CASES[Path(p).stem]().degrees.world == 1 for p in plans)
        elif isinstance(step, TrainStep) and step.stem in CASES:
            launched[step.stem] = step.ranks()
    assert launched == {n: build().degrees.world for n, build in CASES.items()}


def test_each_plan_counts_its_median_launch_of_the_same_commit(synthetic, tmp_path):
    """Further launches in launch_*/ join a plan's row when their commit is the row's: the
    median launch is priced (the faster of the middle two for an even count), the table shows
    the launches' range, and a launch of another commit is left out."""
    import json
    import shutil

    results = tmp_path / "fidelity"
    shutil.copytree(synthetic, results)
    name = next(iter(CASES))
    main = json.loads((results / f"train_step_{name}.json").read_text())
    for folder, scale, commit in (("launch_b", 1.2, main.get("commit")),
                                  ("launch_c", 0.9, main.get("commit")),
                                  ("launch_d", 2.0, "another")):
        (results / folder).mkdir()
        doc = {**main, "step_time_s": main["step_time_s"] * scale, "commit": commit}
        (results / folder / f"train_step_{name}.json").write_text(json.dumps(doc))
    runs = fidelity_report.launches(results, name)
    assert [t for t, _ in runs] == pytest.approx(
        sorted(main["step_time_s"] * s for s in (1.0, 1.2, 0.9)))
    cal, _ = fidelity_report.fit(results)
    row = next(r for r in fidelity_report.rows(results, cal) if r["case"] == name)
    assert row["measured_step_s"] == pytest.approx(main["step_time_s"])
    text, _ = fidelity_report.render(results, tmp_path / "none.md")
    assert f"| 3: {main['step_time_s'] * 0.9e3:.1f}-{main['step_time_s'] * 1.2e3:.1f} |" in text


def test_a_run_from_before_the_head_groups_is_named_not_taken_for_their_pricing():
    """A row priced with Ulysses head groups whose launch ran another schedule (None: from
    before the runtime recorded them, all blocking) is listed with its commit; rows that ran
    what is priced are not."""
    rows = [{"case": "grouped_then_blocking", "priced_head_groups": 2, "run_head_groups": None,
             "run_commit": "abc1234"},
            {"case": "grouped_both", "priced_head_groups": 2, "run_head_groups": 2,
             "run_commit": "def5678"},
            {"case": "blocking_both", "priced_head_groups": 1, "run_head_groups": None,
             "run_commit": "abc1234"},
            {"case": "unmeasured", "missing": True}]
    text = fidelity_report.head_groups_text(rows)
    assert "grouped_then_blocking (2 priced, none recorded, all blocking at abc1234)" in text
    assert "grouped_both" not in text and "blocking_both" not in text
    assert fidelity_report.head_groups_text(rows[1:]) == ""
