"""bench/fidelity/fidelity_at_scale.py: the committed comparison with published Megatron-Core
runs is what the script computes from this cost model, and its generated document section is
current."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.fidelity.fidelity_at_scale")


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


def test_flex_dispatcher_rows_are_priced_as_deepep(bench):
    import yaml

    from plans import Dispatch

    rows = yaml.safe_load(bench.DATA.read_text())["rows"]
    for row in rows:
        want = Dispatch.deepep if row["recipe"]["dispatcher"] == "flex" else Dispatch.all_to_all
        assert bench.row_plan(row).ffn.dispatch == want, row["id"]
    assert any(r["recipe"]["dispatcher"] == "flex" for r in rows)


def test_the_host_launch_time_is_the_fit_to_the_host_bound_rows(fresh):
    """cost_models.megatron.HOST_US_PER_LAUNCH is fitted to the two Qwen3 DGX-B200 rows at
    micro-batch 1: their errors are of opposite signs and within 10%."""
    rows = {r["id"]: r for r in fresh["rows"]}
    errors = [rows[k]["megatron"]["error"]
              for k in ("qwen3-30b-b200-fp8mx", "qwen3-235b-b200-fp8mx")]
    assert min(errors) < 0 < max(errors)
    assert max(map(abs, errors)) < 0.10
    assert rows["qwen3-30b-b200-fp8mx"]["mbs"] == rows["qwen3-235b-b200-fp8mx"]["mbs"] == 1


def _rows(bench) -> dict:
    import yaml

    return {r["id"]: r for r in yaml.safe_load(bench.DATA.read_text())["rows"]}


def test_a_row_whose_published_batch_contradicts_its_layout_is_priced_at_its_recipes(bench):
    """GPT-OSS-120B on DGX-H100: the published MBS 4 and GA 2 cannot both hold at pp4 dp16
    (512 / (4 x 16) = 8 micro-batches); the recipe's micro_batch_size 1 is priced, the global
    batch kept: 512 / (1 x 16) = 32 micro-batches."""
    row = _rows(bench)["gpt-oss-120b-h100-bf16"]
    dp = row["gpus"] // (row["pp"] * row["tp"] * row["cp"])
    assert row["gbs"] / (row["mbs"] * dp) != row["ga"]
    plan = bench.row_plan(row)
    assert plan.micro_batch_size == row["recipe"]["priced_mbs"] == 1
    assert plan.training.global_batch == 512 and plan.num_micro_batches == 32


def test_every_other_row_prices_its_published_micro_batch(bench):
    for key, row in _rows(bench).items():
        if "priced_mbs" not in row["recipe"]:
            assert bench.row_plan(row).micro_batch_size == row["mbs"], key


def test_a_token_dropping_twin_is_capacity_bound_and_waits_for_no_split_sizes(bench):
    """apply_moe_token_drop (Megatron-Bridge v0.1.0rc4): capacity factor 1.0, padded, alltoall;
    so Megatron-Core's dispatcher never reads the split sizes on the host, where the dropless
    row waits once per MoE layer and micro-batch."""
    from cost_models import megatron
    from plans import Dispatch

    row = _rows(bench)["qwen3-30b-gb200-fp8mx"]  # flex (HybridEP) when dropless
    drop, dropless = bench.tokendrop_plan(row), bench.row_plan(row)
    assert drop.ffn.capacity_factor == 1.0 and drop.ffn.dispatch == Dispatch.all_to_all
    assert megatron.syncs(drop) == 0 and megatron.syncs(dropless) == 1
    assert drop.degrees == dropless.degrees and drop.micro_batch_size == dropless.micro_batch_size


def test_a_token_dropping_twin_runs_its_own_releases_settings(bench):
    """Megatron-Bridge v0.1.0rc4's perf matrix: whole-layer CUDA graphs (enable_cuda_graph) on
    B200 / GB200 for Qwen3-30B-A3B, vp 12 on H100, no EP overlap for any Qwen3 run."""
    from cost_models import megatron
    from plans import CudaGraphs, Overlap

    rows = _rows(bench)
    b200 = bench.tokendrop_plan(rows["qwen3-30b-b200-fp8mx"])
    assert b200.cuda_graphs == CudaGraphs.layer
    assert megatron.launches(b200).before_wait == megatron.Launches(1, 1)
    assert megatron.launches(b200).after_wait == megatron.NONE
    h100 = bench.tokendrop_plan(rows["qwen3-30b-h100-fp8cs"])
    assert h100.degrees.vpp == 12 and bench.row_plan(rows["qwen3-30b-h100-fp8cs"]).degrees.vpp == 24
    assert h100.cuda_graphs == CudaGraphs.none
    for row in rows.values():
        if "tokendrop_25_09" in row:
            assert bench.tokendrop_plan(row).overlap == Overlap.none


def test_a_dropless_moe_layer_cannot_be_graphed_whole(bench):
    import pydantic
    import pytest

    from plans import CudaGraphs

    plan = bench.row_plan(_rows(bench)["qwen3-30b-b200-fp8mx"])
    with pytest.raises(pydantic.ValidationError, match="cuda_graphs: layer"):
        plan.model_validate({**plan.model_dump(), "cuda_graphs": CudaGraphs.layer})


def test_the_token_dropping_pairs_compare_like_with_like(fresh):
    pairs = fresh["tokendrop_25_09"]
    assert len(pairs) == 5
    rows = {r["id"]: r for r in fresh["rows"]}
    for p in pairs:
        assert p["published_dropless"] == rows[p["id"]]["tokens_s_gpu"]
        assert p["predicted_dropless"] == rows[p["id"]]["megatron"]["tokens_s_gpu"]
        assert p["published_ratio"] == p["published_dropless"] / p["published_tokendrop"]
        assert abs(p["error"] - (p["predicted_tokendrop"] / p["published_tokendrop"] - 1)) < 1e-12
        # without the host's term the step can only shorten
        assert p["predicted_tokendrop_device"] >= p["predicted_tokendrop"]
