"""The expert GEMM bench's shapes (bench/kernels/expert_gemm_gpu.py SHAPES) are the catalog
models' own experts, hidden width, expert FFN width and top-k."""

from __future__ import annotations

import pytest

from bench.kernels.expert_gemm_gpu import SHAPES
from plans import catalog

CATALOG_NAME = {"mixtral-8x7b": "mixtral-8x7b", "qwen3-30b-a3b": "qwen3-30b-a3b",
                "deepseekmoe-16b": "deepseekmoe", "deepseek-v3": "deepseek-v3"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_bench_shape_is_its_catalog_models_expert_layer(shape):
    model = catalog.load_model(CATALOG_NAME[shape])
    assert SHAPES[shape] == (model.experts, model.hidden, model.expert_ffn_hidden, model.top_k)
