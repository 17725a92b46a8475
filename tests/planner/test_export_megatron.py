"""Megatron-LM's own checks on exports: every catalog job's best plans and its Megatron-style
baseline, exported, then run through Megatron's `parse_args`, `validate_args` and
`core_transformer_config_from_args` (which builds and validates `TransformerConfig`), and read
back: the parallel degrees, the exact per-chunk stage split and the model are the plan's.

Megatron-LM release: megatron-core 0.15.3 (PyPI; its wheel imports on Python 3.11 and CPU-only
torch) for megatron.core, and megatron/training/arguments.py of the same release (git tag
core_v0.15.3, commit 309ffca6) vendored unchanged in tests/planner/megatron_fixture, since the
wheel does not ship megatron/training. Runs on Python 3.11 (CI installs megatron-core through
the dev extra); skipped when megatron-core is not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'megatron-core==0.15.3', part of the dev extra)")

from planner.export import (  # noqa: E402
    megatron_args,
    megatron_env,
    megatron_refusal,
    megatron_script,
)
from planner.search import search  # noqa: E402
from plans import Plan, SpecError, TrainingSpec, catalog  # noqa: E402

FIXTURE = Path(__file__).parent / "megatron_fixture"
ARCH = {"a100": 8, "h100": 9, "h800": 9, "h200": 9, "b200": 10, "gb200-nvl72": 10}
"""Major compute capability of each catalog cluster's GPU."""

# (model, cluster, GPUs, global batch, sequence): 13 jobs x (top 8 + baseline)
JOBS = [
    ("mixtral-8x7b", "h100", 64, 256, 4096),
    ("mixtral-8x7b", "h800", 32, 128, 4096),
    ("mixtral-8x22b", "h800", 128, 256, 4096),
    ("phi-3.5-moe", "a100", 64, 256, 4096),
    ("qwen3-30b-a3b", "h200", 16, 128, 4096),
    ("qwen3-30b-a3b", "b200", 32, 128, 8192),
    ("qwen3-235b-a22b", "h800", 256, 512, 4096),
    ("deepseekmoe", "h100", 16, 256, 4096),
    ("hunyuan-large", "h800", 256, 512, 4096),
    ("internal-352b", "h800", 240, 240, 8192),
    ("internal-352b", "gb200-nvl72", 144, 288, 8192),
    ("tiny-moe-shared", "h100", 16, 64, 1024),
    ("tiny-moe", "h200", 8, 32, 512),
]
TOP = 8


def _megatron():
    """Megatron's argument functions, the fixture's megatron.training beside megatron.core
    (megatron is a namespace package)."""
    if str(FIXTURE) not in sys.path:
        sys.path.insert(0, str(FIXTURE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training import arguments
    return arguments


def _plans() -> list[tuple[str, Plan, int]]:
    out = []
    for name, cluster, gpus, batch, seq in JOBS:
        result = search(catalog.load_model(name), catalog.load_cluster(cluster, gpus=gpus),
                        TrainingSpec(global_batch=batch, seq_len=seq), top=TOP)
        job = f"{name}/{cluster}x{gpus}"
        out += [(f"{job}#{i + 1}", r.plan, ARCH[cluster]) for i, r in enumerate(result.top)]
        if result.baseline is not None:
            out.append((f"{job}/megatron", result.baseline.plan, ARCH[cluster]))
    return out


def _gpu(monkeypatch, arch: int) -> None:
    """The GPU architecture validate_args reads: the fixture's get_device_arch_version and
    torch.cuda.get_device_capability (the grouped-GEMM check), on this CPU-only machine."""
    import torch

    monkeypatch.setenv("MOEPLAN_TEST_GPU_ARCH", str(arch))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (arch, 0))
    # a GPU machine has TransformerEngine: TransformerConfig's checks of its version and of the
    # fused RoPE kernel (default on) read as they would there
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_config

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)


def script_argv(plan: Plan, tmp: Path, **env: str) -> list[str]:
    """pretrain_gpt.py's arguments as the exported script passes them: the script run by bash
    with DRY_RUN=1 (it prints the command it would run, quoted for the shell)."""
    script = tmp / "megatron.sh"
    script.write_text(megatron_script(plan, steps=10))
    base = {"PATH": os.environ["PATH"], "MEGATRON_LM": "/opt/Megatron-LM", "DRY_RUN": "1",
            "MASTER_ADDR": "node0", "RDZV_ID": "job1"}
    r = subprocess.run(["bash", str(script), *env.pop("ARGV", "").split()],
                       env={**base, **env}, capture_output=True, text=True, check=True)
    words = shlex.split(r.stdout)
    return words[words.index("/opt/Megatron-LM/pretrain_gpt.py") + 1:]


def run_megatron(plan: Plan, arch: int, arguments, monkeypatch, tmp: Path, **env: str
                 ) -> tuple[object, object]:
    """Parse, validate and build TransformerConfig from the exported script's whole command
    line as pretrain_gpt.py would, in the environment the export sets, on ranks of the plan's
    world size (synthetic data unless ``env`` says otherwise)."""
    args = script_argv(plan, tmp, **(env or {"MOCK_DATA": "1"}))
    user: list[str] = []
    for k, v in megatron_env(plan).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", str(plan.degrees.world))
    monkeypatch.setenv("RANK", "0")
    _gpu(monkeypatch, arch)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args, *user])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = arguments.parse_args()
        arguments.validate_args(parsed)
        config = arguments.core_transformer_config_from_args(parsed)
    return parsed, config


def check_is_the_plan(plan: Plan, parsed, config) -> None:
    """Megatron runs the plan's layout and model, read back from Megatron's own objects."""
    d, m = plan.degrees, plan.model
    cp = d.sp if plan.attention.kind == "ulysses_sp" else d.cp
    assert (parsed.tensor_model_parallel_size, parsed.pipeline_model_parallel_size,
            parsed.context_parallel_size, parsed.data_parallel_size) == (d.tp, d.pp, cp, d.dp)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (
        d.ep, d.etp)
    assert (parsed.virtual_pipeline_model_parallel_size or 1) == d.vpp
    if d.pp > 1:  # the exact per-chunk split, in Megatron's (pp rank, vpp rank) order
        layout = config.pipeline_model_parallel_layout.layout
        chunks = [sum(1 for x in layout[c % d.pp][c // d.pp] if x.name == "decoder")
                  for c in range(d.stages)]
        assert tuple(chunks) == plan.stage_layers
    else:
        assert plan.stage_layers == (m.layers,)
    assert parsed.micro_batch_size == plan.micro_batch_size
    assert parsed.global_batch_size == plan.training.global_batch
    assert parsed.rotary_base == m.rope_theta and config.layernorm_epsilon == m.norm_eps
    assert config.qk_layernorm == m.qk_norm
    assert config.moe_router_pre_softmax == m.router_pre_softmax
    aux = config.moe_aux_loss_coeff
    assert (aux if isinstance(aux, float) else sum(aux)) == m.aux_loss_coeff
    assert config.attention_dropout == config.hidden_dropout == m.dropout
    assert (config.num_moe_experts, config.moe_router_topk) == (m.experts, m.top_k)
    assert config.num_query_groups == m.kv_heads and config.kv_channels == m.head_dim
    assert parsed.train_iters == 10
    recompute = {"none": None, "selective": "selective", "full": "full"}[plan.recompute.value]
    assert config.recompute_granularity == recompute
    if recompute == "selective":  # the plan's selective modules
        assert config.recompute_modules == [m.value for m in plan.recompute_modules]


def test_catalog_exports_pass_megatrons_own_checks(monkeypatch, capsys, tmp_path):
    arguments = _megatron()
    plans = _plans()
    assert len(plans) >= 100
    passed, refused = 0, Counter()
    for label, plan, arch in plans:
        why = megatron_refusal(plan)
        if why is not None:
            with pytest.raises(SpecError, match="--to megatron"):
                megatron_args(plan)
            refused[re.sub(r"\d+", "N", why.split(":")[0])] += 1
            continue
        try:
            parsed, config = run_megatron(plan, arch, arguments, monkeypatch, tmp_path)
        except (AssertionError, ValueError) as e:
            pytest.fail(f"{label} ({plan.summary()}): Megatron rejects the export: {e}")
        check_is_the_plan(plan, parsed, config)
        passed += 1
    with capsys.disabled():
        print(f"\nMegatron sweep: {len(plans)} exports, {passed} pass Megatron's checks, "
              f"{sum(refused.values())} refused: {dict(refused)}")
    assert passed >= 0.8 * len(plans)


def test_the_check_catches_an_export_megatron_rejects(monkeypatch):
    """The harness is not vacuous: a wrong export fails Megatron's own validation."""
    arguments = _megatron()
    plan = _uneven_interleaved()
    args, _ = megatron_args(plan, steps=10)
    i = args.index("--pipeline-model-parallel-layout")
    broken = [*args[:i], *args[i + 2:], "--num-layers-per-virtual-pipeline-stage", "3"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *broken, "--lr", "1e-4", "--mock-data"])
    monkeypatch.setenv("WORLD_SIZE", str(plan.degrees.world))
    _gpu(monkeypatch, 9)
    for k, v in megatron_env(plan).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(AssertionError):
        arguments.validate_args(arguments.parse_args())
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args, "--lr", "1e-4", "--mock-data"])
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        arguments.validate_args(arguments.parse_args())


def _small() -> Plan:
    """A tiny-moe plan with EP all-to-all that Megatron runs."""
    from plans import EPFFN, Degrees, Dispatch, UlyssesAttention

    return Plan(model=catalog.load_model("tiny-moe"), cluster=catalog.load_cluster("h200", gpus=8),
                training=TrainingSpec(global_batch=32, seq_len=512),
                degrees=Degrees(dp=4, sp=2, ep=4), attention=UlyssesAttention(),
                ffn=EPFFN(dispatch=Dispatch.all_to_all), stage_layers=(4,))


def _uneven_interleaved() -> Plan:
    """An interleaved Ulysses plan with an uneven split (9 layers over pp 2 x vpp 2), no EP
    overlap (with it Megatron only warns where CUDA_DEVICE_MAX_CONNECTIONS is unset)."""
    from plans import Degrees, Overlap, PipelineSchedule, UlyssesAttention

    model = catalog.load_model("tiny-moe").model_copy(update={"layers": 9})
    return Plan(model=model, cluster=catalog.load_cluster("h100", gpus=16),
                 training=TrainingSpec(global_batch=16, seq_len=512),
                 degrees=Degrees(pp=2, vpp=2, dp=4, sp=2, ep=4), attention=UlyssesAttention(),
                 stage_layers=(3, 2, 2, 2), schedule=PipelineSchedule.interleaved_1f1b,
                 overlap=Overlap.none)


def _feature_plan(model, pp: int, stage_layers: tuple[int, ...]) -> Plan:
    """A hand-made plan (no search): pp stages, Ulysses 2, EP 8, on 8 GPUs a stage."""
    from plans import EPFFN, Degrees, Overlap, UlyssesAttention

    return Plan(model=model, cluster=catalog.load_cluster("h800", gpus=8 * pp),
                training=TrainingSpec(global_batch=64, seq_len=4096),
                degrees=Degrees(pp=pp, dp=4, sp=2, ep=8), attention=UlyssesAttention(),
                ffn=EPFFN(), stage_layers=stage_layers, micro_batch_size=1,
                overlap=Overlap.none)


HF = Path(__file__).parents[1] / "plans" / "hf_configs"


NO_YARN = {"rope_scaling": None}
"""A model's YaRN dropped, where Megatron-LM's arguments cannot write it
(test_features_megatron_cannot_express_are_refused): the model's other features exported."""


@pytest.mark.parametrize("name,pp,stages", [
    ("deepseek-v3", 4, (16, 15, 15, 15)),
    ("kimi-k2", 2, (31, 30)),
    ("gpt-oss-120b", 2, (18, 18)),
    ("glm-4.5", 4, (23, 23, 23, 23)),
    (str(HF / "deepseek-v2.json"), 1, (60,)),
    (str(HF / "qwen3-30b-a3b.json"), 2, (24, 24)),
])
def test_new_model_features_export_as_megatron_cores_own_flags(name, pp, stages, monkeypatch,
                                                              tmp_path):
    """MLA, sigmoid routing with the expert bias, the routed scaling, group-limited routing,
    MTP (in the last pipeline chunk), dense-first layers, sliding windows with full layers
    between, sinks, biases, partial RoPE and MLA's YaRN, read back from Megatron's
    TransformerConfig."""
    m = catalog.load_model(name)
    if megatron_refusal(_feature_plan(m, pp, stages)):  # GPT attention's or Kimi-K2's YaRN
        m = m.model_copy(update=NO_YARN)
    plan = _feature_plan(m, pp, stages)
    parsed, config = run_megatron(plan, 9, _megatron(), monkeypatch, tmp_path)
    check_is_mla_plan(plan, parsed, config)


def test_the_expert_bias_update_rate_exports_as_megatrons_flag(monkeypatch, tmp_path):
    m = catalog.load_model("deepseek-v3").model_copy(update={"expert_bias_update_rate": 5e-4})
    plan = _feature_plan(m, 4, (16, 15, 15, 15))
    _, config = run_megatron(plan, 9, _megatron(), monkeypatch, tmp_path)
    assert config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 5e-4


def check_is_mla_plan(plan: Plan, parsed, config) -> None:
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    m = plan.model
    assert config.multi_latent_attention == (m.mla is not None)
    if m.mla is not None:
        assert (config.q_lora_rank or 0) == m.mla.q_lora_rank
        assert config.kv_lora_rank == m.mla.kv_lora_rank
        assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
            m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim, m.mla.v_head_dim)
    else:
        assert config.num_query_groups == m.kv_heads and config.kv_channels == m.head_dim
    assert config.moe_router_score_function == m.router_score.value
    assert config.moe_router_enable_expert_bias == m.router_expert_bias
    if m.router_expert_bias:
        assert config.moe_router_bias_update_rate == m.expert_bias_update_rate
    assert (config.moe_router_topk_scaling_factor or 1.0) == m.routed_scaling_factor
    assert (config.moe_router_num_groups or 1) == m.expert_groups
    assert (config.moe_router_group_topk or 1) == m.groups_per_token
    assert (config.mtp_num_layers or 0) == m.mtp_layers
    pattern = config.moe_layer_freq
    pattern = [1] * m.layers if pattern == 1 else list(pattern)
    assert tuple(bool(x) for x in pattern) == m.moe_pattern
    if m.sliding_window:
        assert tuple(config.window_size) == (m.sliding_window - 1, 0)
        assert config.window_attn_skip_freq == (m.full_attention_every or None)
    else:
        assert config.window_size is None
    assert (config.softmax_type == "learnable") == m.attention_sinks
    assert parsed.rotary_percent == m.rotary_fraction
    # GPT-OSS's clamped SwiGLU: Megatron-Core's fused quick-GEGLU, offset 1, clamped
    assert (config.activation_func_clamp_value or 0.0) == m.swiglu_limit
    assert config.glu_linear_offset == (1.0 if m.swiglu_limit else 0.0)
    assert config.activation_func is (quick_gelu if m.swiglu_limit else F.silu)
    assert config.gated_linear_unit and config.bias_activation_fusion
    assert config.add_bias_linear == (m.linear_bias.value == "all")
    assert config.add_qkv_bias == (m.linear_bias.value != "none")
    if plan.degrees.pp > 1:
        layout = config.pipeline_model_parallel_layout.layout
        assert sum(1 for x in layout[-1][-1] if x.name == "mtp") == m.mtp_layers
    assert parsed.rotary_base == m.rope_theta
    # YaRN: MLA's fused kernels (GPT attention's is refused), plain RoPE unfused
    y = m.rope_scaling
    if m.mla is not None:
        assert config.rope_type == ("rope" if y is None else "yarn")
        assert config.apply_rope_fusion == (y is not None)
    if y is not None:
        assert m.mla is not None
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        assert (config.rotary_scaling_factor, config.original_max_position_embeddings,
                config.beta_fast, config.beta_slow) == (
            y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow)
        assert config.mscale == y.mscale and config.mscale_all_dim == y.mscale_all_dim
        assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(
            y.attention_factor)


def test_interleaved_moe_layers_export_their_pattern(monkeypatch, tmp_path):
    maverick = catalog.load_model(str(HF / "llama-4-maverick.json"))
    assert "chunked" in megatron_refusal(_feature_plan(maverick, 2, (24, 24)))
    full = maverick.model_copy(update={"sliding_window": 0, "full_attention_every": 0})
    plan = _feature_plan(full, 2, (24, 24))
    parsed, config = run_megatron(plan, 9, _megatron(), monkeypatch, tmp_path)
    check_is_mla_plan(plan, parsed, config)
    assert list(config.moe_layer_freq)[:4] == [0, 1, 0, 1]


@pytest.mark.parametrize("config,why", [
    ("qwen2-57b-a14b", "model.shared_expert_gate"),
    ("hunyuan-large", "model.kv_share_layers"),
    ("gpt-oss-120b", "model.rope_scaling: Megatron-LM's arguments cannot express YaRN"),
    ("kimi-k2", "model.rope_scaling.beta_fast 1.0: Megatron-LM's arguments have no flag"),
])
def test_features_megatron_cannot_express_are_refused(config, why):
    m = catalog.load_model(str(HF / f"{config}.json"))
    plan = _feature_plan(m, 1, (m.layers,))
    assert megatron_refusal(plan).startswith(why)
    with pytest.raises(SpecError, match=f"--to megatron: {why}"):
        megatron_args(plan)


@pytest.mark.parametrize("name,pp,stages,modules", [
    ("deepseek-v3", 4, (16, 15, 15, 15), ("mla_up_proj", "moe_act")),
    ("qwen3-30b-a3b", 2, (24, 24), ("layernorm", "moe_act", "core_attn")),
    ("deepseekmoe", 2, (14, 14), ("mlp", "shared_experts", "moe")),
])
def test_recompute_modules_export_as_megatrons_selective_recomputation(
        name, pp, stages, modules, monkeypatch, tmp_path):
    """Plan.recompute_modules exports as --recompute-granularity selective
    --recompute-modules, read back from Megatron's own TransformerConfig."""
    from plans import Recompute, RecomputeModule, Target

    plan = _feature_plan(catalog.load_model(name), pp, stages).model_copy(update={
        "target": Target.megatron, "recompute": Recompute.selective,
        "recompute_modules": tuple(RecomputeModule(m) for m in modules)})
    plan = Plan.model_validate(plan.model_dump())
    parsed, config = run_megatron(plan, 9, _megatron(), monkeypatch, tmp_path)
    assert config.recompute_granularity == "selective"
    assert list(config.recompute_modules) == list(modules)


def test_bf16_moments_export_as_the_precision_aware_optimizer(monkeypatch, tmp_path):
    """Plan.optimizer_moments bf16 exports as --use-precision-aware-optimizer with bf16
    moments, read back from Megatron's parsed arguments."""
    import torch

    from plans import Precision, Target

    plan = _feature_plan(catalog.load_model("qwen3-30b-a3b"), 2, (24, 24)).model_copy(
        update={"target": Target.megatron, "optimizer_moments": Precision.bf16})
    parsed, _ = run_megatron(Plan.model_validate(plan.model_dump()), 9, _megatron(),
                             monkeypatch, tmp_path)
    assert parsed.use_precision_aware_optimizer and parsed.use_distributed_optimizer
    assert parsed.exp_avg_dtype == parsed.exp_avg_sq_dtype == torch.bfloat16
    assert parsed.main_params_dtype == torch.float32
