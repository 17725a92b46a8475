"""Specs, catalog and parameter formulas against published model sizes."""

import json

import pytest
from pydantic import ValidationError

from plans import ClusterSpec, ModelSpec, SpecError, TrainingSpec, catalog
from plans.errors import describe

# Published totals / active parameters (billions).
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "mixtral-8x22b": (141.0, 39.0),
    "phi-3.5-moe": (41.9, 6.6),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.0, 22.0),
}


@pytest.mark.parametrize("name", catalog.names("models"))
def test_every_model_loads(name):
    m = catalog.load_model(name)
    assert m.total_params > m.active_params > 0
    assert m.flops_per_token(4096) > 6 * m.matmul_params_per_token


@pytest.mark.parametrize("name", catalog.names("clusters"))
def test_every_cluster_loads(name):
    c = catalog.load_cluster(name)
    assert c.gpus == c.node.gpus_per_node
    assert c.gpu.fp8_dense_tflops >= c.gpu.bf16_dense_tflops


@pytest.mark.parametrize("name,published", PUBLISHED.items())
def test_parameter_counts_match_published(name, published):
    total_b, active_b = published
    m = catalog.load_model(name)
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.02)
    assert m.active_params / 1e9 == pytest.approx(active_b, rel=0.02)


def test_internal_352b_matches_its_name_and_the_papers_mfu():
    """MegaScale-MoE publishes no parameter count, only the name (352B) and, in Sec. 6.1 and
    Table 3, MFU over GEMM and FlashAttention FLOPs: 27.89% at 1,407.7k tokens/s on 1,440 H800
    and 32.48% at 272.9k on 240, at 989 TFLOP/s (Table 4): FLOPs per token = MFU x peak x
    GPUs / throughput."""
    m = catalog.load_model("internal-352b")
    assert m.total_params / 1e9 == pytest.approx(352, rel=0.005)
    for mfu, gpus, tokens_s in ((0.2789, 1440, 1407.7e3), (0.3248, 240, 272.9e3)):
        assert m.flops_per_token(8192) == pytest.approx(mfu * gpus * 989e12 / tokens_s, rel=0.005)


def test_mixtral_parameter_formula_by_hand():
    m = catalog.load_model("mixtral-8x7b")
    attn = 4096 * (2 * 4096 + 2 * 1024)  # Wq, Wo: h x h; Wk, Wv: h x kv_dim
    expert = 3 * 4096 * 14336
    layer = attn + 8 * expert + 4096 * 8 + 2 * 4096  # + router + two RMSNorms
    assert m.total_params == 32 * layer + 2 * 32000 * 4096 + 4096


def test_flops_per_token_by_hand():
    m = catalog.load_model("tiny-moe")
    # matmul weights one token touches: attention 64*(2*64+2*32) per layer, 2 experts of
    # 3*64*96, router 64*4, LM head 256*64.
    matmul = 4 * (64 * (2 * 64 + 2 * 32) + 2 * 3 * 64 * 96 + 64 * 4) + 256 * 64
    assert m.matmul_params_per_token == matmul
    seq = 32
    attention = 4 * 2 * 2 * seq * 64 * 0.5
    assert m.flops_per_token(seq) == 3 * (2 * matmul + attention)
    assert m.flops_per_token(seq, training=False) == 2 * matmul + attention


def test_shared_and_dense_layers_counted():
    m = catalog.load_model("tiny-moe-shared")
    plain = m.model_copy(update={"shared_experts": 0, "shared_expert_ffn_hidden": 0})
    assert m.total_params - plain.total_params == 3 * (3 * 64 * 64)  # 3 MoE layers
    assert m.embedding_params == 256 * 64  # tied


@pytest.mark.parametrize(
    "update,field,words",
    [
        ({"kv_heads": 3}, "", "must be a multiple of kv_heads (3)"),
        ({"top_k": 9}, "", "top_k (9) must be <= experts (8)"),
        ({"hidden": 0}, "hidden", "greater than 0"),
        ({"dense_layers": 32}, "", "dense_layers (32) must be < layers (32)"),
        ({"shared_experts": 1}, "", "shared_expert_ffn_hidden (0)"),
    ],
)
def test_model_invariants_print_numbers(update, field, words):
    data = {**catalog.load_model("mixtral-8x7b").model_dump(), **update}
    with pytest.raises(ValidationError) as e:
        ModelSpec.model_validate(data)
    msg = describe(e.value, "model")
    assert msg.startswith(f"model.{field}" if field else "model:")
    assert words in msg
    assert "\n" not in msg


def test_unknown_field_rejected():
    data = {**catalog.load_model("tiny-moe").model_dump(), "expert": 3}
    with pytest.raises(ValidationError) as e:
        ModelSpec.model_validate(data)
    assert describe(e.value) == "expert: unknown field (value 3)"


def test_cluster_gpu_count_must_fill_nodes():
    with pytest.raises(SpecError, match=r"gpus \(12\) must be a multiple of node.gpus_per_node"):
        catalog.load_cluster("h800", gpus=12)
    assert catalog.load_cluster("h800", gpus=2).nvlink_domain == 2
    big = catalog.load_cluster("h800", gpus=1440)
    assert (big.nodes, big.nvlink_domain, big.network_gb_s_per_gpu) == (180, 8, 50.0)


def test_training_rejects_fp32_compute():
    with pytest.raises(ValidationError, match="precision must be bf16 or fp8"):
        TrainingSpec(precision="fp32")


def test_names_are_case_insensitive_and_unknown_names_listed():
    assert catalog.load_model("Mixtral-8x7B").name == "Mixtral-8x7B"
    with pytest.raises(SpecError, match="unknown name 'mixtral'.*mixtral-8x7b"):
        catalog.load_model("mixtral")


def test_spec_files_by_path(tmp_path):
    c = catalog.load_cluster("h100")
    path = tmp_path / "my.json"
    path.write_text(json.dumps({**c.model_dump(), "name": "mine"}))
    assert catalog.load_cluster(str(path)).name == "mine"
    yml = tmp_path / "bad.yaml"
    yml.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="bad.yaml: not valid yaml"):
        catalog.load_model(str(yml))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        catalog.load_model(str(lst))
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="cannot read"):
        catalog.load_model(str(missing))


def test_cluster_round_trip():
    c = catalog.load_cluster("gb200-nvl72", gpus=144)
    assert ClusterSpec.model_validate_json(c.model_dump_json()) == c


def test_a_catalog_name_wins_over_a_file_of_that_name(tmp_path, monkeypatch):
    """A folder or stray file called like a catalog entry in the working directory does not
    hide the entry; a path-shaped argument (./h200) is the file; a blank name is a name."""

    monkeypatch.chdir(tmp_path)
    (tmp_path / "h200").mkdir()
    (tmp_path / "tiny-moe").write_text("junk: 1\n")
    assert catalog.load_cluster("h200").name == "H200-SXM"
    assert catalog.load_model("tiny-moe").experts > 0
    with pytest.raises(SpecError, match=r"^h200: cannot read \(a directory"):
        catalog.load_cluster("./h200")
    with pytest.raises(SpecError, match=r"^model: unknown name ''"):
        catalog.load_model("")


def test_a_key_given_twice_is_refused(tmp_path):
    """json.loads and PyYAML keep the last of a repeated key silently; the loader refuses it
    (YAML merge keys still merge)."""
    from pathlib import Path

    from plans.io import read_document

    for name, text in (("p.json", '{"a": 1, "a": 2}'), ("p.yaml", "a: 1\nb: 2\na: 3\n")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(SpecError, match=r"key 'a' appears twice"):
            read_document(path)
    merged = tmp_path / "m.yaml"
    merged.write_text("b: &x {c: 1}\nd:\n  <<: *x\n  e: 2\n")
    assert read_document(Path(merged))["d"] == {"c": 1, "e": 2}
