"""Mixed-precision AdamW or SGD over the parallel model (Megatron-LM distributed optimizer).

Model parameters are held in the compute dtype (bf16 on CUDA, fp32 on CPU). Gradients are
accumulated over the micro-batches into main-gradient buffers (fp32 for an fp32 gradient sync,
bf16 for a bf16 or fp8 one; ``data_parallel.grad_dtype``). The plan's optimizer
(``training.optimizer``: AdamW, or plain SGD without momentum, whose only state is the master)
updates fp32 master weights;
with bf16 parameters the masters are separate fp32 copies (initialised from the bf16 weights,
as Megatron-LM does) and the updated masters are cast back into the parameters, with fp32
parameters the parameter is its own master.

The plan's ``optimizer_sharding`` says where the states live. ``none``: every replica keeps
the masters and states of all its parameters. ``zero1`` (Rajbhandari et al., SC'20): the
parameters of a bucket (same
replication group, same weight decay) are views of one flat parameter buffer and their main
gradients of one flat gradient buffer; gradients are reduce-scattered, each replica keeps
master (and AdamW's m and v: 12 B per parameter of its slice) of 1/n of the bucket and updates
it, and the updated slices, cast to the parameter dtype, are all-gathered straight into the
parameter buffer. Both optimizers are elementwise, so both shardings give the same weights.

Buckets hold about ``plans.execution.GRAD_SYNC_BUCKET_PARAMS`` parameters each; their
collectives run after the backward or, with the plan's ``grad_sync_overlap``, during the last
micro-batch's backward (``data_parallel.BucketLauncher``), and the plan's
``grad_accumulation_fusion`` makes autograd accumulate into the buckets directly
(``data_parallel.attach_main_grads``).

With ``kernels: fused`` and AdamW the update is one compiled pass per flat tensor on CUDA
(``runtime.kernels.adamw_step``, ``FusedAdamW``): it reads the gradient in the dtype it was
synchronised in (a bf16 main gradient is never copied to fp32) and writes the parameters in
their dtype as it writes the master, where the eager path casts the gradient, runs torch's
fused AdamW and copies the masters back: 28 bytes per parameter instead of 40 with bf16
gradients (cost_models.evaluate prices both)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plans import MeshAxis, Optimizer, OptimizerSharding, Plan, Precision
from plans.enums import Kernels
from plans.execution import GRAD_SYNC_BUCKET_PARAMS
from runtime.kernels import fused_adamw_step
from runtime.parallel.comm import all_gather_into
from runtime.parallel.data_parallel import (
    BucketLauncher,
    GradSync,
    alias_grads,
    attach_main_grads,
    buffer_layout,
    grad_dtype,
    split_buckets,
    start_reduce_scatter,
)
from runtime.parallel.mesh import Mesh


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    bucket_params: int = GRAD_SYNC_BUCKET_PARAMS
    """Parameters per gradient-sync bucket (data_parallel.split_buckets)."""
    clip_grad: float = 0.0
    """Largest global gradient norm (``clip_grad_norm``); 0: no clipping."""


@dataclass(frozen=True)
class SyncConfig:
    """How the plan synchronises gradients (``grad_sync_precision``, ``grad_sync_overlap``,
    ``grad_accumulation_fusion``) and the micro-batches of a step."""

    precision: Precision
    overlap: bool
    fused: bool
    micro_batches: int

    @classmethod
    def of(cls, plan: Plan) -> SyncConfig:
        return cls(plan.grad_sync_precision, plan.grad_sync_overlap,
                   plan.grad_accumulation_fusion, plan.num_micro_batches)

    def launcher(self) -> BucketLauncher:
        return BucketLauncher(self.micro_batches, self.overlap)


def make_optimizer(kind: Optimizer, decay: list[torch.Tensor], no_decay: list[torch.Tensor],
                   cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The plan's optimizer over fp32 masters, weight decay on ``decay`` only. SGD's L2 decay
    equals decoupled decay without momentum. One fused kernel per tensor list on CUDA (a
    single pass over master, grad and states, no temporaries); the foreach path elsewhere."""
    tensors = [*decay, *no_decay]
    fused = bool(tensors) and all(t.is_cuda for t in tensors)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if kind == Optimizer.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr, fused=fused or None)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)
    # states exist from the start so a checkpoint can be loaded into them in place
    for p in tensors:
        opt.state[p] = {
            "step": torch.tensor(0.0, device=p.device if fused else None),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return opt


class FusedAdamW:
    """AdamW steps through ``runtime.kernels.adamw_step`` compiled, on the masters, moments,
    step counters and hyperparameters of a torch AdamW (which holds them for checkpoints and is
    never stepped itself)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.group_of = {id(t): g for g in opt.param_groups for t in g["params"]}
        self.update = fused_adamw_step(all(t.is_cuda for t in opt.state))

    def step(self, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None) -> None:
        """Update ``master`` from ``grad`` (any dtype, same length); ``out`` (None when the
        master is the parameter) receives the updated weights in its dtype."""
        group, state = self.group_of[id(master)], self.opt.state[master]
        state["step"] += 1
        beta1, beta2 = group["betas"]
        self.update(master.detach().view(-1), grad.view(-1), state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1), None if out is None else out.detach().view(-1),
                    state["step"], group["lr"], beta1, beta2, group["eps"],
                    group["weight_decay"])


GradPiece = tuple[torch.Tensor, int]
"""A synchronised gradient tensor on this rank and how many ranks hold the same values."""


def copies(mesh: Mesh, axes: tuple[MeshAxis, ...]) -> int:
    """Ranks holding one replicated gradient after its sync over ``axes``."""
    n = 1
    for axis in axes:
        n *= mesh.size(axis)
    return n


@torch.no_grad()
def clip_grad_norm(pieces: list[GradPiece], max_norm: float, world: int) -> float:
    """Scale the synchronised gradients in place so that their global L2 norm is at most
    ``max_norm`` (torch.nn.utils.clip_grad_norm_'s rule, coefficient max_norm / (norm +
    1e-6)); returns the norm before clipping. Every gradient element counts once: a piece's
    squares are divided by the ranks holding the same values, so one all-reduce over the
    world sums every shard (TP, EP, ZeRO-1, pipeline stages) once and each replica's share of
    a replicated gradient (Megatron-LM's get_grad_norm_fp32 reduces over the model-parallel
    group after dropping the replicas instead)."""
    device = pieces[0][0].device if pieces else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad, holders in pieces:
        total += torch.linalg.vector_norm(grad, dtype=torch.float32).square() / holders
    if world > 1:
        dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for grad, _ in pieces:
            grad.mul_(coef)
    return norm


def _master(p: nn.Parameter) -> torch.Tensor:
    """fp32 master weight of a parameter: the parameter itself when it is fp32."""
    if p.dtype == torch.float32:
        return p
    return p.detach().to(torch.float32, copy=True)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


KeyOf = Callable[[str], str]
"""Checkpoint key of a parameter name (global name plus this rank's shard)."""


class _Replicated:
    """Masters and AdamW states of parameters every replica updates in full."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        mesh: Mesh,
        replication: dict[str, tuple[MeshAxis, ...]],
        sync: SyncConfig,
        dtype: torch.dtype,
        launcher: BucketLauncher,
        bucket_params: int,
    ):
        self.params = params
        self.sync = GradSync(params, mesh, replication, sync.precision, dtype, launcher,
                             sync.fused, bucket_params)
        self.masters = {name: _master(p) for name, p in params.items()}
        self.pieces = split_buckets(list(params), params, bucket_params) if params else []
        """The eager step's pieces: each casts its main gradients to fp32 and steps alone."""

    def grad_pieces(self) -> list[GradPiece]:
        """The synchronised main-gradient buckets, each with its holders."""
        mesh = self.sync.mesh
        return [(buffer, copies(mesh, axes)) for axes, buffer in self.sync.buckets]

    def decay_split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ms = [(self.params[n].ndim >= 2, m) for n, m in self.masters.items()]
        return [m for d, m in ms if d], [m for d, m in ms if not d]

    @torch.no_grad()
    def step(self, opt: torch.optim.Optimizer) -> None:
        """The eager update, a piece (about a bucket of parameters) at a time: its main
        gradients cast to fp32 into the masters' ``grad``, the optimizer stepped on them (it
        skips masters without one), the masters copied back into bf16 parameters. One
        piece's fp32 gradients are alive at once
        (cost_models.memory.optimizer_step_workspace). A parameter that is its own master
        can come with ``.grad`` aliasing its main gradient (attach_main_grads): it is dropped
        first, so that no call steps a master outside its piece (zero_grad aliases it again)."""
        for m in self.masters.values():
            m.grad = None
        for names in self.pieces:
            for name in names:
                self.masters[name].grad = self.params[name].main_grad.float()
            opt.step()
            for name in names:
                m, p = self.masters[name], self.params[name]
                m.grad = None
                if m is not p:
                    p.copy_(m)

    @torch.no_grad()
    def fused_step(self, fused: FusedAdamW) -> None:
        for name, p in self.params.items():
            m = self.masters[name]
            fused.step(m, p.main_grad, None if m is p else p)

    def checkpoint_state(self, opt, key_of: KeyOf) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            m = self.masters[name]
            if m is not p:
                out[f"optim.{key_of(name)}.master"] = m
            for field, value in opt.state[m].items():
                out[f"optim.{key_of(name)}.{field}"] = value
        return out


def state_bytes(
    params: list[nn.Parameter],
    masters: list[torch.Tensor],
    grad_buffers: list[torch.Tensor],
    opt: torch.optim.Optimizer,
) -> dict[str, int]:
    """Bytes held per rank, counted by tensor storage: parameters, main gradients, and
    optimizer states (fp32 masters that are not the parameters themselves, AdamW m and v; the
    step counters aside): the cost model's params, grads and optimizer components
    (``cost_models.memory``)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    own = [m for m in masters if m.untyped_storage().data_ptr() not in param_ptrs]
    states = [v for m in masters for k, v in opt.state[m].items() if k != "step"]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grad_buffers),
        "optimizer": _storage_bytes([*own, *states]),
    }


class ReplicatedOptimizer:
    """``optimizer_sharding: none``: every replica updates all its parameters in full."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        replication: dict[str, tuple[MeshAxis, ...]],
        sync: SyncConfig,
        kind: Optimizer,
        cfg: OptimizerConfig,
        kernels: Kernels = Kernels.eager,
    ):
        self.params = dict(model.named_parameters())
        dtype = grad_dtype(next(iter(self.params.values())).dtype, sync.precision)
        self.launcher = sync.launcher()
        self.replicated = _Replicated(self.params, mesh, replication, sync, dtype,
                                      self.launcher, cfg.bucket_params)
        self.opt = make_optimizer(kind, *self.replicated.decay_split(), cfg)
        self.fused = FusedAdamW(self.opt) if kind.runs_fused(kernels) else None

    def close(self) -> None:
        """Unhook the gradient-sync launcher from the parameters (the trainer is done)."""
        self.launcher.close()

    def state_bytes(self) -> dict[str, int]:
        r = self.replicated
        return state_bytes(list(self.params.values()), list(r.masters.values()),
                           [b for _, b in r.sync.buckets], self.opt)

    def zero_grad(self) -> None:
        self.launcher.reset()
        self.replicated.sync.zero_()

    @torch.no_grad()
    def sync_gradients(self) -> None:
        self.launcher.finish()

    def clip_grad_norm(self, max_norm: float, world: int) -> float:
        """Clip the synchronised gradients to the global norm ``max_norm`` (after
        ``sync_gradients``); the norm before clipping."""
        return clip_grad_norm(self.replicated.grad_pieces(), max_norm, world)

    def step(self) -> None:
        if self.fused is not None:
            self.replicated.fused_step(self.fused)
            return
        self.replicated.step(self.opt)

    def checkpoint_state(self, key_of: KeyOf) -> dict[str, torch.Tensor]:
        return self.replicated.checkpoint_state(self.opt, key_of)


@dataclass
class _Bucket:
    names: list[str]
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    """None for a bucket on one rank."""
    size: int
    index: int
    param_buffer: torch.Tensor
    """The flat (padded) parameters of the bucket; each parameter is a view of it."""
    grad_buffer: torch.Tensor
    """The flat (padded) main gradients of the bucket."""
    shard: torch.Tensor
    """This rank's fp32 master slice of the bucket: the tensor the optimizer updates."""
    shard_grad: torch.Tensor | None = None
    launch: int = -1
    """Index of its reduce-scatter in the optimizer's BucketLauncher (a sharded bucket)."""

    @property
    def padded(self) -> int:
        return self.shard.numel() * self.size


class ShardedOptimizer:
    """``optimizer_sharding: zero1``. Parameters are bucketed by (replication group, weight
    decay), split by size (``split_buckets``). A bucket replicated over exactly one group of
    more than one rank is sharded over it; a bucket on one rank only (experts with edp = 1,
    everything at dp = sp = 1) is a shard of size one, so the optimizer still runs on one flat
    tensor and no collective is issued. Tied embeddings summed over two groups stay replicated."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        replication: dict[str, tuple[MeshAxis, ...]],
        sync: SyncConfig,
        kind: Optimizer,
        cfg: OptimizerConfig,
        kernels: Kernels = Kernels.eager,
    ):
        self.precision = sync.precision
        fused = kind.runs_fused(kernels)
        params = dict(model.named_parameters())
        param_dtype = next(iter(params.values())).dtype
        dtype = grad_dtype(param_dtype, sync.precision)
        grouped: dict[tuple[tuple[MeshAxis, ...], bool], list[str]] = defaultdict(list)
        for name in params:
            grouped[(replication[name], params[name].ndim >= 2)].append(name)
        self.launcher = sync.launcher()
        self.buckets: list[tuple[_Bucket, bool]] = []
        self.aliased: list[nn.Parameter] = []
        rest: dict[str, nn.Parameter] = {}
        for (groups, decay), all_names in grouped.items():
            live = [g for g in groups if mesh.groups.get(g) is not None]
            if len(live) > 1:
                rest.update({n: params[n] for n in all_names})
                continue
            for names in split_buckets(all_names, params, cfg.bucket_params):
                bucket = self._bucket(names, params, mesh, live, param_dtype, dtype, sync.fused,
                                      fp32_grads=not fused)
                self.buckets.append((bucket, decay))
        self.params = params
        self.rest = _Replicated(rest, mesh, replication, sync, dtype, self.launcher,
                                cfg.bucket_params)
        rest_decay, rest_no_decay = self.rest.decay_split()
        decay = [b.shard for b, d in self.buckets if d] + rest_decay
        no_decay = [b.shard for b, d in self.buckets if not d] + rest_no_decay
        self.opt = make_optimizer(kind, decay, no_decay, cfg)
        self.fused = FusedAdamW(self.opt) if fused else None

    def _bucket(self, names: list[str], params: dict[str, nn.Parameter], mesh: Mesh,
                live: list[MeshAxis], param_dtype: torch.dtype, dtype: torch.dtype,
                fused: bool, fp32_grads: bool) -> _Bucket:
        """One bucket: its parameters become views of a flat parameter buffer, its main
        gradients of a flat gradient buffer; this rank's fp32 master slice; its reduce-scatter
        registered with the launcher (its result cast to fp32 when ``fp32_grads``)."""
        group = mesh.groups[live[0]] if live else None
        size, index = (mesh.size(live[0]), mesh.index(live[0])) if live else (1, 0)
        ps = [params[n] for n in names]
        offsets, total = buffer_layout(ps)
        per_rank = -(-total // size)
        device = ps[0].device
        param_buffer = torch.zeros(per_rank * size, dtype=param_dtype, device=device)
        with torch.no_grad():
            for p, offset in zip(ps, offsets, strict=True):
                view = param_buffer[offset : offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
        grad_buffer = torch.zeros(per_rank * size, dtype=dtype, device=device)
        self.aliased += attach_main_grads(ps, grad_buffer, offsets, fused)
        mine = param_buffer[index * per_rank : (index + 1) * per_rank]
        # fp32 parameters on one rank are their own masters
        shard = (mine if group is None and param_dtype == torch.float32
                 else mine.to(torch.float32, copy=True))
        bucket = _Bucket(names, ps, group, size, index, param_buffer, grad_buffer, shard)
        if group is not None:
            bucket.launch = self.launcher.add(
                ps, group,
                lambda: start_reduce_scatter(grad_buffer, group, self.precision, fp32_grads))
        return bucket

    def close(self) -> None:
        """Unhook the gradient-sync launcher from the parameters (the trainer is done)."""
        self.launcher.close()

    def state_bytes(self) -> dict[str, int]:
        masters = [b.shard for b, _ in self.buckets] + list(self.rest.masters.values())
        grads = [b.grad_buffer for b, _ in self.buckets] + [
            buf for _, buf in self.rest.sync.buckets
        ]
        return state_bytes(list(self.params.values()), masters, grads, self.opt)

    def zero_grad(self) -> None:
        self.launcher.reset()
        for b, _ in self.buckets:
            b.grad_buffer.zero_()
        alias_grads(self.aliased)
        self.rest.sync.zero_()

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Reduce-scatter each sharded bucket's main gradients into its fp32 shard gradient
        (a bucket on one rank: its main gradients, cast in the step), waiting for the ones
        launched during the backward. The fused AdamW reads them in their own dtype instead:
        the main gradients themselves on one rank, the reduce-scatter's output in the wire
        dtype."""
        done = self.launcher.finish()
        for b, _ in self.buckets:
            if b.group is not None:
                b.shard_grad = done[b.launch]
            else:
                b.shard_grad = b.grad_buffer

    def clip_grad_norm(self, max_norm: float, world: int) -> float:
        """Clip the synchronised gradients to the global norm ``max_norm`` (after
        ``sync_gradients``): each bucket's shard gradient (its slice of the sum, held by this
        rank alone) and the replicated rest; the norm before clipping."""
        shards = [(b.shard_grad, 1) for b, _ in self.buckets]
        return clip_grad_norm(shards + self.rest.grad_pieces(), max_norm, world)

    @torch.no_grad()
    def step(self) -> None:
        """The sharded buckets' fp32 gradients (the reduce-scatters' outputs) are all alive
        and stepped at once; the replicated rest and each bucket on one rank cast their main
        gradients to fp32 and step alone, so one such bucket's copy is alive beside them
        (cost_models.memory.optimizer_step_workspace). The optimizer skips masters without
        a ``grad``, and every update is elementwise: the pieces give the one-step weights."""
        if self.fused is not None:
            self._fused_step(self.fused)
            return
        self.rest.step(self.opt)  # first: it drops the gradients its masters came with
        sharded = [b for b, _ in self.buckets if b.group is not None]
        if sharded:
            for b in sharded:
                b.shard.grad, b.shard_grad = b.shard_grad, None
            self.opt.step()
            for b in sharded:
                b.shard.grad = None
        for b, _ in self.buckets:
            if b.group is None:
                b.shard.grad, b.shard_grad = b.shard_grad.float(), None
                self.opt.step()
                b.shard.grad = None
                if b.shard.data_ptr() != b.param_buffer.data_ptr():
                    b.param_buffer.copy_(b.shard)
        for b in sharded:
            # parameter all-gather in the parameter dtype (bf16 on CUDA), into the views
            all_gather_into(
                b.param_buffer, b.shard.to(b.param_buffer.dtype), group=b.group
            )

    def _fused_step(self, fused: FusedAdamW) -> None:
        """Each shard updated in one pass that also writes its weights in the parameter dtype:
        straight into the parameters on one rank, else into the slice the all-gather sends."""
        self.rest.fused_step(fused)
        for b, _ in self.buckets:
            grad, b.shard_grad = b.shard_grad, None
            if b.group is None:
                own = b.shard.data_ptr() == b.param_buffer.data_ptr()
                fused.step(b.shard, grad, None if own else b.param_buffer)
                continue
            out = torch.empty_like(b.shard, dtype=b.param_buffer.dtype)
            fused.step(b.shard, grad, out)
            all_gather_into(b.param_buffer, out, group=b.group)

    def checkpoint_state(self, key_of: KeyOf) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b, _ in self.buckets:
            base = f"optim.zero1.{key_of(b.names[0])}+{len(b.names)}.part{b.index}of{b.size}"
            out[f"{base}.master"] = b.shard
            for field, value in self.opt.state[b.shard].items():
                out[f"{base}.{field}"] = value
        out.update(self.rest.checkpoint_state(self.opt, key_of))
        return out


def build_optimizer(
    model: nn.Module,
    mesh: Mesh,
    replication: dict[str, tuple[MeshAxis, ...]],
    plan: Plan,
    cfg: OptimizerConfig,
) -> ReplicatedOptimizer | ShardedOptimizer:
    """The plan's optimizer (``training.optimizer``) with its states where the plan says
    (``optimizer_sharding``)."""
    make = (ShardedOptimizer if plan.optimizer_sharding == OptimizerSharding.zero1
            else ReplicatedOptimizer)
    return make(model, mesh, replication, SyncConfig.of(plan), plan.training.optimizer, cfg,
                plan.kernels)
