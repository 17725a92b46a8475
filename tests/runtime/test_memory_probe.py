"""`moeplan memory` (runtime/memory_probe.py) on CPU: the probe reads a CUDA allocator, so here
its refusal and the document it writes (the committed memory results' shape); its imports:
tests/runtime/test_parity_check.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_workers import make_plan

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "bench/results/h200/memory/memory_qwen4l_1gpu_mbs1.json"


def test_without_a_gpu_it_says_so_in_one_line(tmp_path, python):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the probe would run for real")
    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())
    out = tmp_path / "m.json"
    r = python("-m", "runtime.memory_probe", "--plan", str(plan), "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: memory: probes a CUDA device's allocator; no GPU here"]
    assert not out.exists()


def test_the_document_has_the_committed_results_shape():
    import torch

    from runtime.memory_probe import document, line
    from runtime.provenance import metadata

    committed = json.loads(COMMITTED.read_text())
    rank = dict(committed["ranks"][0])
    plan = make_plan()
    result = {**rank, "plan_summary": plan.summary(), "plan": plan.model_dump(mode="json")}
    doc = document("tiny", plan, result, 0, 1, torch.device("cpu"))
    # the metadata (runtime.provenance, written before it), then the document's own fields
    assert list(committed)[-len(doc):] == list(doc)
    assert set(committed) - set(doc) <= set(metadata()) | {"nccl_switches"}
    assert doc["case"] == "tiny" and doc["world"] == 1 and doc["ranks"] == [rank]
    gib = 2**30
    assert line(doc) == (f"tiny: ok peak {rank['peak_allocated_bytes'] / gib:.2f} GiB "
                         f"allocated, {rank['peak_reserved_bytes'] / gib:.2f} GiB reserved "
                         f"({rank['run_s']:.0f} s)")

