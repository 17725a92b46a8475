"""runtime.train: bad input exits 2 with one line, logging, token files, checkpoint/resume."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

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
    # eager kernels compile nothing; the last line puts the first step apart from the rest
    assert rows[0]["compiled_graphs"] == {"hits": 0, "misses": 0}
    last = r.stdout.strip().splitlines()[-1]
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
    (inductor's FX graph cache hits, read from torch's counters)."""
    cache = tmp_path / "cache"

    def launch() -> dict:
        r = subprocess.run([sys.executable, "-c", _COMPILE, str(cache)], cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"'))

    assert launch() == {"hits": 0, "misses": 1}
    assert (cache / "fxgraph").is_dir()
    assert launch() == {"hits": 1, "misses": 0}


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
