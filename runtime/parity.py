"""Correctness of a parallel layout against the single-process reference: loss and every
gradient after one step (before the optimizer), as relative errors: does the layout compute
what one GPU computes.

    moeplan parity PLAN --out parity.json
    (or: torchrun --standalone --nproc-per-node N -m runtime.parity --plan PLAN --out parity.json,
    N the plan's GPU count)

A gradient's error is ||g - g_ref|| / ||g_ref|| over this rank's slice (the reference sliced
the same way); each rank reruns the reference itself and compares its own slices, so only a
few numbers cross ranks.

On CPU (gloo) both runs are fp32 and must agree as the CPU parity tests ask: loss 1e-5,
gradients 1e-4. On CUDA the layout runs in bf16, and bf16 alone already moves gradients by
percents (8 mantissa bits; near-tied top-k choices flip under any change of rounding, and the
router's gradient is a sum with heavy cancellation), so a fixed bf16 tolerance either passes
everything or fails sound layouts. The check is relative to bf16 itself: the reference is run
twice, in bf16 and in fp32, and every gradient (and the loss) of the layout must be as close to
fp32 as the single-GPU bf16 run is: err(layout, fp32) <= 2 x err(bf16 reference, fp32) + 1e-3.
The direct layout-vs-bf16-reference errors are reported too. Rank 0 writes JSON with metadata,
the errors, the worst parameters and ``pass``; exit status 1 when the check fails. Bad input:
one line naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plans import OptimizerSharding
from runtime.data import SyntheticTokens
from runtime.measure import EXIT_BAD_INPUT, finish, init, launch_plan, release, write_measurement
from runtime.trainer import build_trainer, model_options, reference_plan

TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for a late rank."""
FP32_TOLERANCE = {"loss": 1e-5, "grad": 1e-4}
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3
"""bf16: err(layout, fp32 reference) <= BF16_FACTOR x err(bf16 reference, fp32) + BF16_FLOOR."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _reference(plan, device, seed, data, options, dtype):
    """Loss and fp32 gradients of the one-process reference with parameters in ``dtype``."""
    ref = build_trainer(reference_plan(plan), 0, 1, device, seed, data, options,
                        param_dtype=dtype)
    loss = ref.forward_backward(0)
    ref.sync_gradients()
    grads = {k: g for k, (g, _) in ref.local_gradients().items()}
    del ref
    release(device)  # ranks sharing a GPU need room for the reference in turn
    return loss, grads


def _compare(loss, grads, plan, device, seed, data, options, bf16: bool) -> dict:
    """This rank's errors: against the reference in the layout's dtype, and (bf16 on CUDA)
    the layout's and the bf16 reference's errors against the fp32 reference."""
    def mine(g: dict, name: str, shard) -> torch.Tensor:
        return shard.take(g[name]) if shard else g[name]

    ref_loss, ref = _reference(plan, device, seed, data, options,
                               torch.bfloat16 if bf16 else torch.float32)
    out = {"names": set(ref), "loss": loss, "ref_loss": ref_loss,
           "direct": {n: _rel(g, mine(ref, n, s)) for n, (g, s) in grads.items()},
           "direct_loss": abs(loss - ref_loss) / abs(ref_loss)}
    if bf16:
        ref = {n: mine(ref, n, s) for n, (_, s) in grads.items()}  # keep our slices only
        loss32, ref32 = _reference(plan, device, seed, data, options, torch.float32)
        out["layout_vs_fp32"] = {n: _rel(g, mine(ref32, n, s)) for n, (g, s) in grads.items()}
        out["bf16_vs_fp32"] = {n: _rel(ref[n], mine(ref32, n, s)) for n, (_, s) in grads.items()}
        out["loss_layout_vs_fp32"] = abs(loss - loss32) / abs(loss32)
        out["loss_bf16_vs_fp32"] = abs(ref_loss - loss32) / abs(loss32)
    return out


def _verdict(parts: list[dict], bf16: bool) -> dict:
    """Merge the ranks' errors (max per parameter) and judge them."""
    def merged(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for part in parts:
            for name, err in part[key].items():
                out[name] = max(out.get(name, 0.0), err)
        return out

    direct = merged("direct")
    missing = sorted(parts[0]["names"] - set(direct))
    result = {
        "loss": parts[0]["loss"], "reference_loss": parts[0]["ref_loss"],
        "loss_rel_err": max(p["direct_loss"] for p in parts),
        "grad_max_rel_err": max(direct.values()),
        "worst_grads": dict(sorted(direct.items(), key=lambda kv: -kv[1])[:5]),
        "params_without_grad": missing,
    }
    if not bf16:
        ok = (result["loss_rel_err"] < FP32_TOLERANCE["loss"]
              and result["grad_max_rel_err"] < FP32_TOLERANCE["grad"])
        return {**result, "criterion": {"fp32": FP32_TOLERANCE}, "pass": ok and not missing}
    layout, ref = merged("layout_vs_fp32"), merged("bf16_vs_fp32")
    limit = {n: BF16_FACTOR * ref[n] + BF16_FLOOR for n in layout}
    failed = sorted(n for n in layout if layout[n] > limit[n])
    loss_layout = max(p["loss_layout_vs_fp32"] for p in parts)
    loss_ref = max(p["loss_bf16_vs_fp32"] for p in parts)
    loss_ok = loss_layout <= BF16_FACTOR * loss_ref + BF16_FLOOR
    # the worst parameters by the margin they leave: layout error over its limit
    ratio = {n: layout[n] / limit[n] for n in layout}
    worst = sorted(ratio, key=lambda n: -ratio[n])[:5]
    return {
        **result,
        "criterion": {"bf16": f"err(layout, fp32) <= {BF16_FACTOR} x err(bf16 reference, "
                              f"fp32) + {BF16_FLOOR}, per gradient and for the loss"},
        "loss_layout_vs_fp32": loss_layout, "loss_bf16_reference_vs_fp32": loss_ref,
        "grad_max_layout_vs_fp32": max(layout.values()),
        "grad_max_bf16_reference_vs_fp32": max(ref.values()),
        "closest_to_limit": {n: {"layout_vs_fp32": layout[n], "bf16_reference_vs_fp32": ref[n],
                                 "share_of_limit": ratio[n]} for n in worst},
        "failed": failed,
        "pass": loss_ok and not failed and not missing,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share-gpu", action="store_true",
                   help="ranks share the visible GPUs over gloo (more ranks than GPUs)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    plan = launch_plan(args.plan, args.out, args.force, args.share_gpu)
    if plan is None:
        return EXIT_BAD_INPUT
    rank, world, device, _ = init(TIMEOUT, args.share_gpu)
    bf16 = device.type == "cuda"
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    options = model_options(plan)
    # replicated optimizer states: the synchronised gradients stay in every parameter's
    # main gradient (ZeRO-1 reduce-scatters them into the optimizer's slices)
    plan = plan.model_copy(update={"optimizer_sharding": OptimizerSharding.none})
    trainer = build_trainer(plan, rank, world, device, args.seed, data, options,
                            param_dtype=torch.bfloat16 if bf16 else torch.float32)
    loss = trainer.forward_backward(0)
    trainer.sync_gradients()
    grads = {k: (g.detach().clone(), s) for k, (g, s) in trainer.local_gradients().items()}
    del trainer
    release(device)
    # Ranks sharing a GPU take turns, so one reference model is alive at a time.
    turns = range(world) if args.share_gpu and world > 1 else [rank]
    for turn in turns:
        if turn == rank:
            part = _compare(loss, grads, plan, device, args.seed, data, options, bf16)
        if len(turns) > 1:
            dist.barrier()
    parts = [part]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, part)
    backend = dist.get_backend() if world > 1 else "none"
    finish(world)
    if rank != 0:
        return 0
    result = {
        "plan": str(args.plan),
        "plan_summary": plan.summary(),
        "world": world,
        "backend": backend,
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "precision": "bf16" if bf16 else "fp32",
        **_verdict(parts, bf16),
    }
    extra = (f", vs fp32: layout {result['grad_max_layout_vs_fp32']:.2e}, bf16 reference "
             f"{result['grad_max_bf16_reference_vs_fp32']:.2e}" if bf16 else "")
    written = write_measurement(
        args.out, result, args.force, f"{plan.summary()}: loss rel err "
        f"{result['loss_rel_err']:.2e}, max grad rel err {result['grad_max_rel_err']:.2e}{extra} "
        f"({result['precision']}) {'pass' if result['pass'] else 'FAIL'} -> {args.out}")
    return written or (0 if result["pass"] else 1)


if __name__ == "__main__":
    sys.exit(main())
