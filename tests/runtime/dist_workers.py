"""Functions the worker processes run (importable by name) and the helpers tests share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plans import (
    EPFFN,
    TPFFN,
    CrossEntropy,
    Degrees,
    Dispatch,
    Kernels,
    Optimizer,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    TPAttention,
    TrainingSpec,
)
from plans.catalog import load_cluster, load_model
from runtime.data import SyntheticTokens
from runtime.parallel.optimizer import OptimizerConfig
from runtime.trainer import build_trainer, model_options, reference_plan

SEED = 1234
OPTIM = OptimizerConfig(lr=1e-2)


def make_plan(
    model: str = "tiny-moe",
    dispatch: Dispatch = Dispatch.all_to_all,
    tp_attention: bool = False,
    global_batch: int = 4,
    seq_len: int = 32,
    micro_batch_size: int = 1,
    stage_layers: tuple[int, ...] | None = None,
    grad_sync_precision: Precision = Precision.fp32,
    recompute: Recompute = Recompute.none,
    tp_ffn: bool = False,
    optimizer_sharding: OptimizerSharding = OptimizerSharding.none,
    optimizer: Optimizer = Optimizer.adam,
    overlap: Overlap = Overlap.none,
    kernels: Kernels = Kernels.eager,
    spec_update: dict | None = None,
    cross_entropy: CrossEntropy = CrossEntropy.materialized,
    gpus_per_node: int | None = None,
    **degrees: int,
) -> Plan:
    """A test plan; optimizer states replicated unless asked (the parity tests read every
    rank's all-reduced main gradients, which ZeRO-1 reduce-scatters instead). ``spec_update``:
    model fields changed from the catalog model's. ``gpus_per_node``: the cluster's node size
    (virtual nodes on CPU), the catalog's by default."""
    d = Degrees(**degrees)
    spec = load_model(model)
    if spec_update:
        spec = type(spec).model_validate({**spec.model_dump(), **spec_update})
    cluster = load_cluster("h200", gpus=d.world)
    if gpus_per_node is not None:
        cluster = type(cluster).model_validate(
            {**cluster.model_dump(), "node": {**cluster.node.model_dump(),
                                              "gpus_per_node": gpus_per_node}})
    extra: dict = {"attention": TPAttention()} if tp_attention else {}
    if d.vpp > 1:
        extra["schedule"] = PipelineSchedule.interleaved_1f1b
    # fp8 gradient sync is only valid in a plan that trains in fp8
    precision = Precision.fp8 if grad_sync_precision == Precision.fp8 else Precision.bf16
    return Plan(
        model=spec,
        cluster=cluster,
        training=TrainingSpec(global_batch=global_batch, seq_len=seq_len, precision=precision,
                              optimizer=optimizer),
        degrees=d,
        ffn=TPFFN() if tp_ffn else EPFFN(dispatch=dispatch),
        stage_layers=stage_layers or (spec.layers,),
        micro_batch_size=micro_batch_size,
        grad_sync_precision=grad_sync_precision,
        recompute=recompute,
        optimizer_sharding=optimizer_sharding,
        overlap=overlap,
        kernels=kernels,
        cross_entropy=cross_entropy,
        **extra,
    )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Parameter dtypes by name (worker arguments travel pickled; names keep them plain)."""


def trainer_for(plan: Plan, rank: int, world: int, dtype: str = "fp32",
                optim: OptimizerConfig = OPTIM):
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, SEED)
    return build_trainer(
        plan, rank, world, torch.device("cpu"), SEED, data, model_options(plan), optim,
        DTYPES[dtype],
    )


def reference_trainer(plan: Plan, dtype: str = "fp32", optim: OptimizerConfig = OPTIM):
    """The one-rank model the parallel ``plan`` must reproduce (same balance groups)."""
    ref = reference_plan(plan)
    t = ref.training
    data = SyntheticTokens(t.global_batch, t.seq_len, ref.model.vocab, SEED)
    return build_trainer(
        ref, 0, 1, torch.device("cpu"), SEED, data, model_options(plan), optim,
        DTYPES[dtype],
    )


# ---- run on every rank ---------------------------------------------------------------------


def one_step_gradients(plan_json: str, dtype: str = "fp32"):
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size(), dtype=dtype)
    loss = trainer.forward_backward(0)
    trainer.sync_gradients()
    return loss, trainer.local_gradients()


def chunked_moe_layers(plan_json: str) -> list[int]:
    """Token chunks of each MoE layer's schedule on this rank (1: the serial expert_ffn)."""
    from runtime.parallel.overlap import ChunkedExpertFFN

    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    return [m.expert_ffn.chunks if isinstance(m.expert_ffn, ChunkedExpertFFN) else 1
            for m in trainer.model.moe_layers()]


def ulysses_head_groups(plan_json: str) -> list[int]:
    """Head groups of each layer's Ulysses core on this rank (1: the blocking UlyssesCore)."""
    from runtime.parallel.attention import ChunkedUlyssesCore

    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    cores = [b.attention.core for b in trainer.model.layers.values()]
    return [c.chunks if isinstance(c, ChunkedUlyssesCore) else 1 for c in cores]


def overlapped_and_serial_sync(plan_json: str, bucket_params: int) -> list[dict]:
    """The plan run twice from the same seed, gradient sync after the backward without
    accumulation fusion, then overlapped with it, in buckets of ``bucket_params``: per run the
    first step's loss, the buckets launched before ``sync_gradients`` and the buckets with a
    collective, the main gradients after the sync, the parameters after the optimizer, and the
    second step's loss."""
    from dataclasses import replace

    from runtime.parallel.grad_accumulation import in_gemm

    plan = Plan.model_validate_json(plan_json)
    runs = []
    for on in (False, True):
        variant = plan.model_copy(update={"grad_sync_overlap": on,
                                          "grad_accumulation_fusion": on})
        trainer = trainer_for(variant, dist.get_rank(), dist.get_world_size(),
                              optim=replace(OPTIM, bucket_params=bucket_params))
        loss = trainer.forward_backward(0)
        launcher = trainer.optimizer.launcher
        launched = sum(launcher.next_of.values())
        trainer.sync_gradients()
        grads = {k: g for k, (g, _) in trainer.local_gradients().items()}
        trainer.optimizer_step()
        params = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
        marked = [n for n, p in trainer.model.named_parameters()
                  if in_gemm(p) and ".experts." in n]
        runs.append({"loss": loss, "launched": launched, "buckets": len(launcher.launches),
                     "marked_experts": marked,
                     "marked_head": (trainer.model.output is not None
                                     and in_gemm(trainer.model.output.weight)),
                     "grads": grads, "params": params, "next_loss": trainer.train_step(1).loss})
    return runs


def loss_curve(plan_json: str, steps: int, dtype: str = "fp32"):
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size(), dtype)
    return [trainer.train_step(s).loss for s in range(steps)]


def state_bytes(cases: list[str]) -> list[dict]:
    """Per plan: this rank's storage bytes of parameters, main gradients and optimizer states
    with bf16 parameters after one step, and the dtypes found."""
    out = []
    for plan_json in cases:
        plan = Plan.model_validate_json(plan_json)
        trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size(), "bf16")
        trainer.train_step(0)
        params = list(trainer.model.parameters())
        out.append({
            **trainer.state_bytes(),
            "numel": sum(p.numel() for p in params),
            "param_dtypes": {str(p.dtype) for p in params},
            "grad_dtypes": {str(p.main_grad.dtype) for p in params},
            # .grad freed after accumulation, or (accumulation fusion) the main gradient's view
            "no_separate_grads": all(
                p.grad is None or p.grad.data_ptr() == p.main_grad.data_ptr() for p in params),
            "aligned": all(p.data_ptr() % 16 == 0 for p in params),
        })
    return out


def resume_is_exact(ckpt_dir: str, dtype: str) -> tuple[list[float], list[float], dict]:
    """ZeRO-1 training for 4 steps, and 2 steps + checkpoint + a fresh trainer resumed for
    2 more: the losses of steps 3-4 of both, and the dtypes of the stored state."""
    from pathlib import Path

    from runtime import checkpoint

    plan = make_plan(dp=2, grad_sync_precision=Precision.bf16,
                     optimizer_sharding=OptimizerSharding.zero1)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = trainer_for(plan, rank, world, dtype)
    losses = [full.train_step(s).loss for s in range(4)]
    first = trainer_for(plan, rank, world, dtype)
    for s in range(2):
        first.train_step(s)
    path = checkpoint.save(first, Path(ckpt_dir), 2)
    resumed = trainer_for(plan, rank, world, dtype)
    start = checkpoint.load(resumed, path)
    after = [resumed.train_step(s).loss for s in range(start, 4)]
    kinds = {
        "model": {str(v.dtype) for k, v in checkpoint.state_dict(resumed).items()
                  if k.startswith("model.")},
        "master": {str(v.dtype) for k, v in checkpoint.state_dict(resumed).items()
                   if k.endswith(".master")},
        "moments": {str(v.dtype) for k, v in checkpoint.state_dict(resumed).items()
                    if k.endswith((".exp_avg", ".exp_avg_sq"))},
    }
    return losses[2:], after, kinds


def fp8_collectives():
    """Relative errors of fp8 all-reduce and reduce-scatter against fp32 on a gradient-like
    tensor (values spread over decades), and whether every rank got the same all-reduce."""
    from runtime.parallel.data_parallel import fp8_all_reduce, fp8_reduce_scatter

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 0, 1000)
    full = x.clone()
    dist.all_reduce(full)
    ar = fp8_all_reduce(x, None)
    rs = fp8_reduce_scatter(x, None)
    mine = full.chunk(n)[rank]
    gathered = [torch.empty_like(ar) for _ in range(n)]
    dist.all_gather(gathered, ar)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return rel(ar, full), rel(rs, mine), all(torch.equal(t, ar) for t in gathered)


def ulysses_round_trip():
    """seq_to_head equals the head slice of the full sequence; head_to_seq inverts it."""
    from runtime.parallel.comm import head_to_seq, seq_to_head

    rank, n = dist.get_rank(), dist.get_world_size()
    full = torch.randn(2, 8 * n, 4 * n, 3, generator=torch.Generator().manual_seed(0))
    local = full.chunk(n, dim=1)[rank].clone().requires_grad_()
    heads = seq_to_head(local, None)
    assert torch.equal(heads, full.chunk(n, dim=2)[rank])
    back = head_to_seq(heads, None)
    assert torch.equal(back, local)
    back.sum().backward()
    assert torch.equal(local.grad, torch.ones_like(local))
    return True


def sharded_head_into_main_grad():
    """The chunked loss over a vocabulary split over the ranks (several chunks), the rank's
    head rows marked ``in_gemm``: the summed loss, this rank's hidden-state gradient and its
    rows' main gradient against autograd on the whole head (fp64 inputs)."""
    from plans import layout
    from runtime.loss import VocabShard, materialized_cross_entropy, sharded_cross_entropy
    from runtime.parallel.grad_accumulation import IN_GEMM, on_grad_ready

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, s, hidden, vocab = 2, 6 * n, 8, 10 * n
    out = torch.randn(b, s, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    shard = VocabShard(dist.group.WORLD, rank, n, vocab // n)
    rows = slice(shard.first, shard.first + shard.rows)
    mine = slice(rank * s // n, (rank + 1) * s // n)
    head = torch.nn.Parameter(w[rows].clone())
    setattr(head, IN_GEMM, True)
    head.main_grad = torch.zeros_like(head)
    calls = []
    on_grad_ready(head, calls.append)
    local = out[:, mine].clone().requires_grad_()
    scale = 1 / (b * s)
    kept, layout.CHUNK_LOGITS = layout.CHUNK_LOGITS, 5 * shard.rows  # chunks of 5 tokens
    try:
        got = sharded_cross_entropy(local, labels[:, mine], scale, shard, head)
    finally:
        layout.CHUNK_LOGITS = kept
    got.backward()
    total = got.detach().clone()
    dist.all_reduce(total)
    ref_out, ref_w = out.clone().requires_grad_(), w.clone().requires_grad_()
    want = materialized_cross_entropy((ref_out @ ref_w.t()).flatten(0, 1), labels.flatten(),
                                      scale)
    want.backward()
    # the shards' statistics and gradients are fp32 (runtime.kernels.cross_entropy_partial)
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(local.grad, ref_out.grad[:, mine], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.main_grad, ref_w.grad[rows], rtol=1e-5, atol=1e-6)
    assert head.grad is None and calls == [head]
    return True


def dispatcher_vs_local(kind: str, dropped: bool = False):
    """Expert inputs on each rank are the rows the one-rank permutation gives its experts, in
    the same order; combine (through identity experts) and its gradient match the local one.
    ``dropped``: some slots were dropped by capacity (index -1)."""
    from runtime.moe import LocalDispatcher, Routing
    from runtime.parallel.expert import AllGatherDispatcher, AllToAllDispatcher

    rank, n = dist.get_rank(), dist.get_world_size()
    experts, k, t, h = 4 * n, 2, 6, 5
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(n * t, h, generator=g)
    idx_all = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * t)])
    if dropped:
        idx_all[::3, 1] = -1
    w_all = torch.rand(n * t, k, generator=g)
    scale = torch.randn(experts, generator=g)  # a per-expert "computation"

    probe = torch.randn(n * t, h, generator=g)

    def run(disp, x, idx, w, num_local, first, probe):
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        routing = Routing(idx, w, torch.zeros(()), dropless=not dropped)
        rows, counts, handle = disp.dispatch(x, routing)
        expert_of = torch.repeat_interleave(torch.arange(num_local) + first, counts)
        y = disp.combine(rows * scale[expert_of, None], handle)
        (y * probe).sum().backward()
        return rows.detach(), counts, y.detach(), x.grad, w.grad

    ref_rows, ref_counts, ref_y, ref_gx, ref_gw = run(
        LocalDispatcher(experts), x_all, idx_all, w_all, experts, 0, probe
    )
    el = experts // n
    if kind == "all_to_all":
        disp = AllToAllDispatcher(experts, None, n)
    else:
        disp = AllGatherDispatcher(experts, None, n, rank)
    sl = slice(rank * t, (rank + 1) * t)
    rows, counts, y, gx, gw = run(
        disp, x_all[sl], idx_all[sl], w_all[sl], el, rank * el, probe[sl]
    )
    before = int(ref_counts[: rank * el].sum())
    mine = int(ref_counts[rank * el : (rank + 1) * el].sum())
    assert torch.equal(counts, ref_counts[rank * el : (rank + 1) * el])
    assert torch.equal(rows, ref_rows[before : before + mine])
    torch.testing.assert_close(y, ref_y[sl])
    torch.testing.assert_close(gx, ref_gx[sl])
    torch.testing.assert_close(gw, ref_gw[sl])
    return True


def chunked_vs_serial(kind: str, capacity_factor: float | None, shared: bool):
    """One EP MoE layer run serially and as the chunked inter-op schedule on the same ranks:
    output, input and every parameter gradient agree (an odd token count splits unevenly;
    a capacity factor drops slots, so dispatch filters them)."""
    from runtime.moe import MoE
    from runtime.parallel.expert import AllGatherDispatcher, AllToAllDispatcher
    from runtime.parallel.overlap import ChunkedExpertFFN

    rank, n = dist.get_rank(), dist.get_world_size()
    experts, h, t = 4 * n, 8, 7
    torch.manual_seed(3)
    moe = MoE(h, experts, 2, 12, balance_groups=n, shared_experts=int(shared),
              shared_ffn_hidden=6, capacity_factor=capacity_factor)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    el = experts // n
    for w in ("w1", "w2", "w3"):
        full = getattr(moe.experts, w)
        setattr(moe.experts, w, torch.nn.Parameter(full.detach()[rank * el:(rank + 1) * el]))
    moe.dispatcher = (AllToAllDispatcher(experts, None, n) if kind == "all_to_all"
                      else AllGatherDispatcher(experts, None, n, rank))
    moe.aux_loss_scale = 0.1
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(rank))
    probe = torch.randn(t, h, generator=torch.Generator().manual_seed(10 + rank))

    def run():
        moe.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        y = moe(xs)
        (y * probe).sum().backward()
        return y.detach(), xs.grad, {k: p.grad.clone() for k, p in moe.named_parameters()}

    serial = run()
    moe.expert_ffn = ChunkedExpertFFN(moe, 2)
    chunked = run()
    torch.testing.assert_close(chunked[0], serial[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked[1], serial[1], rtol=1e-4, atol=1e-6)
    assert chunked[2].keys() == serial[2].keys()
    for k in serial[2]:
        torch.testing.assert_close(chunked[2][k], serial[2][k], rtol=1e-4, atol=1e-6)
    return True


def train_main(argv: list[str]) -> int:
    """runtime.train.main inside the pool's process group."""
    import os

    from runtime.train import main

    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    return main(argv)


def step_components(plan_json: str) -> dict[str, float]:
    """This rank's per-component seconds of one training step."""
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    return trainer.train_step(0).components_s


def step_regions(plan_json: str) -> tuple[list[str], dict[str, float]]:
    """The timer regions this rank opened in one training step, and its components."""
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    opened: set[str] = set()
    trainer.timers.observers = (lambda key, opening: opened.add(key) if opening else None,)
    components = trainer.train_step(0).components_s
    return sorted(opened), components


def loaded_checkpoint(plan_json: str, path: str) -> dict[str, torch.Tensor]:
    """This rank's checkpoint state after loading ``path`` under ``plan_json``'s layout
    (the plan says how optimizer states are sharded), keyed as stored."""
    from pathlib import Path

    from runtime import checkpoint

    plan = Plan.model_validate_json(plan_json)
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, SEED)
    trainer = build_trainer(plan, dist.get_rank(), dist.get_world_size(), torch.device("cpu"),
                            SEED, data, optim=OPTIM)
    checkpoint.load(trainer, Path(path))
    return {k: v.detach().clone() for k, v in checkpoint.state_dict(trainer).items()}


def closed_trainers(plan_json: str, times: int):
    """Build, step and close ``times`` trainers of the plan in turn: (loss, process groups
    left beyond those before, whether its optimizer outlived the trainer) after each close."""
    import gc
    import weakref

    from torch.distributed.distributed_c10d import _world

    plan = Plan.model_validate_json(plan_json)
    before = len(_world.pg_map)
    out = []
    for _ in range(times):
        trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size(), "fp32")
        loss = trainer.train_step(0).loss
        optimizer = weakref.ref(trainer.optimizer)
        trainer.close()
        del trainer
        gc.collect()
        out.append((loss, len(_world.pg_map) - before, optimizer() is not None))
    return out


def clipped_step(plan_json: str, max_norm: float):
    """One step clipped to ``max_norm``: the norm before clipping, this rank's clipped main
    gradients (replicated states: the synchronised sums), and the next step's loss and
    norm."""
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size(),
                          optim=OptimizerConfig(lr=OPTIM.lr, clip_grad=max_norm))
    return clipped_run(trainer)


def clipped_run(trainer):
    trainer.forward_backward(0)
    trainer.sync_gradients()
    norm = trainer.clip_gradients()
    grads = trainer.local_gradients()
    trainer.optimizer_step()
    after = trainer.train_step(1)
    return norm, grads, after.loss, after.grad_norm


def expert_biases(trainer) -> dict[str, torch.Tensor]:
    """Every router's expert bias on this rank, by its global buffer name."""
    return {name: b.detach().clone() for name, b in trainer.model.named_buffers()
            if name.endswith("router.expert_bias")}


def losses_and_expert_biases(plan_json: str, steps: int
                             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of ``steps`` training steps and the expert biases after them."""
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    losses = [trainer.train_step(s).loss for s in range(steps)]
    return losses, expert_biases(trainer)
