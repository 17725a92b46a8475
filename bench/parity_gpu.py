"""Correctness of a parallel layout against the single-process reference: loss and every
gradient after one step (before the optimizer), as maximum relative errors.

    torchrun --nproc-per-node 2 bench/parity_gpu.py --plan PLAN --out bench/results/NAME.json

On CUDA both runs use bf16 (each rank reruns the reference on its own GPU after the
parallel step and compares its own slices); on CPU
both are fp32 with gloo. A gradient's error is ||g - g_ref|| / ||g_ref|| over this rank's slice
(the reference sliced the same way), maximised over ranks and parameters. Rank 0 writes JSON
with metadata, the errors, the worst parameters and ``pass`` against the tolerances: fp32 loss
1e-5 and gradients 1e-4 (the CPU parity tests'); bf16 loss 2e-2 and gradients 1e-1 (bf16 keeps
8 mantissa bits, 2^-8 = 0.4% per rounding, and a layout reorders sums and roundings through
every layer of the step). Exit status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _meta import metadata  # noqa: E402
from train_step import setup  # noqa: E402

from runtime.data import SyntheticTokens  # noqa: E402
from runtime.trainer import build_trainer, model_options, reference_plan  # noqa: E402

TOLERANCE = {"fp32": {"loss": 1e-5, "grad": 1e-4}, "bf16": {"loss": 2e-2, "grad": 1e-1}}


def _release(device: torch.device) -> None:
    """Return a dropped trainer's memory (autograd hooks keep reference cycles) to the device,
    so ranks sharing a GPU have room for the reference in turn."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share-gpu", action="store_true",
                   help="ranks share the visible GPUs over gloo (more ranks than GPUs)")
    args = p.parse_args(argv)
    plan, rank, world, device = setup(args.plan, args.share_gpu)
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    options = model_options(plan)
    # replicated AdamW: synchronised gradients are left in every parameter's .grad
    trainer = build_trainer(plan, rank, world, device, args.seed, data, options, zero1=False)
    loss = trainer.forward_backward(0)
    trainer.sync_gradients()
    grads = {k: (g.detach().clone(), s) for k, (g, s) in trainer.local_gradients().items()}
    del trainer
    _release(device)
    # Every rank runs the reference on its own GPU and compares its own slices, so only a few
    # numbers cross ranks (gathering whole gradients of a full-width model takes minutes).
    # Ranks sharing a GPU take turns, so one reference model is alive at a time.
    turns = range(world) if args.share_gpu and world > 1 else [rank]
    for turn in turns:
        if turn == rank:
            ref = build_trainer(reference_plan(plan), 0, 1, device, args.seed, data, options,
                                zero1=False)
            ref_loss = ref.forward_backward(0)
            ref.sync_gradients()
            ref_grads = {k: g for k, (g, _) in ref.local_gradients().items()}
            per_param = {name: _rel(g, shard.take(ref_grads[name]) if shard else ref_grads[name])
                         for name, (g, shard) in grads.items()}
            names = set(ref_grads)
            del ref, ref_grads
            _release(device)
        if len(turns) > 1:
            dist.barrier()
    mine = (abs(loss - ref_loss) / abs(ref_loss), per_param, names, loss, ref_loss)
    gathered = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    status = 0
    if rank == 0:
        precision = "bf16" if device.type == "cuda" else "fp32"
        loss_err = max(g[0] for g in gathered)
        per_param = {}
        for _, rank_errors, _, _, _ in gathered:
            for name, err in rank_errors.items():
                per_param[name] = max(per_param.get(name, 0.0), err)
        missing = sorted(gathered[0][2] - set(per_param))
        grad_err = max(per_param.values())
        tol = TOLERANCE[precision]
        ok = loss_err < tol["loss"] and grad_err < tol["grad"] and not missing
        result = {
            **metadata(),
            "plan": str(args.plan),
            "plan_summary": plan.summary(),
            "world": world,
            "backend": dist.get_backend() if world > 1 else "none",
            "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "precision": precision,
            "loss": gathered[0][3],
            "reference_loss": gathered[0][4],
            "loss_rel_err": loss_err,
            "grad_max_rel_err": grad_err,
            "worst_grads": dict(sorted(per_param.items(), key=lambda kv: -kv[1])[:5]),
            "params_without_grad": missing,
            "tolerance": tol,
            "pass": ok,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{plan.summary()}: loss rel err {loss_err:.2e}, max grad rel err {grad_err:.2e} "
              f"({precision}) {'pass' if ok else 'FAIL'} -> {args.out}")
        status = 0 if ok else 1
    if world > 1:
        # every rank past its last collective before any tears down (gloo aborts a peer
        # whose pair closes under it)
        dist.barrier()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
