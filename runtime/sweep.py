"""Micro-benchmarks of every kernel class the cost model prices: what `moeplan calibrate
--collectives` fits a cluster's efficiency factors from.

    moeplan sweep --nproc-per-node 2 --out sweep.json
    (or: torchrun --standalone --nproc-per-node 2 -m runtime.sweep --out sweep.json)

Kernels are spread over the ranks (each rank times its share on its own GPU), then every rank
times NCCL collectives. The sweep covers shapes, not one model's:

- dense GEMMs over rows x (out, in) widths, the LM heads' vocabularies included, forward and
  forward + backward (autograd: data- and weight-gradient GEMMs);
- grouped (expert) GEMMs, ``torch._grouped_mm`` as the runtime calls it, over 8..128 experts
  and 32..4096 rows per expert, at three expert widths, forward and forward + backward;
- causal SDPA (FlashAttention) over sequence lengths, head counts and head widths, and the
  runtime's attention core (RoPE, GQA expansion, SDPA) at catalog models' head shapes;
- memory-bound kernels: copies, elementwise adds and SwiGLU, row gathers and index_add, argsort;
- the runtime's own memory-bound layer operators (RMSNorm, residual add, router softmax and
  top-k, the local permutation and its inverse, SwiGLU; runtime/model.py, runtime/moe.py)
  forward + backward at the shapes of catalog models, each named by the cost model's operator
  (cost_models/layer_graph.py) it is priced as;
- the runtime's last-stage tail (final RMSNorm, LM head, materialized or chunked
  cross-entropy) at catalog models' vocabularies (a diagnostic: no factor is fitted to it);
- NCCL all-to-all, all-gather and reduce-scatter from 64 KiB to 512 MiB (skipped on one rank).

Every row (``plans.results.SweepRow``) carries its shape and the measured seconds, no
prediction: `moeplan calibrate` prices each row when it fits (planner.calibrate.row_seconds).
Times are medians of timed repeats after warm-up (runtime.measure: CUDA events on GPU, wall
clock on CPU), on random data. A kernel row is timed twice: one call on an idle GPU
(``measured_s``: the host's dispatch inside, as a host that waits pays it) and its kernels with
the host ahead (``device_s``: a spin kernel holds the GPU while the host queues the call; the
die's time). ``--smoke`` runs tiny shapes (a CPU check: gloo, fp32). Bad input: one line naming
the field, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plans import SpecError, catalog
from plans.io import check_destination
from plans.results import SweepOp
from runtime import measure
from runtime.kernels import weighted_scatter
from runtime.loss import chunked_cross_entropy, materialized_cross_entropy
from runtime.model import AttentionCore, RMSNorm
from runtime.moe import Router, grouped_mm, sort_by_expert
from runtime.parallel.comm import all_gather_into, reduce_scatter_into


class Grid:
    """The shapes of one sweep (full on GPUs, tiny with --smoke)."""

    def __init__(self, smoke: bool) -> None:
        if smoke:
            self.gemm_rows = [64, 128]
            self.gemm_widths = [(64, 64), (128, 64)]
            self.head_gemms: list[tuple[int, int, int]] = []
            self.grouped_experts = [2, 4]
            self.grouped_rows = [8, 32]
            self.grouped_widths = [(64, 32)]  # (hidden, expert ffn)
            self.grouped_extra = [(3, 16, 64, 32)]
            self.attention = [(1, 128, 2, 32)]
            self.memory_mib = [1]
            self.layer_models = ["tiny-moe"]
            self.layer_tokens = [64]
            self.core_batches = [(1, 64)]
            self.head_tokens = [64]
            self.comm_kib = [64, 256]
            self.repeats, self.warmup = 2, 1
            return
        self.gemm_rows = [512, 1024, 2048, 8192, 16384]  # 1,024: the 352B job's rows per rank
        self.gemm_widths = [  # (out, in): projections, expert / dense FFN widths of the catalog
            (2048, 2048), (4096, 4096), (6144, 4096), (5120, 2048), (28672, 4096), (4096, 14336),
            (3072, 2048), (2048, 1536),
        ]
        self.head_gemms = [(4096, 32000, 4096), (4096, 151936, 2048), (4096, 102400, 2048)]
        self.grouped_experts = [8, 16, 32, 64, 128]
        self.grouped_rows = [32, 64, 128, 256, 512, 1024, 4096]
        self.grouped_widths = [(2048, 768), (2048, 1408), (4096, 14336)]
        # (experts, rows per expert, hidden, expert ffn) off the grid: the 352B job's per-rank
        # experts (EP 8 of 32 experts, 8 x 1,024 tokens x top-3 / 32 = 768 rows each)
        self.grouped_extra = [(4, 768, 4096, 14336), (4, 1024, 4096, 14336)]
        self.attention = [  # (batch, seq, heads, head_dim)
            (8, 1024, 32, 128), (4, 2048, 32, 128), (2, 4096, 32, 128), (1, 8192, 32, 128),
            (2, 4096, 16, 128), (2, 4096, 4, 128), (1, 8192, 8, 128), (2, 4096, 32, 64),
            (1, 8192, 16, 64), (1, 16384, 16, 128), (4, 4096, 64, 128), (1, 4096, 16, 192),
            (1, 8192, 4, 128),  # the 352B job's heads per rank under Ulysses SP 8
        ]
        self.memory_mib = [16, 64, 256, 1024]
        self.layer_models = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseekmoe", "phi-3.5-moe"]
        self.layer_tokens = [4096, 16384]
        self.core_batches = [(1, 4096), (2, 4096), (4, 4096), (1, 8192)]
        self.head_tokens = [4096, 8192]
        self.comm_kib = [64, 256, 1024, 4096, 16384, 65536, 262144, 524288]
        self.repeats, self.warmup = 15, 3


def fwd_bwd(fn: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]
            ) -> Callable[[], object]:
    """Forward of ``fn`` and its backward into ``inputs`` from a random output gradient."""
    grad = torch.randn_like(fn())

    def run() -> object:
        return torch.autograd.grad(fn(), inputs, grad, allow_unused=True)
    return run


class Sweep:
    """Rows of the sweep, each a SweepRow dict (measurements only)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, grid: Grid) -> None:
        self.device, self.dtype, self.grid = device, dtype, grid
        self.rows: list[dict] = []

    def randn(self, *shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=grad)

    def add(self, op: SweepOp, name: str, fn: Callable[[], object], *, shape: dict | None = None,
            backward: bool = False, nbytes: int | None = None, layer_op: str | None = None,
            measured: float | None = None) -> None:
        """Time ``fn`` (unless ``measured`` is given: one call on an idle GPU, and its kernels
        with the host ahead, ``device_s``) and record the row."""
        device_s, g = None, self.grid
        if measured is None:  # no barrier: kernels run on each rank alone
            measured = measure.timed(fn, self.device, g.warmup, g.repeats, barrier=False)
            device_s = measure.device_timed(fn, self.device, g.warmup, g.repeats)
        self.rows.append({
            "name": name, "op": op.value, "shape": shape or {}, "backward": backward,
            "measured_s": measured, **({} if device_s is None else {"device_s": device_s}),
            **({} if nbytes is None else {"bytes": nbytes}),
            **({} if layer_op is None else {"layer_op": layer_op})})


# ---- the kernel tasks (each a closure adding rows; spread over the ranks) -----------------------


def gemm_tasks(s: Sweep) -> list[Callable[[], None]]:
    g = s.grid
    shapes = [(m, n, k) for m in g.gemm_rows for n, k in g.gemm_widths] + g.head_gemms

    def task(m: int, n: int, k: int) -> None:
        a, w = s.randn(m, k, grad=True), s.randn(k, n, grad=True)
        shape = {"m": m, "n": n, "k": k}
        s.add(SweepOp.gemm, f"gemm {m}x{n}x{k}", lambda: a @ w, shape=shape)
        s.add(SweepOp.gemm, f"gemm {m}x{n}x{k} fwd+bwd", fwd_bwd(lambda: a @ w, (a, w)),
              shape=shape, backward=True)
    return [lambda sh=sh: task(*sh) for sh in shapes]


def grouped_tasks(s: Sweep) -> list[Callable[[], None]]:
    """fc1/fc3 (rows x hidden -> 2 ffn) and fc2 (rows x ffn -> hidden) of E experts, as
    runtime.moe.grouped_mm calls torch._grouped_mm (weights [E, out, in])."""
    g = s.grid
    out = []
    for hidden, ffn in g.grouped_widths:
        for e in g.grouped_experts:
            for r in g.grouped_rows:
                # Mixtral-width experts only at the expert counts such models have (memory)
                if e * r > 65536 or (hidden * ffn > 2**25 and e > 16):
                    continue
                for n, k in ((2 * ffn, hidden), (hidden, ffn)):
                    out.append(lambda e=e, r=r, n=n, k=k: grouped_task(s, e, r, n, k))
    for e, r, hidden, ffn in g.grouped_extra:
        for n, k in ((2 * ffn, hidden), (hidden, ffn)):
            out.append(lambda e=e, r=r, n=n, k=k: grouped_task(s, e, r, n, k))
    return out


def grouped_task(s: Sweep, e: int, r: int, n: int, k: int) -> None:
    x, w = s.randn(e * r, k, grad=True), s.randn(e, n, k, grad=True)
    counts = torch.full((e,), r, device=s.device, dtype=torch.int64)
    shape = {"experts": e, "rows": r, "n": n, "k": k}
    label = f"grouped_mm {e}x({r}x{k} @ {k}x{n})"
    s.add(SweepOp.grouped_mm, label, lambda: grouped_mm(x, w, counts), shape=shape)
    s.add(SweepOp.grouped_mm, f"{label} fwd+bwd", fwd_bwd(lambda: grouped_mm(x, w, counts),
                                                          (x, w)), shape=shape, backward=True)


def attention_tasks(s: Sweep) -> list[Callable[[], None]]:
    def task(b: int, seq: int, heads: int, d: int) -> None:
        q, k, v = (s.randn(b, heads, seq, d, grad=True) for _ in range(3))

        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        shape = {"batch": b, "seq": seq, "heads": heads, "head_dim": d}
        label = f"flash_attn b{b} s{seq} h{heads} d{d}"
        s.add(SweepOp.flash_attn, label, fwd, shape=shape)
        s.add(SweepOp.flash_attn, f"{label} fwd+bwd", fwd_bwd(fwd, (q, k, v)), shape=shape,
              backward=True)
    return [lambda a=a: task(*a) for a in s.grid.attention]


def attention_core_tasks(s: Sweep) -> list[Callable[[], None]]:
    """The runtime's attention core (RoPE on q and k, GQA expansion, causal SDPA) at the head
    shapes of catalog models, forward + backward."""
    def task(model_name: str, b: int, seq: int) -> None:
        m = catalog.load_model(model_name)
        core = AttentionCore(m.rope_theta)
        q = s.randn(b, seq, m.query_heads, m.head_dim, grad=True)
        k, v = (s.randn(b, seq, m.kv_heads, m.head_dim, grad=True) for _ in range(2))
        shape = {"model": model_name, "batch": b, "seq": seq, "heads": m.query_heads,
                 "kv_heads": m.kv_heads, "head_dim": m.head_dim}
        s.add(SweepOp.attention_core, f"attention_core {model_name} b{b} s{seq}",
              fwd_bwd(lambda: core(q, k, v), (q, k, v)), shape=shape, backward=True)
    return [lambda mn=mn, b=b, seq=seq: task(mn, b, seq) for mn in s.grid.layer_models
            for b, seq in s.grid.core_batches]


def memory_tasks(s: Sweep) -> list[Callable[[], None]]:
    """Memory-bound kernels; ``bytes`` of a copy is the buffer (read and written), of the others
    the bytes they read and write."""
    es = torch.tensor([], dtype=s.dtype).element_size()

    def task(mib: int) -> None:
        n = mib * 2**20 // es
        x, y = s.randn(n), s.randn(n)
        out = torch.empty_like(x)
        s.add(SweepOp.copy, f"copy {mib} MiB", lambda: out.copy_(x), nbytes=n * es)
        s.add(SweepOp.memory, f"add {mib} MiB", lambda: torch.add(x, y, out=out),
              nbytes=3 * n * es)
        s.add(SweepOp.memory, f"silu_mul {mib} MiB", lambda: F.silu(x) * y, nbytes=3 * n * es)
        h = 2048
        rows = n // h
        table = x[: rows * h].view(rows, h)
        idx = torch.randint(0, rows, (rows,), device=s.device)
        s.add(SweepOp.memory, f"gather rows {mib} MiB", lambda: table[idx],
              nbytes=2 * rows * h * es)
        s.add(SweepOp.memory, f"index_add rows {mib} MiB",
              lambda: torch.zeros_like(table).index_add_(0, idx, table), nbytes=4 * rows * h * es)
        keys = torch.randint(0, 128, (n // 8,), device=s.device)
        s.add(SweepOp.memory, f"argsort {keys.numel()} int64",
              lambda: torch.argsort(keys, stable=True), nbytes=2 * keys.numel() * 8)
    return [lambda m=m: task(m) for m in s.grid.memory_mib]


def layer_op_tasks(s: Sweep) -> list[Callable[[], None]]:
    """The runtime's memory-bound operators of one MoE layer on one GPU (all experts local),
    forward + backward, each named by the cost model's operator it is priced as."""
    def task(model_name: str, t: int) -> None:
        m = catalog.load_model(model_name)
        h, e, k, f = m.hidden, m.experts, m.top_k, m.expert_ffn_hidden
        shape = {"model": model_name, "tokens": t}

        def add(op: str, fn: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]
                ) -> None:
            s.add(SweepOp.layer_op, f"{op} {model_name} t{t}", fwd_bwd(fn, inputs),
                  shape=shape, backward=True, layer_op=op)
        x = s.randn(t, h, grad=True)
        norm = RMSNorm(h, m.norm_eps).to(s.device, s.dtype)
        torch.nn.init.ones_(norm.weight)
        add("attn_norm", lambda: norm(x), (x, norm.weight))
        y = s.randn(t, h, grad=True)
        add("attn_residual", lambda: x + y, (x, y))
        router = Router(h, e, k, 1, pre_softmax=m.router_pre_softmax).to(s.device)
        router.gate = torch.nn.Identity()
        logits = s.randn(t, e, grad=True)
        add("router_topk", lambda: router(logits).weights, (logits,))
        routing = router(logits.detach())

        def permute() -> torch.Tensor:
            slots, _ = sort_by_expert(routing.indices, e, dropless=True)
            return x[torch.div(slots, k, rounding_mode="floor")]
        add("dispatch_permute", permute, (x,))
        a, b = s.randn(t * k, f, grad=True), s.randn(t * k, f, grad=True)
        add("expert_swiglu", lambda: F.silu(a) * b, (a, b))
        slots, _ = sort_by_expert(routing.indices, e, dropless=True)
        rows = s.randn(t * k, h, grad=True)
        add("combine_unpermute", lambda: weighted_scatter(rows, slots, routing.weights, t, k),
            (rows,))
    return [lambda mn=mn, t=t: task(mn, t) for mn in s.grid.layer_models
            for t in s.grid.layer_tokens]


def head_loss_tasks(s: Sweep) -> list[Callable[[], None]]:
    """The runtime's last-stage tail: final RMSNorm, LM head, cross-entropy (materialized:
    logits, fp32 cast, F.cross_entropy; chunked: runtime.loss.chunked_cross_entropy), forward +
    backward, at catalog models' hidden sizes and vocabularies."""
    def task(model_name: str, t: int, chunked: bool) -> None:
        m = catalog.load_model(model_name)
        x = s.randn(t, m.hidden, grad=True)
        norm = RMSNorm(m.hidden, m.norm_eps).to(s.device, s.dtype)
        torch.nn.init.ones_(norm.weight)
        w = (s.randn(m.vocab, m.hidden) * 0.02).requires_grad_()
        labels = torch.randint(0, m.vocab, (t,), device=s.device)

        def fwd() -> torch.Tensor:
            h = norm(x)
            if chunked:
                return chunked_cross_entropy(h, w, labels, 1.0 / t)
            return materialized_cross_entropy(h @ w.t(), labels, 1.0 / t)
        s.add(SweepOp.head_loss, f"head_loss {'chunked' if chunked else 'materialized'} "
              f"{model_name} t{t}", fwd_bwd(fwd, (x, w, norm.weight)), backward=True,
              shape={"model": model_name, "tokens": t, "chunked": int(chunked)})
    return [lambda mn=mn, t=t, c=c: task(mn, t, c) for mn in s.grid.layer_models
            for t in s.grid.head_tokens for c in (False, True)]


def collective_rows(s: Sweep, world: int) -> None:
    """NCCL (gloo on CPU) collectives of every rank over the default group, the ranks lined up
    at a barrier before each repeat (runtime.measure.timed); ``bytes`` is the buffer
    convention of cost_models.comm (all-to-all one rank's send buffer, all-gather and
    reduce-scatter the full buffer)."""
    es = torch.tensor([], dtype=s.dtype).element_size()
    g = s.grid
    for kib in g.comm_kib:
        n = kib * 2**10 // es // world * world
        x, y, shard = s.randn(n), s.randn(n), s.randn(n // world)
        size = n * es
        for op, label, fn in (
            (SweepOp.all_to_all, "KiB/rank", lambda x=x, y=y: dist.all_to_all_single(y, x)),
            (SweepOp.all_gather, "KiB full", lambda x=x, sh=shard: all_gather_into(x, sh)),
            (SweepOp.reduce_scatter, "KiB full",
             lambda x=x, sh=shard: reduce_scatter_into(sh, x)),
        ):
            measured = measure.timed(fn, s.device, g.warmup, g.repeats)
            s.add(op, f"{op.value} {kib} {label}", fn, nbytes=size, measured=measured)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.sweep",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the sweep's JSON")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--kernel-budget-s", type=float, default=150.0,
                   help="start no kernel task after this many seconds (the rest are skipped)")
    return p.parse_args(argv)


def run_kernels(sweep: Sweep, rank: int, world: int, budget_s: float
                ) -> tuple[float, list[str], int]:
    """This rank's share of the kernel tasks, each started within ``budget_s``: (seconds,
    the failed tasks' lines, the skipped tasks' count)."""
    tasks = [*gemm_tasks(sweep), *grouped_tasks(sweep), *attention_tasks(sweep),
             *attention_core_tasks(sweep),
             *memory_tasks(sweep), *layer_op_tasks(sweep), *head_loss_tasks(sweep)]
    t0 = time.perf_counter()
    failed: list[str] = []
    skipped = 0
    for i, task in enumerate(tasks):
        if i % world != rank:
            continue
        if time.perf_counter() - t0 > budget_s:
            skipped += 1  # the collectives and the file still come, whatever the kernels took
            continue
        first = len(sweep.rows)
        try:
            task()
        except Exception as e:  # one shape a kernel refuses must not lose the sweep
            where = sweep.rows[-1]["name"] if len(sweep.rows) > first else "its start"
            reason = (str(e).splitlines() or [""])[0][:200]
            failed.append(f"task {i} after {where}: {type(e).__name__}: {reason}")
            print(f"rank {rank}: {failed[-1]}", flush=True)
        if sweep.device.type == "cuda":
            torch.cuda.empty_cache()
    return time.perf_counter() - t0, failed, skipped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        if args.kernel_budget_s <= 0:
            raise SpecError("--kernel-budget-s must be > 0")
        check_destination(args.out, "--out", args.force)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if torch.cuda.is_available() and local > torch.cuda.device_count():
            raise SpecError(f"LOCAL_WORLD_SIZE: {local} processes, but this machine has "
                            f"{torch.cuda.device_count()} GPUs (one a process)")
    except SpecError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return measure.EXIT_BAD_INPUT
    rank, world, device, dtype = measure.init(timedelta(minutes=10))
    torch.manual_seed(rank)
    sweep = Sweep(device, dtype, Grid(args.smoke))
    kernel_s, failed, skipped = run_kernels(sweep, rank, world, args.kernel_budget_s)
    rows = sweep.rows
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (rows, failed, skipped))
        rows = [r for part, _, _ in gathered for r in part]
        failed = [f for _, part, _ in gathered for f in part]
        skipped = sum(n for _, _, n in gathered)
        sweep.rows = []
        collective_rows(sweep, world)
        rows += sweep.rows
    measure.finish(world)
    if rank != 0:
        return 0
    doc = {"benchmark": "kernel and collective times", "world": world, "kernel_ranks": world,
           "kernel_wall_s": kernel_s, "kernel_tasks_failed": failed,
           "kernel_tasks_skipped": skipped, "rows": rows}
    for r in rows:
        dev = f"{r['device_s'] * 1e3:9.3f} ms" if "device_s" in r else f"{'-':>9}"
        print(f"{r['name'][:44]:44s} {r['measured_s'] * 1e3:9.3f} ms  device {dev}")
    return measure.write_measurement(
        args.out, doc, args.force, f"{len(rows)} rows, kernels {kernel_s:.0f} s ({len(failed)} "
        f"tasks failed, {skipped} skipped); wrote {args.out}", indent=1)


if __name__ == "__main__":
    sys.exit(main())
