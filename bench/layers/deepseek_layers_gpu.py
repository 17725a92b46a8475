"""A DeepSeek-V3 layer on one GPU at full width, as the runtime runs it, against the cost model:
the MLA attention block and the MoE FFN block, forward + backward.

    python -m bench.layers.deepseek_layers_gpu --out $OUT/deepseek_v3_layers.json
    python -m bench.layers.deepseek_layers_gpu --tiny --out /tmp/x.json   (CPU smoke test)

The plan is the catalog's DeepSeek-V3 cut to one MoE layer (no dense layers, no MTP module):
hidden 7168; MLA with 128 heads, q_lora_rank 1536, kv_lora_rank 512, no-RoPE 128 and RoPE 64
query / key head dims, value head dim 128; 256 routed experts of 2048 with top-8 sigmoid routing
over 8 groups (4 per token), the expert bias and the routed scaling factor 2.5, 1 shared
expert of 2048; ``--batch`` sequences of ``--seq`` tokens (default 1 x 4,096), one GPU (no
parallelism), overlap none, no recomputation, for each kernel set (``--kernels``). The
runtime builds and parallelises the one-layer model from the plan (bench/layers/one_layer.
build_block); the blocks are x + attention(attention_norm(x)) and x + moe(ffn_norm(x)).

``predicted`` is the cost model's time of the same blocks for the same plan (``--cluster``,
default the fitted ``h200-runtime``): the layer graph's operators up to the attention residual
(the attention block) and after it (the FFN block), forward and backward, scheduled as the
plan's overlap runs them (bench/layers/one_layer.predicted_blocks); ``ratio`` is measured over
predicted. Timing: CUDA events (wall clock on CPU), median after warm-up. bf16 on CUDA, fp32 on
CPU. ``--tiny`` shrinks every width (and the sequence) so the script runs on a CPU in seconds.

Each row also carries where the time goes, both sides: ``predicted_operators_s`` (the cost
model's forward + backward seconds of each layer operator of the block, unscheduled) and, from
one more run under torch.profiler, ``measured_classes_s`` (device seconds per kernel class,
runtime.profile.classify; top-level CPU operators on CPU) and ``measured_kernels`` (the
slowest kernels: which SDPA backend ran shows in their names). The MoE row also carries
``rows_per_expert``: the router's slots per expert for the bench's input (what the grouped
GEMMs ran on; the cost model prices the balanced mean).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench._dist_bench import init, release, timed
from bench._meta import write_result
from bench.layers.one_layer import BLOCKS, block_step, build_block, layer_plan, predicted_blocks
from plans import Kernels, Plan, catalog
from plans.specs import ModelSpec
from runtime.profile import classify, kernel_times

ONE_LAYER = {"layers": 1, "dense_layers": 0, "dense_ffn_hidden": 0, "mtp_layers": 0}
TINY = {"hidden": 64, "query_heads": 4, "kv_heads": 4, "head_dim": 12, "vocab": 256,
        "mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4, "v_head_dim": 8},
        "experts": 16, "expert_ffn_hidden": 32, "shared_expert_ffn_hidden": 32,
        "expert_groups": 4, "groups_per_token": 2, "top_k": 4}
"""--tiny: DeepSeek-V3's structure at CPU size."""
TOP_KERNELS = 12
"""Kernels listed per block in ``measured_kernels``."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON result")
    p.add_argument("--cluster", default="h200-runtime",
                   help="catalog cluster of the plan (the cost model's prediction)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--kernels", nargs="+", default=[k.value for k in Kernels],
                   choices=[k.value for k in Kernels])
    p.add_argument("--tiny", action="store_true", help="CPU-sized widths (smoke test)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.warmup, args.repeats = min(args.seq, 64), 1, 2
    return args


def model_spec(tiny: bool) -> ModelSpec:
    v3 = catalog.load_model("deepseek-v3")
    update = {**ONE_LAYER, **(TINY if tiny else {})}
    return ModelSpec.model_validate({**v3.model_dump(), **update})


def predict(plan: Plan) -> dict[str, float | dict[str, float]]:
    """Seconds of each block, forward + backward, each pass scheduled as ``plan.overlap`` runs
    it (``{block}_s``; bench/layers/one_layer.predicted_blocks); beside it each operator's
    forward + backward seconds, unscheduled (``{block}_operators_s``)."""
    out = {}
    for block, (seconds, ops) in predicted_blocks(plan).items():
        out[f"{block}_s"] = seconds
        per_op: dict[str, float] = {}
        for op in ops:
            per_op[op.operator.value] = per_op.get(op.operator.value, 0.0) + op.duration_s
        out[f"{block}_operators_s"] = per_op
    return out


def measure(layer, block: str, x: torch.Tensor, grad: torch.Tensor, device, args
            ) -> tuple[float, dict[str, float], list[dict]]:
    """The block's median seconds (bench._dist_bench.timed), then one more run under
    torch.profiler: seconds per kernel class and the slowest kernels."""
    run = block_step(layer, block, x, grad)
    seconds = timed(run, device, args.warmup, args.repeats)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    kernels = kernel_times(prof, cuda)
    classes: dict[str, float] = {}
    for name, (_, s) in kernels.items():
        classes[classify(name)] = classes.get(classify(name), 0.0) + s
    slowest = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    for p in layer.parameters():
        p.grad = None
    return (seconds, dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            [{"name": n[:160], "class": classify(n), "calls": c, "s": s}
             for n, (c, s) in slowest])


def rows_per_expert(layer, x: torch.Tensor) -> list[int]:
    """The slots the MoE block's router gives each expert for ``x`` (one forward of the norm
    and the router, no gradient)."""
    with torch.no_grad():
        tokens = layer.ffn_norm(x).reshape(-1, x.shape[-1])
        routing = layer.moe.router(tokens)
        layer.moe.router.take_load()  # this forward is no step's: its load is not kept
    kept = routing.indices[routing.indices >= 0]
    return torch.bincount(kept, minlength=layer.moe.router.experts).tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    _, _, device, dtype = init()
    model = model_spec(args.tiny)
    rows = []
    for kernels in map(Kernels, args.kernels):
        plan = layer_plan(model, args, 1, kernels)
        layer = build_block(plan, 0, 1, device, dtype, args.seed)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        shape = (args.batch, args.seq, model.hidden)
        x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        predicted = predict(plan)
        for block in BLOCKS:
            measured, classes, slowest = measure(layer, block, x, grad, device, args)
            rows.append({"block": block, "kernels": kernels.value,
                         "measured_fwd_bwd_s": measured,
                         "predicted_fwd_bwd_s": predicted[f"{block}_s"],
                         "ratio": measured / predicted[f"{block}_s"],
                         "predicted_operators_s": predicted[f"{block}_operators_s"],
                         "measured_classes_s": classes,
                         "measured_kernels": slowest})
            if block == "moe":
                rows[-1]["rows_per_expert"] = rows_per_expert(layer, x)
            print(f"{block:9s} {kernels.value:5s} measured {measured * 1e3:9.3f} ms  "
                  f"predicted {predicted[f'{block}_s'] * 1e3:9.3f} ms  "
                  f"ratio {rows[-1]['ratio']:.3f}")
        del layer
        release(device)
    result = {
        "bench": "deepseek_layers_gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cluster": args.cluster,
        "tiny": args.tiny,
        "model": model.model_dump(mode="json"),
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
