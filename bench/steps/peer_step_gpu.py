"""Whole training steps on one GPU: our runtime's searched plan against torchtitan 0.3.0's own
model and step (and Megatron-Core's where it is installed), same shape, tokens and batch.

    python -m bench.steps.peer_step_gpu --models qwen3-30b-a3b --out $OUT/peer_step_qwen3.json
    python -m bench.steps.peer_step_gpu --tiny --out /tmp/peer_tiny.json       (CPU, tiny shapes)

Per model (``MODELS``: the reduced-depth 1-GPU plans ``moeplan search --runnable`` picked,
bench/gpu_plans/searched/; global batch 8 x 4,096, micro-batch 8; with ``--plans capped``
ours are the plans it picks under ``--memory-cap`` torchtitan's measured peak with its blocks
compiled, bench/gpu_plans/peer_capped/ by bench.steps.peer_plans (a model with none there is
recorded as skipped), while torchtitan keeps the searched plan's micro-batches):

- ours: bench/train_step.measure on the plan (the runtime's trainer: the plan's kernels,
  recompute, cross-entropy and ZeRO-1 AdamW; bf16 parameters with fp32 masters);
- torchtitan: its decoder (``torchtitan.models.qwen3``'s MoE transformer block: GQA with
  fused QKV, RMSNorm, RoPE, its MoE with the grouped experts and the local token dispatcher)
  configured to the plan's model spec (hidden, heads, kv heads, head dim, expert FFN, experts,
  top-k, vocab, depth; qk-norm only where the spec has it; the router's score as the spec's:
  softmax over the top-k (renormalised) or softmax over every expert then top-k), initialised
  by its own ``init_weights``; its step as torchtitan.trainer runs it on one rank: activation
  checkpointing as its MoE recipe's (``PEER_RECIPES``), per-block compile as
  ``--peer-compile`` says (``recipe``: the recipe's), fp32 weights under bf16 autocast (its
  FSDP2 mixed precision needs a device mesh; one GPU runs autocast), SDPA attention (causal, one
  document per row), its recipes' loss (ChunkedLossWrapper over CrossEntropyLoss: the LM
  head and cross-entropy per sequence chunk, the sum over the step's tokens divided by their
  count), gradient clipping at its default max-norm 1.0, its default AdamW (lr 8e-4, betas
  0.9 / 0.95, eps 1e-8, weight decay 0.1); no load-balance bias (``load_balance_coeff``
  None);
- Megatron-Core: recorded as not installed or not run (``megatron_status``).

Both see the same token batches: runtime.data.SyntheticTokens seeded with ``--seed`` (one
stream, batch ``step`` at step ``step``). Parameter counts of both models are counted and
must agree within ``PARAM_TOLERANCE``. Timing: ``--warmup`` steps (the first reported apart),
then ``--steps`` timed steps, each ended by a synchronise (ours: the trainer's step time);
peak memory is torch.cuda.max_memory_allocated over the timed steps; MFU by plans.specs.mfu
on the plan's model spec for both. The result, rewritten after each model so that one model
failing keeps the others', holds per model both sides' numbers or the reason one did not run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from bench._dist_bench import init, release, step_times
from bench._meta import package_version, write_result
from bench.steps import train_step  # configures the allocator before CUDA allocates
from plans import Plan, SpecError
from plans.catalog import load_plan
from plans.execution import UnsupportedFeature
from runtime.compile_cache import use_cache_dir
from runtime.config import ModelConfig
from runtime.data import SyntheticTokens
from runtime.memory import GIB
from runtime.model import Transformer
from runtime.parallel.parallelize import check_supported, launch_backend
from runtime.trainer import model_options

PLANS = Path(__file__).resolve().parents[1] / "gpu_plans" / "searched"
MODELS = {
    "qwen3-30b-a3b": PLANS / "qwen4l_1gpu.json",
    "mixtral-8x7b": PLANS / "mixtral2l_1gpu.json",
    "deepseekmoe": PLANS / "deepseek4l_1gpu.json",
    "deepseek-v3": None,  # reduced depth of the catalog's DeepSeek-V3 (MLA), built here
}
GPU_PLANS = Path(__file__).resolve().parents[1] / "gpu_plans"
PLAN_SETS = {
    "searched": MODELS,
    # the same jobs searched under --memory-cap torchtitan's measured peak, its blocks compiled
    # (bench.steps.peer_plans; a job with no plan under it has no file)
    **{name: {**MODELS, "qwen3-30b-a3b": GPU_PLANS / folder / "qwen4l_1gpu.json",
              "mixtral-8x7b": GPU_PLANS / folder / "mixtral2l_1gpu.json",
              "deepseekmoe": GPU_PLANS / folder / "deepseek4l_1gpu.json"}
       for name, folder in (("capped", "peer_capped"), ("capped_h100", "peer_capped_h100"))},
}
"""Our plans per ``--plans``: the searched plans, or those held to torchtitan's memory, priced
on the H200 (capped) or the H100 (capped_h100) calibrated cluster."""
DEFAULT_MODELS = ["qwen3-30b-a3b", "mixtral-8x7b", "deepseekmoe", "deepseek-v3"]
DEEPSEEK_V3_LAYERS = 4

PEER_RECIPES = {
    # torchtitan.models.qwen3.config_registry.qwen3_30b_a3b: FullAC, compile off
    "qwen3-30b-a3b": ("full", "off"),
    # no torchtitan Mixtral recipe: its other MoE decoder recipe (Qwen3-30B-A3B) is used
    "mixtral-8x7b": ("full", "off"),
    # torchtitan.models.deepseek_v3.config_registry (16B / 671B): SelectiveAC, compile of the
    # loss only (the model uncompiled)
    "deepseekmoe": ("selective", "off"),
}
"""Per model, torchtitan's MoE recipe's activation checkpointing and model compile."""

PARAM_TOLERANCE = 0.005
"""The two models' parameter counts agree within 0.5%."""

PEER_MAX_NORM = 1.0
"""torchtitan's training.max_norm default: gradients clipped to this global norm."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON result")
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing (the first "
                   "reported apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-compile", choices=["recipe", "off", "model"], default="recipe",
                   help="torchtitan's compile (model: each transformer block, fullgraph)")
    p.add_argument("--plans", choices=list(PLAN_SETS), default="searched",
                   help="our plans: searched (bench/gpu_plans/searched/) or capped, searched "
                   "under --memory-cap torchtitan's compiled peak (bench/gpu_plans/peer_capped/; "
                   "capped_h100: priced on h100-runtime, bench/gpu_plans/peer_capped_h100/)")
    p.add_argument("--compile-cache", type=Path,
                   help="folder of torch.compile's caches (runtime.compile_cache; default: "
                   "TORCHINDUCTOR_CACHE_DIR, else the user's cache folder): a later launch of "
                   "the same plan over it is a relaunch")
    p.add_argument("--no-ours", action="store_true", help="time torchtitan's step only")
    p.add_argument("--no-peer", action="store_true", help="time our step only")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (hidden 64, 2 layers, 2 x 32 tokens) for a CPU run")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step is reported apart)")
    return args


# ---- the plans --------------------------------------------------------------------------------


def tiny(plan: Plan) -> Plan:
    """``plan`` at tiny widths, 2 layers, 2 sequences of 32 tokens, kernels and precision a CPU
    runs: the same structure (GQA ratio, routing, qk-norm) for a smoke run."""
    m = plan.model
    heads = 4
    data = plan.model_dump()
    data["model"].update(
        layers=2, hidden=64, query_heads=heads, kv_heads=max(1, heads * m.kv_heads
                                                             // m.query_heads),
        head_dim=16, vocab=256, expert_ffn_hidden=32, experts=min(m.experts, 8),
        top_k=min(m.top_k, 2))
    data["training"].update(global_batch=2, seq_len=32)
    data.update(stage_layers=[2], micro_batch_size=2, prediction=None)
    return Plan.model_validate(data)


def deepseek_v3_plan(template: Plan) -> Plan:
    """The catalog's DeepSeek-V3 at DEEPSEEK_V3_LAYERS layers (its dense layers kept up to one)
    in ``template``'s 1-GPU layout, without its MTP module and its YaRN (plain RoPE angles:
    both refused by our runtime; YaRN changes no kernel of MLA's)."""
    from plans.catalog import load_model

    model = load_model("deepseek-v3").model_dump()
    model.update(name=f"DeepSeek-V3-{DEEPSEEK_V3_LAYERS}L", layers=DEEPSEEK_V3_LAYERS,
                 dense_layers=min(1, model["dense_layers"]), mtp_layers=0, rope_scaling=None)
    data = template.model_dump()
    data.update(model=model, stage_layers=[DEEPSEEK_V3_LAYERS], prediction=None)
    return Plan.model_validate(data)


def plan_of(name: str, args, plans: str | None = None) -> Plan:
    """The model's plan of set ``plans`` (default ``--plans``), refused first at full size
    where our runtime cannot run it (so a model our runtime refuses is refused for that reason
    in --tiny runs too)."""
    path = PLAN_SETS[plans or args.plans][name]
    plan = (deepseek_v3_plan(load_plan(MODELS["qwen3-30b-a3b"])) if path is None
            else load_plan(path))
    check_supported(plan, launch_backend())
    return tiny(plan) if args.tiny else plan


def params(build) -> int:
    """Parameters of the model ``build()`` makes, built on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


# ---- torchtitan -------------------------------------------------------------------------------


def _qwen3_model():
    """torchtitan's ``torchtitan.models.qwen3.model`` module, loaded without its package's
    ``__init__``: that imports the FSDP parallelisation, which needs
    ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.12 on; the H200 machine has 2.11),
    and a one-GPU step uses neither. The module itself imports absolute names only."""
    import importlib.util

    import torchtitan.models

    name = "torchtitan.models.qwen3.model"
    if name not in sys.modules:
        path = Path(torchtitan.models.__file__).parent / "qwen3" / "model.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def peer_config(plan: Plan):
    """torchtitan's Qwen3Model.Config at ``plan``'s model spec (GQA models only)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.nn_modules import RMSNorm
    qwen3 = _qwen3_model()
    Qwen3Model, Qwen3TransformerBlock = qwen3.Qwen3Model, qwen3.Qwen3TransformerBlock

    m = plan.model
    if m.mla is not None or m.shared_experts or m.dense_layers or m.tied_embeddings:
        raise SpecError(f"model {m.name}: the peer builds GQA MoE decoders without shared "
                        "experts, dense layers or tied embeddings")
    std = 0.02
    linear = {"weight": lambda t: torch.nn.init.normal_(t, std=std),
              "bias": torch.nn.init.zeros_}
    residual = {"weight": lambda t: torch.nn.init.normal_(t, std=std / (2 * m.layers) ** 0.5),
                "bias": torch.nn.init.zeros_}
    experts = {"w1_EFD": linear["weight"], "w3_EFD": linear["weight"],
               "w2_EDF": residual["weight"]}

    def norm(dim: int):
        return RMSNorm.Config(normalized_shape=dim, eps=m.norm_eps,
                              param_init={"weight": torch.nn.init.ones_})

    rope = CosSinRoPE.Config(dim=m.head_dim, max_seq_len=plan.training.seq_len,
                             theta=m.rope_theta)
    # router_pre_softmax: softmax over every expert, then top-k (weights not renormalised);
    # otherwise top-k of the logits, softmax over those k (= softmax then renormalise)
    route_norm = not m.router_pre_softmax
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(m.hidden), ffn_norm=norm(m.hidden),
            attention=make_gqa_config(
                dim=m.hidden, n_heads=m.query_heads, n_kv_heads=m.kv_heads,
                head_dim=m.head_dim, wqkv_param_init=linear, wo_param_init=residual,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope,
                qk_norm=norm(m.head_dim) if m.qk_norm else None),
            moe=make_moe_config(
                num_experts=m.experts,
                router=make_router_config(dim=m.hidden, num_experts=m.experts,
                                          gate_param_init=linear, top_k=m.top_k,
                                          score_func="softmax", route_norm=route_norm),
                routed_experts=make_routed_experts_config(
                    dim=m.hidden, hidden_dim=m.expert_ffn_hidden, num_experts=m.experts,
                    top_k=m.top_k, param_init=experts, comm_backend="standard"),
                load_balance_coeff=None))
        for _ in range(m.layers)]
    return Qwen3Model.Config(
        vocab_size=m.vocab, dim=m.hidden, norm=norm(m.hidden),
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab, embedding_dim=m.hidden,
                                        param_init={"weight": linear["weight"]}),
        lm_head=Linear.Config(in_features=m.hidden, out_features=m.vocab, param_init=linear),
        layers=layers)


def peer_settings(name: str, args) -> dict:
    ac, compile_ = PEER_RECIPES.get(name, ("full", "off"))
    return {"ac": ac,
            "compile": compile_ if args.peer_compile == "recipe" else args.peer_compile,
            "recipe": {"ac": ac, "compile": compile_},
            "attention": "sdpa (causal)", "precision": "fp32 weights, bf16 autocast",
            "loss": "ChunkedLossWrapper(CrossEntropyLoss), 8 chunks",
            "optimizer": "AdamW lr 8e-4 betas (0.9, 0.95) eps 1e-8 weight_decay 0.1",
            "max_norm": PEER_MAX_NORM, "load_balance_coeff": None}


def build_peer(plan: Plan, settings: dict, device: torch.device):
    """(model, optimizer) as torchtitan.trainer builds them on one rank: meta build, AC, then
    per-block compile, then to_empty and init_weights, then AdamW."""
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile

    with torch.device("meta"):
        model = peer_config(plan).build()
    ac = {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(settings["ac"])
    if ac is not None:
        ac().build(dump_folder="").apply(model)
    if settings["compile"] == "model":
        apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"]),
                      parallel_dims=ParallelDims.from_config(ParallelismConfig(), world_size=1))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=device.type == "cuda")
    return model, opt


def peer_loss(model, plan: Plan):
    """torchtitan's loss as its MoE recipes build it: ChunkedLossWrapper over CrossEntropyLoss
    (sum over the tokens divided by the step's valid tokens), the LM head applied per chunk."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    loss_fn = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=plan.model.vocab)).build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return loss_fn


def peer_step(model, opt, loss_fn, plan: Plan, data: SyntheticTokens, step: int,
              device: torch.device) -> tuple[float, float]:
    """One torchtitan training step (torchtitan.trainer's forward_backward_step per
    micro-batch, then clipping and the optimizer) on ``data.batch(step)``: (loss, seconds)."""
    t0 = time.perf_counter()
    batch = data.batch(step).to(device, non_blocking=True)
    micro = plan.micro_batch_size
    valid = torch.tensor(float(batch[:, 1:].numel()), device=device)
    opt.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i in range(batch.shape[0] // micro):
        rows = batch[i * micro:(i + 1) * micro]
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = loss_fn(model(rows[:, :-1]), rows[:, 1:], valid)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), PEER_MAX_NORM, foreach=True)
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    loss = float(total)
    return loss, time.perf_counter() - t0


def measure_peer(plan: Plan, settings: dict, device: torch.device, args) -> dict:
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    model, opt = build_peer(plan, settings, device)
    loss_fn = peer_loss(model, plan)
    warm = [peer_step(model, opt, loss_fn, plan, data, s, device) for s in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = [peer_step(model, opt, loss_fn, plan, data, s, device)
             for s in range(args.warmup, args.warmup + args.steps)]
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    del model, opt
    return {
        "status": "ok", "version": package_version("torchtitan"), "settings": settings,
        **step_times([s for _, s in warm], [s for _, s in timed], plan, 1),
        "peak_memory_gib": peak,
        "warmup_losses": [loss for loss, _ in warm], "losses": [loss for loss, _ in timed],
    }


# ---- Megatron-Core ----------------------------------------------------------------------------


def megatron_status() -> dict:
    """Megatron-Core's step: whether it can be imported here (its whole-step run is not built
    by this script)."""
    v = package_version("megatron-core")
    if v is None:
        return {"status": "not installed"}
    return {"status": "not run", "version": v,
            "reason": "a Megatron-Core whole step is not built by this script"}


# ---- one model --------------------------------------------------------------------------------


def _failure(exc: BaseException) -> dict:
    traceback.print_exc()
    return {"status": "failed",
            "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def _release(device: torch.device) -> None:
    release(device)
    torch._dynamo.reset()


def run_model(name: str, args, device: torch.device) -> dict:
    path = PLAN_SETS[args.plans][name]
    if path is not None and not path.exists():  # bench.steps.peer_plans: none fit the cap
        return {"status": "skipped", "plans": args.plans,
                "reason": f"no plan of set {args.plans}: {path.name} absent (no plan fits "
                          "under the cap, bench.steps.peer_plans)"}
    try:
        plan = plan_of(name, args)
        # torchtitan runs the job as measured: the searched plan's micro-batches, whichever
        # plan of ours runs it
        peer_plan = plan_of(name, args, "searched")
    except (SpecError, UnsupportedFeature, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        return {"status": "skipped", "reason": f"our runtime refuses the model: {reason}"}
    t = plan.training
    row: dict = {"plan": str(path) if path else "built: deepseek_v3_plan", "plans": args.plans,
                 "plan_summary": plan.summary(), "model_spec": plan.model.model_dump(),
                 "global_batch": t.global_batch, "seq_len": t.seq_len,
                 "micro_batch_size": plan.micro_batch_size,
                 "peer_micro_batch_size": peer_plan.micro_batch_size, "seed": args.seed,
                 "tokens": "runtime.data.SyntheticTokens(global_batch, seq_len, vocab, seed)"}
    ours_n = params(lambda: Transformer(ModelConfig(plan.model, model_options(plan))))
    row["params"] = {"ours": ours_n}
    if not args.no_peer:
        try:
            peer_n = params(peer_config(peer_plan).build)
        except Exception as e:  # noqa: BLE001  (a third-party model that cannot be built)
            row["peer"] = _failure(e)
        else:
            row["params"]["torchtitan"] = peer_n
            gap = abs(peer_n - ours_n) / ours_n
            row["params"]["relative_gap"] = gap
            if gap > PARAM_TOLERANCE:
                row["peer"] = {"status": "failed",
                               "reason": f"parameter counts differ by {gap:.2%} (ours "
                                         f"{ours_n:,}, torchtitan {peer_n:,})"}
    if args.no_ours:
        row["ours"] = {"status": "skipped", "reason": "--no-ours"}
    else:
        try:
            res = train_step.measure(plan, Path(row["plan"]), 0, 1, device, args.steps,
                                     args.warmup, args.seed)
            row["ours"] = {"status": "ok", **{k: res[k] for k in (
                "first_step_s", "warmup_step_times_s", "step_time_s", "step_times_s",
                "step_median_s", "tokens_per_s", "mfu", "losses", "compiled_graphs",
                "host_syncs_per_rank", "deviations")},
                "peak_memory_gib": res["peak_memory_gib_per_rank"][0]}
        except Exception as e:  # noqa: BLE001  (recorded; the peer and other models still run)
            row["ours"] = _failure(e)
        _release(device)
    if args.no_peer:
        row["peer"] = {"status": "skipped", "reason": "--no-peer"}
    elif "peer" not in row:
        try:
            row["peer"] = measure_peer(peer_plan, peer_settings(name, args), device, args)
        except Exception as e:  # noqa: BLE001
            row["peer"] = _failure(e)
        _release(device)
    row["megatron_core"] = megatron_status()
    ours, peer = row["ours"], row["peer"]
    if ours.get("status") == "ok" and peer.get("status") == "ok":
        row["speedup_vs_torchtitan"] = peer["step_time_s"] / ours["step_time_s"]
        if device.type == "cuda":
            row["memory_ratio_vs_torchtitan"] = ours["peak_memory_gib"] / peer["peak_memory_gib"]
    return row


def summary_line(name: str, row: dict) -> str:
    parts = [name]
    for side in ("ours", "peer"):
        r = row.get(side, {})
        if r.get("status") == "ok":
            mem = (f" {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None
                   else "")
            parts.append(f"{side} {r['step_time_s'] * 1e3:.1f} ms MFU {r['mfu']:.1%}{mem} "
                         f"first {r['first_step_s']:.1f} s")
        else:
            parts.append(f"{side} {r.get('status', row.get('status'))}")
    if "speedup_vs_torchtitan" in row:
        parts.append(f"ratio {row['speedup_vs_torchtitan']:.2f}x")
    return " | ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    cache = use_cache_dir(args.compile_cache)  # before anything compiles
    _, _, device, _ = init()
    result = {
        "benchmark": "whole training step on one GPU: our searched plan against torchtitan's "
                     "model and step (same shape, tokens, batch)",
        "device": str(device), "tiny": args.tiny, "warmup": args.warmup, "steps": args.steps,
        "plans": args.plans, "compile_cache": str(cache),
        "wheels": {p: package_version(p) for p in ("torchtitan", "spmd_types", "tyro",
                                            "typeguard", "docstring-parser",
                                            "torch_checkpointing", "megatron-core")},
        "models": {},
    }
    for name in args.models:
        try:
            row = run_model(name, args, device)
        except Exception as e:  # noqa: BLE001  (one model's failure keeps the others')
            row = _failure(e)
        result["models"][name] = row
        print(summary_line(name, row), flush=True)
        write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
