"""Hugging Face configs to ModelSpec (plans.hf) and `moeplan import-hf`."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans import ModelSpec, SpecError, catalog, hf
from plans.enums import LinearBias, RouterScore, WindowKind

CONFIGS = Path(__file__).parent / "hf_configs"
FILES = sorted(CONFIGS.glob("*.json"))
runner = CliRunner(env={"COLUMNS": "250"})


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_config_maps_and_round_trips_through_import_hf(path, tmp_path):
    spec = catalog.load_model(str(path))
    out = tmp_path / "model.yaml"
    result = runner.invoke(app, ["import-hf", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert catalog.load_model(str(out)) == spec


def test_deepseek_v3_maps_every_feature():
    m = catalog.load_model(str(CONFIGS / "deepseek-v3.json"))
    assert m.mla is not None and m.mla.q_lora_rank == 1536 and m.mla.v_head_dim == 128
    assert m.head_dim == 192 and m.kv_heads == 128
    assert m.router_score == RouterScore.sigmoid and m.router_expert_bias
    assert (m.expert_groups, m.groups_per_token, m.mtp_layers) == (8, 4, 1)
    assert m.routed_scaling_factor == 2.5 and m.dense_layers == 3
    assert m == catalog.load_model("deepseek-v3").model_copy(update={"name": m.name})


def test_other_families_map_their_features():
    oss = catalog.load_model(str(CONFIGS / "gpt-oss-120b.json"))
    assert (oss.sliding_window, oss.full_attention_every, oss.attention_sinks) == (128, 2, True)
    assert oss.linear_bias == LinearBias.all and oss.swiglu_limit == 7.0
    y = oss.rope_scaling  # YaRN, Megatron's attention factor 0.1 ln(32) + 1
    assert (y.rope_type, y.factor, y.original_max_position_embeddings) == ("yarn", 32.0, 4096)
    assert (y.beta_fast, y.beta_slow, y.truncate, y.mscale) == (32.0, 1.0, False, None)
    assert round(y.attention_factor, 2) == 1.35
    v3 = catalog.load_model(str(CONFIGS / "deepseek-v3.json")).rope_scaling
    assert (v3.factor, v3.mscale, v3.mscale_all_dim, v3.attention_factor) == (40, 1, 1, 1)
    # the other RoPE scalings rescale the angles alone: plain RoPE
    assert catalog.load_model(str(CONFIGS / "llama-4-scout.json")).rope_scaling is None
    scout = catalog.load_model(str(CONFIGS / "llama-4-scout.json"))
    assert scout.window_kind == WindowKind.chunked and scout.full_attention_every == 4
    assert scout.shared_experts == 1 and scout.router_score == RouterScore.sigmoid
    qwen2 = catalog.load_model(str(CONFIGS / "qwen2-57b-a14b.json"))
    assert qwen2.shared_expert_gate and qwen2.linear_bias == LinearBias.qkv
    assert qwen2.router_pre_softmax  # norm_topk_prob false
    glm = catalog.load_model(str(CONFIGS / "glm-4.5.json"))
    assert glm.rotary_fraction == 0.5 and glm.mtp_layers == 1 and glm.qk_norm
    hunyuan = catalog.load_model(str(CONFIGS / "hunyuan-large.json"))
    assert hunyuan.kv_share_layers == 2 and hunyuan.kv_borrowing_layers == 32
    # Phi's window covers every position it accepts: no window
    assert catalog.load_model(str(CONFIGS / "phi-3.5-moe.json")).sliding_window == 0


def test_a_snapshot_folder_is_a_model(tmp_path):
    snapshot = tmp_path / "models--openai--gpt-oss-120b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((CONFIGS / "gpt-oss-120b.json").read_text())
    m = catalog.load_model(str(snapshot))
    assert m.name == "gpt-oss-120b" and m.experts == 128
    assert hf.load(snapshot) == m


def test_import_hf_json_carries_the_counts():
    result = runner.invoke(app, ["import-hf", str(CONFIGS / "mixtral-8x7b.json"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    m = ModelSpec.model_validate(doc["model"])
    assert doc["total_params"] == m.total_params == 46_702_792_704
    assert doc["active_params"] == m.active_params


def test_import_hf_prints_the_counts_and_the_spec():
    result = runner.invoke(app, ["import-hf", str(CONFIGS / "deepseek-v3.json"),
                                 "--name", "DeepSeek-V3"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("# DeepSeek-V3: 683B total, 38.2B active\nname: DeepSeek-V3")
    assert "kv_lora_rank: 512" in result.output


BAD = [
    ("mixtral-8x7b", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     "model_type: 'llama' is not a mapped MoE architecture"),
    ("mixtral-8x7b", {"model_type": None, "architectures": ["FooForCausalLM"]},
     "architectures: ['FooForCausalLM'] is not a mapped MoE architecture"),
    ("mixtral-8x7b", {"num_hidden_layers": -1}, "num_hidden_layers: must be >= 0"),
    ("mixtral-8x7b", {"num_hidden_layers": 0}, "num_hidden_layers: Input should be greater"),
    ("mixtral-8x7b", {"num_attention_heads": 30},
     "num_attention_heads: 30 heads do not divide hidden_size 4096"),
    ("mixtral-8x7b", {"num_experts_per_tok": 9},
     "num_experts_per_tok: 9 is above the 8 experts (num_local_experts)"),
    ("mixtral-8x7b", {"num_key_value_heads": 5}, "num_attention_heads: query_heads (32) must be "
     "a multiple of kv_heads (5)"),
    ("mixtral-8x7b", {"hidden_act": "gelu"}, "hidden_act: 'gelu' is not modelled"),
    ("mixtral-8x7b", {"vocab_size": "big"}, "vocab_size: must be an integer"),
    ("mixtral-8x7b", {"use_parallel_residual": True},
     "use_parallel_residual: key not mapped to the model spec"),
    ("deepseek-v3", {"n_group": 7}, "n_group: expert_groups (7) must divide experts (256)"),
    ("deepseek-v3", {"topk_group": 9}, "topk_group: groups_per_token (9) must be <="),
    ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq: 2 is not modelled"),
    ("deepseek-v3", {"norm_topk_prob": False}, "norm_topk_prob: false is not modelled"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [5]}, "mlp_only_layers: [5] is not modelled"),
    ("gpt-oss-120b", {"layer_types": ["full_attention", "sliding_attention"] * 18},
     "layer_types: not modelled"),
    ("gpt-oss-120b", {"rope_scaling": {"rope_type": "yarn", "factor": "x",
                                       "original_max_position_embeddings": 4096}},
     "rope_scaling: factor: Input should be a valid number"),
    ("gpt-oss-120b", {"rope_scaling": {"rope_type": "yarn", "factor": 32}},
     "rope_scaling: original_max_position_embeddings: Field required"),
    ("gpt-oss-120b", {"rope_scaling": {"rope_type": "yarn", "factor": 32, "beta_fast": 1,
                                       "beta_slow": 32, "original_max_position_embeddings": 4096}},
     "rope_scaling: beta_slow: beta_slow (32) must be <= beta_fast (1)"),
    ("gpt-oss-120b", {"rope_scaling": {"rope_type": "yarn", "factor": 32,
                                       "attention_factor": 1.2,
                                       "original_max_position_embeddings": 4096}},
     "rope_scaling: attention_factor: not modelled for YaRN"),
    ("gpt-oss-120b", {"rope_scaling": "yarn"}, "rope_scaling: must be a mapping"),
]


@pytest.mark.parametrize("base,update,message", BAD, ids=[m.split(":")[0] for *_, m in BAD])
def test_bad_configs_are_refused_in_one_line_naming_the_key(base, update, message, tmp_path):
    data = {k: v for k, v in {**config(base), **update}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as e:
        catalog.load_model(str(path))
    assert f"{path}: {message}" in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "model.yaml"
    result = runner.invoke(app, ["import-hf", str(path), "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [ln for ln in result.output.splitlines() if ln] == [f"error: {e.value}"]
    assert not out.exists()


def test_a_search_takes_a_config_and_reports_its_counts():
    result = runner.invoke(app, ["search", str(CONFIGS / "mixtral-8x7b.json"), "h100", "--gpus",
                                 "16", "--global-batch", "32", "--seq-len", "4096", "--top", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("mixtral-8x7b (46.7B total, 12.9B active) on 16 x H100")
