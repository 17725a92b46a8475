"""The campaign manifest (bench/campaigns.yaml) and its runner (bench/campaign.py), and the
typed result documents (plans/results.py) every committed result parses as."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from plans.results import (
    MEASURED_UNDER,
    SCHEMA_VERSION,
    OverlapBench,
    ParityResult,
    ProfileResult,
    Sweep,
    SweepOp,
    TrainStepResult,
    read,
    read_log,
)

ROOT = Path(__file__).resolve().parents[2]
from bench import campaign  # noqa: E402
from plans import SpecError  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def test_every_campaign_of_the_manifest_is_runnable_as_written():
    manifest = campaign.load_manifest()
    assert {"h200_steps", "h200_node"} <= set(manifest.campaigns)
    for name, c in manifest.campaigns.items():
        assert campaign.check(c) == [], name
        for step in c.steps:
            assert step.command(Path(c.results))[0] == sys.executable


def _manifest(tmp_path: Path, campaigns: dict) -> Path:
    path = tmp_path / "campaigns.yaml"
    path.write_text(yaml.safe_dump({"campaigns": campaigns}))
    return path


def test_a_bad_manifest_or_a_step_too_big_for_the_campaign_is_refused(tmp_path, capsys):
    bad = _manifest(tmp_path, {"c": {"about": "x", "gpus": 1, "results": "r",
                                     "steps": [{"bogus": 1}]}})
    assert campaign.main(["c", "--manifest", str(bad), "--dry-run"]) == 2
    assert "steps.0" in capsys.readouterr().err
    big = _manifest(tmp_path, {"c": {"about": "x", "gpus": 1, "results": "r", "steps": [
        {"parity": "bench/gpu_plans/mixtral2l_sp2_ep2_a2a.json"}]}})
    assert campaign.main(["c", "--manifest", str(big), "--dry-run"]) == 2
    assert "needs 2 GPUs, the campaign has 1" in capsys.readouterr().err
    shared = _manifest(tmp_path, {"c": {"about": "x", "gpus": 1, "results": "r", "steps": [
        {"parity": "bench/gpu_plans/mixtral2l_sp2_ep2_a2a.json", "share_gpu": True}]}})
    assert campaign.main(["c", "--manifest", str(shared), "--dry-run"]) == 0
    assert "--share-gpu" in capsys.readouterr().out
    assert campaign.main(["nope", "--dry-run"]) == 2
    twins = _manifest(tmp_path, {"c": {"about": "x", "gpus": 1, "results": "r", "steps": [
        {"train_step": "bench/gpu_plans/mixtral2l_1gpu.json"},
        {"train_step": "bench/gpu_plans/searched/mixtral2l_1gpu.json", "results": "s"}]}})
    assert campaign.main(["c", "--manifest", str(twins), "--dry-run"]) == 2
    assert "two steps are named 'train_step_mixtral2l_1gpu'" in capsys.readouterr().err
    one_file = _manifest(tmp_path, {"c": {"about": "x", "gpus": 1, "results": "r", "steps": [
        {"train_step": "bench/gpu_plans/mixtral2l_1gpu.json", "name": n} for n in "ab"]}})
    assert campaign.main(["c", "--manifest", str(one_file), "--dry-run"]) == 2
    assert "two steps write r/train_step_mixtral2l_1gpu.json" in capsys.readouterr().err


def test_a_merged_campaigns_steps_keep_their_folders_and_names(capsys):
    """A step naming its own results folder writes there; a plan step named apart from the
    step its plan names in the same campaign (the searched Mixtral plan beside h200_steps'
    own) runs under that name and writes its plan's file."""
    assert campaign.main(["h200_kernels", "--only", "calibration_h200", "expert_paths",
                          "device_fused_ops_mixtral", "fused_ops_mixtral", "--dry-run"]) == 0
    out = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert out["calibration_h200"].endswith("--out bench/results/calibration_h200.json --force")
    assert out["expert_paths"].endswith("--out bench/results/h200/expert_paths/expert_paths.json")
    assert out["device_fused_ops_mixtral"].endswith(
        "--out bench/results/h200/device_sweep/fused_ops_mixtral.json")
    assert out["fused_ops_mixtral"].endswith(
        "--out bench/results/h200/kernels/fused_ops_mixtral.json")
    assert campaign.main(["h200_steps", "--only", "train_step_mixtral2l_1gpu",
                          "train_step_mixtral2l_1gpu_searched", "--dry-run"]) == 0
    out = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert out["train_step_mixtral2l_1gpu"].endswith(
        "--out bench/results/h200/train_step_mixtral2l_1gpu.json")
    assert out["train_step_mixtral2l_1gpu_searched"].endswith(
        "--out bench/results/h200/searched/train_step_mixtral2l_1gpu.json")


def test_only_cuts_a_campaign_to_named_steps_and_names_an_unknown_one(capsys):
    assert campaign.main(["h200_fidelity", "--only", "train_step_qwen4l_pp2_mbs2",
                          "calibration", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["calibration", "train_step_qwen4l_pp2_mbs2"]
    assert campaign.main(["h200_fidelity", "--only", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: no step 'nope' in the campaign") and "--dry-run" in err
    # a near miss names the closest steps, not the campaign's every step: one short line
    assert campaign.main(["h200_fidelity", "--only", "calibraton", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "closest: calibration" in err and len(err.splitlines()) == 1 and len(err) < 160


def test_a_further_launch_of_a_plan_is_a_step_of_its_own_writing_in_its_launch_folder(capsys):
    assert campaign.main(["h200_fidelity", "--only", "train_step_qwen4l_pp2_mbs2",
                          "train_step_qwen4l_pp2_mbs2_b", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["train_step_qwen4l_pp2_mbs2",
                                                    "train_step_qwen4l_pp2_mbs2_b"]
    fidelity = "bench/results/h200/fidelity"
    assert out[0].endswith(f"--out {fidelity}/train_step_qwen4l_pp2_mbs2.json")
    assert out[1].endswith(f"--out {fidelity}/launch_b/train_step_qwen4l_pp2_mbs2.json")


def test_a_step_of_its_own_environment_shows_it_and_results_record_nccl_switches(
        capsys, monkeypatch):
    assert campaign.main(["h200_memory", "--dry-run"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(
        "reserve_x2_mixtral2l_dp2_ep2_interop_mbs1_avoid_record_streams:")]
    assert line and ": TORCH_NCCL_AVOID_RECORD_STREAMS=1 " in line[0]
    from runtime.provenance import metadata

    monkeypatch.setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert metadata()["nccl_switches"] == {"NCCL_NVLS_ENABLE": "0",
                                           "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


def test_the_runner_runs_steps_packs_results_and_skips_what_lacks_inputs(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from dist_workers import make_plan

    plan = tmp_path / "tiny.json"
    plan.write_text(make_plan().model_dump_json())
    writes = tmp_path / "writes.py"
    writes.write_text("import pathlib, sys\npathlib.Path(sys.argv[2]).write_text('{}')\n")
    results, other, inner = tmp_path / "res", tmp_path / "other", tmp_path / "res" / "inner"
    manifest = _manifest(tmp_path, {"tiny": {"about": "a CPU smoke run", "gpus": 1,
                                             "results": str(results), "steps": [
        {"train_step": str(plan), "steps": 2, "warmup": 1},
        {"script": "bench/steps/speedup_report.py", "name": "speedup", "result": "s.json",
         "args": ["--best", "{results}/a.json", "--baseline", "{results}/b.json",
                  "--out", "{results}/s.json"], "needs": ["a.json", "b.json"]},
        *({"script": str(writes), "name": f"to_{d.name}", "results": str(d),
           "args": ["--out", "{results}/e.json"], "result": "e.json"} for d in (other, inner)),
    ]}})
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.campaign", "tiny", "--manifest",
                           str(manifest)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "speedup: skipped (missing a.json, b.json)" in done.stdout
    assert "exit 0: step " in done.stdout
    doc = read(TrainStepResult, results / "train_step_tiny.json", "result")
    assert doc.measured_steps == 2 and doc.optimizer_sharding == "none"
    assert (other / "to_other.log").exists() and (inner / "to_inner.log").exists()
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    # a step's own folder is packed too; one inside the campaign's goes in with it, once
    assert {"res/train_step_tiny.json", "other/e.json", "res/inner/e.json"} <= set(names)
    assert len(names) == len(set(names))


def test_a_step_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path,
                                                                         monkeypatch):
    """A timed-out torchrun left its workers holding GPU memory through the next steps."""
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "spawns.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n")
    manifest = _manifest(tmp_path, {"slow": {"about": "a step that outlives its timeout",
                                             "gpus": 1, "results": str(tmp_path / "res"),
                                             "steps": [{"script": str(script), "name": "slow",
                                                        "result": "never.json",
                                                        "timeout_s": 3}]}})
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert campaign.main(["slow", "--manifest", str(manifest)]) == 1
    child = int(pid_file.read_text())
    status = Path(f"/proc/{child}/status")
    for _ in range(50):  # killed: gone, or a zombie where nothing reaps orphans
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's child {child} outlived the step")


# ---- committed results parse as typed documents ------------------------------------------------


def test_every_committed_result_parses_as_its_typed_document():
    found = {TrainStepResult: 0, ParityResult: 0, ProfileResult: 0, OverlapBench: 0}
    for path in sorted(RESULTS.rglob("*.json")):
        kind = (TrainStepResult if path.name.startswith("train_step_") else
                ParityResult if path.name.startswith("parity_") else
                ProfileResult if path.name.startswith("profile_") else
                OverlapBench if path.name.startswith("copy_engine_") else None)
        if kind is not None:
            read(kind, path, "result")
            found[kind] += 1
    assert all(n > 0 for n in found.values()), found
    for path in RESULTS.rglob("train_*.jsonl"):
        assert read_log(path, "log")


def test_sweep_rows_say_op_and_bytes_without_name_parsing(tmp_path):
    sweep = read(Sweep, RESULTS / "calibration_h200.json", "sweep")
    by_name = {r.name: r for r in sweep.rows}
    assert by_name["all_gather 16 MiB full"].op == SweepOp.all_gather
    assert by_name["all_gather 16 MiB full"].bytes == 16 * 2**20
    assert by_name["copy 256 MiB"].bytes == 256 * 2**20
    assert by_name["gemm 8192x8192x8192"].bytes is None
    row = {"name": "whatever", "op": "all_to_all", "bytes": 4096, "measured_s": 1e-3}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "world": 2, "rows": [row]}))
    assert read(Sweep, path, "sweep").rows[0].bytes == 4096
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "world": 2,
                                "rows": [{**row, "bytes": None}]}))
    with pytest.raises(SpecError, match="bytes"):
        read(Sweep, path, "sweep")


def test_results_carry_their_schema_version_and_the_facts_they_were_measured_under(tmp_path):
    """Every committed result states this schema and the facts it was measured under
    (plans.results.MEASURED_UNDER); one of another schema is refused in one line naming the
    field."""
    for path in RESULTS.rglob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["schema_version"] == SCHEMA_VERSION, path
        assert set(MEASURED_UNDER) <= set(doc), path
    result = RESULTS / "h200" / "train_step_mixtral2l_1gpu_recompute_full.json"
    assert read(TrainStepResult, result, "r").eager_step_in_buckets is False
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**json.loads(result.read_text()),
                                "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(SpecError, match=f"^r: {path}: schema_version: "):
        read(TrainStepResult, path, "r")


def test_the_performance_doc_is_current():
    """docs/performance.md is what bench/steps/performance_report.py makes of the committed
    results (and every train step it lists was measured)."""
    from bench.steps import performance_report as report

    assert (ROOT / "docs" / "performance.md").read_text() == report.render()
    assert "not measured" not in "\n".join(report.step_table())


def test_the_results_index_is_current():
    """bench/results/INDEX.md is what bench.index makes of the manifest and the committed
    results: every campaign under its results folder, and every folder no campaign writes."""
    from bench import index

    text = index.render()
    assert index.INDEX.read_text() == text, "stale: run python -m bench.index"
    for name, c in campaign.load_manifest().campaigns.items():
        assert f"- `{name}` (" in text
        assert f"## `{c.results.rstrip('/')}` (" in text


def test_the_peer_steps_predictions_price_the_plans_that_ran():
    """Each of our measured peer steps is priced as the plan it ran: the plan rebuilt from
    its notation writes the same notation, on its card's calibrated cluster."""
    from bench.fidelity.fidelity_cases import TRAINING
    from bench.memory.memory_cases import SHAPES, reduced
    from bench.steps import peer_report as report
    from bench.steps.peer_plans import CARDS
    from plans import catalog
    from plans.notation import plan_from_notation

    runs = report.measured_runs()
    assert {card for card, *_ in runs} == {"h200", "h100"}
    for card, model, summary, _, _ in runs:
        cluster = catalog.load_cluster(CARDS[card][0], gpus=1)
        plan = plan_from_notation(summary, reduced(*SHAPES[report.MODELS[model]]), cluster,
                                  TRAINING)
        assert plan.summary() == summary and plan.cluster.name == cluster.name
    rows, errors = report.predicted_rows()
    assert len(rows) == len(errors) == len(runs)


def test_the_peer_steps_doc_is_current():
    """docs/peer_steps.md is what bench/steps/peer_report.py makes of the committed peer-step
    results, and each of its speedups is torchtitan compiled's time over ours; a model with
    no plan under the cap says so and counts as a missed target."""
    from bench.steps import peer_report as report

    text, misses = report.render()
    assert report.DOC.read_text() == text
    for model in report.MODELS:
        runs = report.runs(model)
        peer = runs["torchtitan, compiled"][1]
        capped = runs["ours, capped"][1]
        if report.skipped(capped):
            assert f"| {model} | capped | no plan under {peer['peak_memory_gib']:.1f} GiB" in text
            assert any(m.startswith(f"{model} ours, capped: no plan") for m in misses)
            continue
        assert f"| {peer['step_time_s'] / capped['step_time_s']:.2f}x |" in text
