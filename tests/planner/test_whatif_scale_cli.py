"""What-if and scaling through the CLI: the paper's thesis, plots, JSON; exports end to end."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans import catalog

runner = CliRunner(env={"COLUMNS": "250"})
JOB = ["mixtral-8x7b", "h800", "--global-batch", "256", "--seq-len", "4096"]


def run(*args):
    result = runner.invoke(app, list(args))
    return result


@pytest.fixture(scope="module")
def compute_sweep():
    result = run("whatif", *JOB, "--gpus", "64", "--vary", "gpu_tflops=1x,4x", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["command"] == "whatif" and doc["job"]["gpus"] == 64
    return doc["points"]


def test_tp_layout_falls_behind_as_compute_outgrows_bandwidth(compute_sweep):
    slow, fast = compute_sweep
    assert slow["settings"] == {"gpu_tflops": "1x"} and fast["settings"] == {"gpu_tflops": "4x"}
    assert fast["best"]["tokens_per_s"] > slow["best"]["tokens_per_s"]
    # the paper's thesis, against its TP-in-node Megatron-LM layout (the reference row)
    assert fast["reference_speedup"] > slow["reference_speedup"] > 1
    assert fast["best"]["plan"]["degrees"]["tp"] == 1
    assert fast["speedup"] == pytest.approx(
        fast["baseline"]["step_time_s"] / fast["best"]["step_time_s"])
    assert slow["changes"] == []


def test_nvlink_domain_and_bandwidth_knobs():
    result = run("whatif", *JOB, "--gpus", "144", "--vary", "nvlink_domain=8,72",
                 "--vary", "nvlink_gb_s=1x,2x", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.output)["points"]
    assert len(points) == 4
    assert {p["settings"]["nvlink_domain"] for p in points} == {"8", "72"}
    assert all(p["best"]["tokens_per_s"] for p in points)


def test_runnable_whatif_of_the_overlap_share_plans_serial_ep_layers_where_it_hides_nothing(
        tmp_path):
    model = tmp_path / "mixtral-2l.json"  # the fidelity suite's reduced depth
    model.write_text(catalog.load_model("mixtral-8x7b").model_copy(
        update={"layers": 2}).model_dump_json())
    reduced = [str(model), "h200-runtime", "--gpus", "2", "--global-batch", "8",
               "--seq-len", "4096", "--runnable", "--json"]
    result = run("whatif", *reduced, "--vary", "overlap_share=0,0.9")
    assert result.exit_code == 0, result.output
    none, hiding = json.loads(result.output)["points"]
    assert none["best"]["plan"]["overlap"] == "none"
    assert hiding["best"]["tokens_per_s"] >= none["best"]["tokens_per_s"]
    result = run("whatif", *reduced[:-1], "--precision", "fp8", "--vary", "overlap_share=0")
    assert result.exit_code == 2 and "--precision" in result.output


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plots_are_written(tmp_path, suffix):
    out = tmp_path / f"plot.{suffix}"
    result = run("whatif", *JOB, "--gpus", "64", "--vary", "network_gb_s=0.5x,1x",
                 "--plot", str(out))
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:4] == b"\x89PNG" if suffix == "png" else b"<svg" in data[:500]


def test_bad_plot_suffix_and_knob():
    result = run("whatif", *JOB, "--gpus", "64", "--vary", "hbm_gib=1x", "--plot", "x.pdf")
    assert result.exit_code == 2 and "must end in .png or .svg" in result.output
    result = run("whatif", *JOB, "--gpus", "64", "--vary", "warp=2x")
    assert result.exit_code == 2 and "unknown knob 'warp'" in result.output


def test_strong_and_weak_scaling(tmp_path):
    result = run("scale", *JOB, "--gpus", "64,128", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["command"] == "scale" and doc["job"]["gpus"] == [64, 128]
    strong = doc["points"]
    assert [p["gpus"] for p in strong] == [64, 128]
    assert {p["global_batch"] for p in strong} == {256}
    for p in strong:
        b = p["best"]
        assert b["tokens_per_s_per_gpu"] == pytest.approx(b["tokens_per_s"] / p["gpus"])
        assert p["best_days_per_1t_tokens"] == pytest.approx(1e12 / b["tokens_per_s"] / 86400)
        assert p["reference_speedup"] > 1
    assert strong[1]["best"]["tokens_per_s"] > strong[0]["best"]["tokens_per_s"]
    plot = tmp_path / "scale.png"
    # weak scaling sets the batch itself (--global-batch beside --weak is refused)
    result = run("scale", "mixtral-8x7b", "h800", "--seq-len", "4096", "--gpus", "64,128",
                 "--weak", "32", "--json", "--plot", str(plot))
    weak = json.loads(result.output)["points"]
    assert [p["global_batch"] for p in weak] == [256, 512]  # 32 sequences per 8-GPU domain
    assert plot.exists()
    bad = run("scale", *JOB, "--gpus", "64,x")
    assert bad.exit_code == 2 and "--gpus: 'x' is not a positive GPU count" in bad.output


def test_export_commands(tmp_path):
    plan = tmp_path / "plan.json"
    assert run("search", *JOB, "--gpus", "64", "--out", str(plan)).exit_code == 0
    meg = run("export", str(plan), "--to", "megatron")
    assert meg.exit_code == 0 and "--expert-model-parallel-size" in meg.output
    slurm = run("export", str(plan), "--to", "slurm", "--steps", "10")
    assert "#SBATCH --nodes=8" in slurm.output
    bad = run("export", str(plan), "--to", "deepspeed")
    assert bad.exit_code == 2 and "'deepspeed' is not one of" in bad.output


def test_exported_torchrun_command_trains(tmp_path):
    """The torchrun export of a small plan, run on this machine, trains."""
    from plans import EPFFN, Degrees, Dispatch, Plan, TrainingSpec, catalog

    plan = Plan(model=catalog.load_model("tiny-moe"), cluster=catalog.load_cluster("h200", gpus=2),
                training=TrainingSpec(global_batch=4, seq_len=32), degrees=Degrees(sp=2, ep=2),
                ffn=EPFFN(dispatch=Dispatch.all_to_all), stage_layers=(4,))
    path = tmp_path / "tiny.json"
    path.write_text(plan.model_dump_json())
    result = run("export", str(path), "--to", "torchrun", "--steps", "2")
    assert result.exit_code == 0, result.output
    script = tmp_path / "run.sh"
    log = tmp_path / "log.jsonl"
    script.write_text(result.output.rstrip("\n") + f" --log-file {shlex.quote(str(log))}\n")
    # torchrun of this Python, without --numa-binding: a CPU machine has no GPU to bind near
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(
        f"#!/bin/bash\nargs=()\nwhile (($#)); do\n  if [[ $1 == --numa-binding ]]; then shift 2; "
        f"continue; fi\n  args+=(\"$1\"); shift\ndone\nexec {shlex.quote(sys.executable)} -m "
        "torch.distributed.run \"${args[@]}\"\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
