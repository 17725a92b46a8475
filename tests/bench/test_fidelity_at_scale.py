"""bench/fidelity/fidelity_at_scale.py: the committed comparison with published Megatron-Core
runs is what the script computes from this cost model, and its generated document section is
current."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "fidelity_at_scale", ROOT / "bench/fidelity/fidelity_at_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(bench):
    return json.loads(json.dumps(bench.results()))


def test_committed_results_are_what_the_script_computes(fresh):
    committed = json.loads((ROOT / "bench/results/fidelity_at_scale.json").read_text())
    assert {k: committed[k] for k in fresh} == fresh


def test_the_generated_section_of_the_document_is_current(bench, fresh):
    assert bench.document(fresh) in (ROOT / "docs/fidelity_at_scale.md").read_text()


def test_every_published_row_is_priced_or_says_why(fresh):
    rows = fresh["rows"]
    assert len(rows) == 18  # 17 Megatron-Bridge MoE rows and Megatron-LM's Mixtral run
    for r in rows:
        assert r["status"] == "priced" or r["status"].startswith("not "), r


def test_layers_split_as_megatron_accounts_for_the_embedding_and_loss(bench):
    # Qwen3-235B-A22B's 94 layers over pp4 x vp12 chunks: the first and last chunk hold one
    assert bench.chunk_layers(94, 48, True) == (1,) + (2,) * 46 + (1,)
    assert bench.chunk_layers(48, 48, False) == (1,) * 48
    assert bench._segment(256) == 64 and bench._segment(8) == 8
