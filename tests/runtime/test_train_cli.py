"""runtime.train: bad input exits 2 with one line, logging, token files, checkpoint/resume."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_workers import make_plan

from plans import CPAttention, OptimizerSharding
from runtime.data import write_byte_corpus

ROOT = Path(__file__).resolve().parents[2]


def _train(*args: str, world: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "runtime.train", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def _write(plan, path: Path) -> Path:
    path.write_text(plan.model_dump_json())
    return path


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_plan_file(tmp_path):
    _one_line_error(_train("--plan", str(tmp_path / "none.json")), "none.json", "cannot read")


def test_invalid_plan_names_the_field(tmp_path):
    data = json.loads(make_plan(sp=2).model_dump_json())
    data["degrees"]["sp"] = 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    _one_line_error(_train("--plan", str(bad)), "degrees")


def test_world_size_mismatch(tmp_path):
    plan = _write(make_plan(sp=2), tmp_path / "p.json")
    _one_line_error(_train("--plan", str(plan), world=1), "degrees", "WORLD_SIZE=1")


def test_cp_attention_is_refused(tmp_path):
    plan = make_plan().model_copy(update={"attention": CPAttention()})
    _one_line_error(_train("--plan", str(_write(plan, tmp_path / "p.json"))),
                    "attention", "cp")


def test_single_process_on_byte_corpus_logs_json(tmp_path):
    corpus = tmp_path / "corpus.u16"
    write_byte_corpus("the quick brown fox jumps over the lazy dog. " * 40, corpus)
    plan = _write(make_plan(), tmp_path / "p.json")
    log = tmp_path / "log.jsonl"
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (corpus, plan)}
    cache = tmp_path / "compile_cache"
    r = _train("--plan", str(plan), "--steps", "2", "--data", str(corpus), "--log", str(log),
               "--compile-cache", str(cache))
    assert r.returncode == 0, r.stderr
    # the runtime never writes its inputs
    assert digests == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in digests}
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for key in ("loss", "tokens_per_s", "mfu", "peak_memory_gib", "components_s"):
        assert key in rows[0]
    assert "step 2 loss" in r.stdout
    # eager kernels compile nothing; the line before the run's summary puts the first step
    # apart from the rest
    assert rows[0]["compiled_graphs"] == {"hits": 0, "misses": 0, "aot_hits": 0, "aot_misses": 0,
                                          "aot_bypasses": 0}
    last = r.stdout.strip().splitlines()[-2]
    assert last.startswith("first step ") and "(median of 1 step)" in last, last
    assert str(cache.resolve()) in last and cache.is_dir()


_COMPILE = """
import sys
from pathlib import Path
from runtime.compile_cache import cache_counts, use_cache_dir
use_cache_dir(Path(sys.argv[1]))
import torch
torch.compile(lambda x: torch.relu(x) * 2 + 1, fullgraph=True)(torch.randn(8))
print(cache_counts().as_dict())
"""


def test_a_second_process_loads_the_compiled_graph_from_the_cache_folder(tmp_path):
    """runtime.compile_cache: a relaunch over the same folder compiles nothing again
    (inductor's FX graph cache and AOTAutograd's cache hit, read from torch's counters)."""
    cache = tmp_path / "cache"

    def launch() -> dict:
        r = subprocess.run([sys.executable, "-c", _COMPILE, str(cache)], cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"'))

    # one region: its graph in the FX graph cache, the region in AOTAutograd's
    assert launch() == {"hits": 0, "misses": 1, "aot_hits": 0, "aot_misses": 1,
                        "aot_bypasses": 0}
    assert (cache / "fxgraph").is_dir()
    assert launch() == {"hits": 1, "misses": 0, "aot_hits": 1, "aot_misses": 0,
                        "aot_bypasses": 0}


@pytest.mark.parametrize(
    "layout",
    [dict(sp=2, ep=2), dict(pp=2, stage_layers=(2, 2)),
     dict(dp=2, optimizer_sharding=OptimizerSharding.zero1)],
    ids=["sp2_ep2", "pp2", "dp2_zero1"],
)
def test_resume_continues_the_same_run(pool2, tmp_path, layout):
    plan = _write(make_plan(**layout), tmp_path / "p.json")
    full_log, part_log = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    base = ["--plan", str(plan), "--lr", "1e-2"]
    assert pool2.run("dist_workers", "train_main",
                     [*base, "--steps", "4", "--log", str(full_log)]) == [0, 0]
    ck = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2"]
    assert pool2.run("dist_workers", "train_main", [*base, *ck, "--steps", "2"]) == [0, 0]
    assert (tmp_path / "ck" / "step-2").is_dir()
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    assert pool2.run("dist_workers", "train_main",
                     [*base, *ck, "--steps", "4", "--resume", "--log", str(part_log)]) == [0, 0]
    full = [json.loads(x)["loss"] for x in full_log.read_text().splitlines()]
    part = [json.loads(x)["loss"] for x in part_log.read_text().splitlines()]
    assert part == full[2:]


# ---- the training options of issue 31 --------------------------------------------------------


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_learning_rate_schedules():
    from argparse import Namespace

    from plans.run_options import LrSchedule
    from runtime.train import learning_rate

    cos = Namespace(lr=1.0, min_lr=0.1, warmup_steps=4, steps=14,
                    lr_schedule=LrSchedule.cosine)
    lrs = [learning_rate(s, cos) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, the last warmup step at --lr
    assert lrs[4] == 1.0 and all(a > b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert learning_rate(14, cos) == pytest.approx(0.1)  # the floor at --steps
    assert lrs[9] == pytest.approx(0.1 + 0.45 * (1 + np.cos(np.pi / 2)))
    flat = Namespace(lr=2.0, min_lr=0.0, warmup_steps=0, steps=5,
                     lr_schedule=LrSchedule.constant)
    assert {learning_rate(s, flat) for s in range(5)} == {2.0}


def test_a_run_logs_its_id_plan_hash_and_schedule_and_ends_with_a_summary(train_here, tmp_path):
    plan = _write(make_plan(), tmp_path / "p.json")
    log, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    r = train_here("--plan", str(plan), "--steps", "4", "--lr", "1e-2", "--lr-schedule",
                   "cosine", "--warmup-steps", "2", "--min-lr", "1e-3", "--weight-decay", "0",
                   "--seed", "3", "--log-file", str(log), "--ckpt-dir", str(ck),
                   "--ckpt-every", "1", "--ckpt-keep", "2", "--clip-grad", "0.5")
    assert r.returncode == 0, r.stderr
    rows = _records(log)
    assert all(row["grad_norm"] > 0 for row in rows)  # the norm before clipping, every step
    # warmup over 2 steps, then a half cosine over the other 2 towards 1e-3
    assert [row["lr"] for row in rows] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-3 + 4.5e-3])
    assert len({row["run_id"] for row in rows}) == 1
    assert rows[0]["plan_sha256"] == json.loads((ck / "run.json").read_text())["plan_sha256"]
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-3", "step-4"]  # --ckpt-keep 2
    end = r.stdout.strip().splitlines()[-1]
    tokens = 4 * make_plan().training.tokens_per_step
    assert end.startswith(f"trained steps 1..4 (4 steps, {tokens:,} tokens)"), end
    assert f"{ck} (2 kept, newest step-4)" in end and str(log) in end


def test_a_log_or_checkpoints_of_another_run_or_a_later_step_are_refused(train_here, tmp_path):
    plan = _write(make_plan(), tmp_path / "p.json")
    log, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    base = ["--plan", str(plan), "--log-file", str(log), "--ckpt-dir", str(ck),
            "--ckpt-every", "2"]
    assert train_here(*base, "--steps", "2").returncode == 0
    # the same run again from step 1 would overwrite step-2 and repeat the log's steps
    r = train_here("--plan", str(plan), "--ckpt-dir", str(ck), "--ckpt-every", "2")
    _one_line_error(r, "--ckpt-dir", "up to step 2", "pass --resume or --overwrite")
    r = train_here("--plan", str(plan), "--log-file", str(log))
    _one_line_error(r, "--log-file", "already holds steps of this run", "--resume")
    # another run (another seed) appending to this log
    r = train_here("--plan", str(plan), "--log-file", str(log), "--seed", "9")
    _one_line_error(r, "--log-file", "another run")
    # resuming continues both
    r = train_here(*base, "--steps", "3", "--resume")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in _records(log)] == [1, 2, 3]


@pytest.mark.parametrize("args,words", [
    (["--lr", "-1"], ["--lr", ">= 0"]),
    (["--lr-schedule", "linear"], ["--lr-schedule", "linear"]),
    (["--ckpt-keep", "2"], ["--ckpt-keep", "needs --ckpt-dir"]),
    (["--lr", "1e-3", "--min-lr", "1e-2"], ["--min-lr", "above --lr"]),
    (["--steps", "0"], ["--steps", ">= 1"]),
])
def test_bad_training_options_are_one_line(train_here, tmp_path, args, words):
    plan = _write(make_plan(), tmp_path / "p.json")
    _one_line_error(train_here("--plan", str(plan), *args, "--check"), *words)


def test_megatron_indexed_dataset_written_by_megatron_is_read(train_here, tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                  reason="megatron-core is not installed")
    import torch

    from runtime.indexed import read_index

    prefix = tmp_path / "corpus_text_document"
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    docs = [list(range(i, i + 30 + 7 * i)) for i in range(6)]
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    index = read_index(prefix)
    theirs = indexed.IndexedDataset(str(prefix))
    assert index.dtype == np.uint16 and index.tokens == sum(map(len, docs))
    assert list(index.sequence_lengths) == list(theirs.sequence_lengths)
    assert list(index.document_indices) == list(theirs.document_indices)
    tokens = np.memmap(index.bin, dtype=index.dtype, mode="r")
    for i, doc in enumerate(docs):  # each sequence where its pointer says, as Megatron reads it
        at = int(index.sequence_pointers[i]) // 2
        assert list(tokens[at:at + len(doc)]) == doc == list(theirs[i])
    plan = _write(make_plan(), tmp_path / "p.json")
    log = tmp_path / "m.jsonl"
    for data in (prefix, f"{prefix}.bin"):
        log.unlink(missing_ok=True)
        r = train_here("--plan", str(plan), "--steps", "2", "--data", str(data),
                       "--log-file", str(log))
        assert r.returncode == 0, r.stderr
        assert [row["step"] for row in _records(log)] == [1, 2]
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x02" + b"\x00" * 30)
    (tmp_path / "bad.bin").write_bytes(b"")
    _one_line_error(train_here("--plan", str(plan), "--data", str(tmp_path / "bad"), "--check"),
                    "--data", "bad.idx", "version")


TRAINING_FLAGS = ("--steps", "--lr", "--lr-schedule", "--warmup-steps", "--min-lr",
                  "--weight-decay", "--clip-grad", "--seed", "--log-file", "--data")


def test_moeplan_train_and_runtime_train_take_the_same_training_flags():
    import typer.main

    from planner.cli import app
    from runtime.train import parse_args

    train = typer.main.get_command(app).commands["train"]
    launcher = {flag for param in train.params for flag in param.opts}
    runtime = parse_args(["--plan", "p.json", "--clip-grad", "0.5", "--weight-decay", "0",
                          "--seed", "7", "--lr", "1e-3", "--lr-schedule", "cosine"])
    assert set(TRAINING_FLAGS) <= launcher
    assert (runtime.clip_grad, runtime.weight_decay, runtime.seed, runtime.lr,
            runtime.lr_schedule) == (0.5, 0.0, 7, 1e-3, "cosine")


def test_a_negative_clip_grad_is_one_line(tmp_path):
    plan = _write(make_plan(), tmp_path / "p.json")
    _one_line_error(_train("--plan", str(plan), "--clip-grad", "-1"), "--clip-grad", ">= 0")
