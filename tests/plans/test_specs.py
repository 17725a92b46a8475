"""Specs, catalog and parameter formulas against published model sizes."""

import json
from pathlib import Path

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
        ({"swiglu_limit": 7.0, "dense_layers": 1, "dense_ffn_hidden": 64}, "",
         "swiglu_limit is modelled for routed experts only"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 1.0,
                           "original_max_position_embeddings": 4096}},
         "rope_scaling.factor", "greater than 1"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "mscale": 1.0,
                           "original_max_position_embeddings": 4096}},
         "rope_scaling", "mscale and mscale_all_dim must be given together"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 32.0,
                           "original_max_position_embeddings": 4096}},
         "rope_scaling.rope_type", "'yarn'"),
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


def test_clusters_of_one_die_share_one_efficiency_profile(tmp_path):
    """The Hopper factors are defined once (plans/catalog/efficiency/hopper.yaml): the GH100
    clusters and the Blackwell ones, whose prior they are, name the profile; factors beside
    the name override it (Blackwell's: no sm90 grouped-kernel operand stream), the paper's
    cluster's kernel_scale multiplies its kernel rates; an unknown profile is one line naming
    the field."""
    from plans.io import read_document
    from plans.specs import KERNEL_FACTORS

    profile = read_document(catalog.CATALOG_DIR / "efficiency" / "hopper.yaml")
    blackwell = {"grouped_gemm_stream_tb_s": None}
    for name in ("h100", "h200", "h800", "h800-megascale", "b200", "gb200-nvl72", "gb300-nvl72"):
        raw = read_document(catalog.CATALOG_DIR / "clusters" / f"{name}.yaml")
        own = blackwell if name[0] in "bg" else {}
        scale = raw["efficiency"].get("kernel_scale", 1.0)
        assert raw["efficiency"] == {"profile": "hopper", **own, **(
            {"kernel_scale": scale} if name == "h800-megascale" else {})}, name
        eff = catalog.load_cluster(name).efficiency
        assert {k: getattr(eff, k) for k in profile} == {
            **{k: v * scale if k in KERNEL_FACTORS else v for k, v in profile.items()},
            **own}, name
    assert catalog.names("efficiency") == ["hopper"]
    base = {**catalog.load_cluster("b200").model_dump(mode="json"), "name": "mine"}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**base, "efficiency": {"profile": "hopper", "gemm": 0.7}}))
    eff = catalog.load_cluster(str(path)).efficiency
    assert (eff.gemm, eff.grouped_gemm) == (0.7, profile["grouped_gemm"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**base, "efficiency": {"profile": "blackwell"}}))
    with pytest.raises(SpecError, match=r"bad.json.efficiency.profile: unknown efficiency "
                                        r"profile 'blackwell'; built-in: hopper$"):
        catalog.load_cluster(str(path))


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


# ---- published counts of the Hugging Face configs (tests/plans/hf_configs) ----------------------
# (config, total, active, convention). A figure is met when the count lies within 0.5% of it, or,
# for a figure published to fewer digits than that, when the count rounds to it (half a unit of
# its last digit: "37B" is 36.5B .. 37.5B). Conventions, as each publisher counts:
#   all        every parameter (embedding row and LM head included): Mistral, Qwen, Phi, Meta
#   no_lookup  less the input embedding (a lookup, no GEMM), head kept: DeepSeek, Moonshot
#              (Kimi-K2's card: 1T / 32B), OpenAI (gpt-oss model card: 116.83B / 5.13B)
#   no_vocab   less the embedding and the LM head, MTP layer kept: Zhipu (GLM-4.5 355B / 32B)
# DeepSeek-V3's 671B / 37B are without its MTP module; 685B is with it (the checkpoint also
# stores the module's own copy of the embedding and head, 1.85B, which training shares:
# ModelSpec counts them once, 682.6B, -0.35%).
HF_PUBLISHED = [  # config, total and its convention, active and its convention, update
    ("deepseek-v3", "671B", "all", "37B", "no_lookup", {"mtp_layers": 0}),
    ("deepseek-v3", "685B", "all", None, "", {}),
    ("deepseek-v2", "236B", "all", "21B", "no_lookup", {}),
    ("kimi-k2", "1T", "all", "32B", "no_lookup", {}),
    ("qwen3-235b-a22b", "235B", "all", "22B", "all", {}),
    ("qwen3-30b-a3b", "30.5B", "all", None, "", {}),
    ("qwen2-57b-a14b", "57.4B", "all", "14.2B", "all", {}),
    ("mixtral-8x7b", "46.7B", "all", "12.9B", "all", {}),
    ("gpt-oss-120b", "116.83B", "all", "5.13B", "no_lookup", {}),
    ("glm-4.5", "355B", "no_vocab", "32B", "no_vocab", {}),
    ("llama-4-maverick", "400B", "all", "17B", "all", {}),
    ("phi-3.5-moe", "41.9B", "all", "6.6B", "all", {}),
    ("hunyuan-large", "389B", "all", None, "", {}),
]
HF_CONFIGS = Path(__file__).parent / "hf_configs"


def _figure(text: str) -> tuple[float, float]:
    """A published count and the tolerance it allows (module comment)."""
    scale = {"T": 1e12, "B": 1e9}[text[-1]]
    digits = text[:-1]
    unit = 10.0 ** -len(digits.partition(".")[2]) * scale
    value = float(digits) * scale
    return value, max(0.005 * value, unit / 2)


def _convention(m: ModelSpec, n: int, convention: str) -> int:
    lookup = m.vocab * m.hidden
    return {"all": n, "no_lookup": n - lookup, "no_vocab": n - m.embedding_params}[convention]


@pytest.mark.parametrize("config,total,total_as,active,active_as,update", HF_PUBLISHED,
                         ids=[f"{c}-{t}" for c, t, *_ in HF_PUBLISHED])
def test_hf_configs_match_published_counts(config, total, total_as, active, active_as, update):
    m = catalog.load_model(str(HF_CONFIGS / f"{config}.json")).model_copy(update=update)
    value, tolerance = _figure(total)
    assert abs(_convention(m, m.total_params, total_as) - value) <= tolerance
    if active is not None:
        value, tolerance = _figure(active)
        assert abs(_convention(m, m.active_params, active_as) - value) <= tolerance


def test_qwen3_30b_active_is_the_published_figure_truncated():
    """Qwen3-30B-A3B's card says 3.3B activated: 3.353B cut to one decimal."""
    m = catalog.load_model(str(HF_CONFIGS / "qwen3-30b-a3b.json"))
    assert 3.3e9 <= m.active_params < 3.4e9


def test_mla_counts_follow_the_deepseek_v3_shapes():
    """One DeepSeek-V3 attention layer: q down 7168x1536 and up 1536x(128x192), kv down
    7168x(512+64) and up 512x(128x(128+128)), output (128x128)x7168, latent norms 1536+512."""
    m = catalog.load_model("deepseek-v3")
    gemm = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert m.attention_gemm_params == gemm
    assert m.attention_params == gemm + 1536 + 512
    # attention core: QK^T at 192 wide, PV at 128, causal half of the s x s scores
    assert m.attention_flops_per_token(4096) == pytest.approx(
        2 * 4096 * 128 * (192 + 128) * 0.5 * (61 + 1))


def test_layer_pattern_window_and_mtp_fields():
    scout = catalog.load_model("llama-4-scout")
    assert [scout.layer_window(i) for i in range(4)] == [8192, 8192, 8192, 0]
    maverick = catalog.load_model(str(HF_CONFIGS / "llama-4-maverick.json"))
    assert maverick.moe_pattern[:4] == (False, True, False, True)
    assert maverick.moe_layers == 24 and maverick.dense_ffn_layers == 24
    oss = catalog.load_model("gpt-oss-120b")
    assert [oss.layer_window(i) for i in range(4)] == [128, 0, 128, 0]
    v3 = catalog.load_model("deepseek-v3")
    no_mtp = v3.model_copy(update={"mtp_layers": 0})
    # one MTP module: an MoE layer, two input norms, the 2h x h projection and a final norm
    assert v3.total_params - no_mtp.total_params == (v3.layer_params(True, 256)
                                                     + 2 * 7168 * 7168 + 3 * 7168)
    assert v3.flops_per_token(4096) > no_mtp.flops_per_token(4096)


@pytest.mark.parametrize("update,field", [
    ({"kv_heads": 8}, "kv_heads"),
    ({"head_dim": 128}, "head_dim"),
    ({"expert_groups": 7}, "expert_groups"),
    ({"groups_per_token": 9}, "groups_per_token"),
    ({"top_k": 8, "groups_per_token": 1, "expert_groups": 64}, "top_k"),
    ({"router_pre_softmax": True}, "router_pre_softmax"),
    ({"moe_layer_interval": 70}, "moe_layer_interval"),
    ({"full_attention_every": 2}, "full_attention_every"),
])
def test_new_fields_refuse_inconsistent_values_naming_the_field(update, field):
    data = {**catalog.load_model("deepseek-v3").model_dump(), **update}
    with pytest.raises(ValidationError) as e:
        ModelSpec.model_validate(data)
    assert describe(e.value).startswith(f"{field} ")


def test_a_kept_hash_is_the_fields_hash_and_never_outlives_them():
    import pickle

    from pydantic._internal._model_construction import make_hash_func

    cluster = catalog.load_cluster("h800", gpus=16)
    first = hash(cluster)
    assert first == make_hash_func(ClusterSpec)(cluster)  # pydantic's own value
    assert hash(cluster) == first
    resized = cluster.model_copy(update={"gpus": 8})
    assert hash(resized) == make_hash_func(ClusterSpec)(resized) != first
    assert cluster.model_copy() == cluster and hash(cluster.model_copy()) == first
    data = pickle.dumps(cluster)
    assert b"_hash" not in data  # another process hashes strings with another seed
    again = pickle.loads(data)
    assert again == cluster and hash(again) == first
    assert catalog.load_cluster("h800", gpus=16) == cluster  # one hashed, one not
    assert "_hash" not in cluster.model_dump_json() and "_hash" not in repr(cluster)
