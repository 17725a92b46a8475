"""One rank's training: model from the plan, parallel transforms, pipeline schedule, gradient
sync and AdamW. Used by ``runtime.train`` and, with a one-rank plan, as the reference."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from plans import EPFFN, CrossEntropy, Degrees, MeshAxis, Plan, UlyssesAttention
from plans.execution import executed_value
from plans.layout import moe_chunks, plan_expert_gemm, tokens_per_rank
from plans.specs import mfu
from runtime.config import ModelConfig, ModelOptions
from runtime.data import TokenSource, rank_micro_batches
from runtime.loss import (
    chunked_cross_entropy,
    materialized_cross_entropy,
    sharded_cross_entropy,
)
from runtime.metrics import Component, Timers, peak_memory_gib
from runtime.model import Shard, Transformer, init_weights
from runtime.moe import identity, routing_skew, update_expert_biases
from runtime.parallel.grad_accumulation import mark_parameters
from runtime.parallel.mesh import Mesh, build_mesh
from runtime.parallel.optimizer import OptimizerConfig, build_optimizer
from runtime.parallel.parallelize import ParallelModel, backend_of, parallelize
from runtime.parallel.pipeline import ActionSchedule


@dataclass
class StepMetrics:
    step: int
    loss: float
    """Global mean cross-entropy of the step (balance loss not included)."""
    step_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_gib: float
    components_s: dict[str, float] = field(default_factory=dict)
    routing_skew: float | None = None
    """Mean over this rank's MoE layers and micro-batches of max / mean routed slots per
    expert (runtime.moe.routing_skew); None on a stage without MoE layers."""
    routing_skew_max: float | None = None
    expert_rows: list[int] | None = None
    """Routed rows this rank's experts computed in the step, per MoE layer of the rank (in
    model order; every micro-batch): per layer, the EP ranks' busiest over their mean is the
    load imbalance cost_models.skew derives. None on a stage without MoE layers."""
    grad_norm: float | None = None
    """Global L2 norm of the step's gradients before clipping (OptimizerConfig.clip_grad);
    None without clipping."""


def model_options(
    plan: Plan, aux_loss_coeff: float | None = None, per_expert_balance: bool = False
) -> ModelOptions:
    """The runtime's model options for ``plan``: device-level balance over the EP ranks, the
    balance-loss weight of the model (``aux_loss_coeff`` overrides it), the plan's kernels, the
    experts' GEMM path as plans.layout.expert_gemm picks it for the plan's layout (the calls
    per micro-batch as the overlap the runtime executes chunks them)."""
    d = plan.degrees
    chunks = moe_chunks(executed_value("overlap", plan.overlap), plan.ffn, d.ep)
    return ModelOptions(
        aux_loss_coeff=plan.model.aux_loss_coeff if aux_loss_coeff is None else aux_loss_coeff,
        # device-level balance needs more than one EP rank; with one (or TP experts) every
        # rank holds every expert and the per-expert loss applies
        balance_groups=None if per_expert_balance or plan.degrees.ep == 1 else plan.degrees.ep,
        capacity_factor=plan.ffn.capacity_factor if isinstance(plan.ffn, EPFFN) else None,
        kernels=plan.kernels,
        expert_gemm=plan_expert_gemm(plan.model, d, plan.micro_batch_size,
                                     plan.training.seq_len, chunks, plan.expert_gemm),
    )


def default_param_dtype(device: torch.device) -> torch.dtype:
    """bf16 parameters and compute on CUDA (fp32 masters in the optimizer), fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def reference_plan(plan: Plan) -> Plan:
    """The same model, batch and micro-batching on one rank without parallelism."""
    data = plan.model_dump()
    data.update(
        degrees=Degrees().model_dump(),
        cluster=plan.cluster.with_gpus(1).model_dump(),
        attention=UlyssesAttention().model_dump(),
        stage_layers=(plan.model.layers,),
        schedule="1f1b",
        prediction=None,
    )
    return Plan.model_validate(data)


class Trainer:
    def __init__(
        self,
        plan: Plan,
        mesh: Mesh,
        device: torch.device,
        seed: int,
        data: TokenSource,
        options: ModelOptions | None = None,
        optim: OptimizerConfig | None = None,
        param_dtype: torch.dtype | None = None,
    ):
        self.plan, self.mesh, self.device, self.data = plan, mesh, device, data
        self.param_dtype = param_dtype or default_param_dtype(device)
        self.timers = Timers(device)
        cfg = ModelConfig(plan.model, options or model_options(plan))
        with torch.device("meta"):
            model = Transformer(cfg)
        self.pm: ParallelModel = parallelize(model, plan, mesh, self.timers, backend_of(device))
        init_weights(model, seed, self.pm.shards, device, self.param_dtype)
        mark_parameters(model)  # before the gradient sync attaches to the parameters
        model.train()
        model.head_logits = plan.cross_entropy == CrossEntropy.materialized
        self.model = model
        d = plan.degrees
        scale = 1.0 / (plan.num_micro_batches * d.dp)
        for moe in model.moe_layers():
            moe.aux_loss_scale = cfg.options.aux_loss_coeff * scale
        self.optim = optim or OptimizerConfig()
        self.optimizer = build_optimizer(model, mesh, self.pm.replication, plan, self.optim)
        tokens = plan.training.tokens_per_step
        self.loss_scale = 1.0 / tokens
        # activations between stages are sequence-sharded over the whole attention group
        # (Ulysses sp, or tp with sequence parallelism)
        seq = int(tokens_per_rank(1, plan.training.seq_len, plan.degrees.attention_group))
        shape = (plan.micro_batch_size, seq, plan.model.hidden)
        # 1F1B is the vpp = 1 case of the action lists (runtime.parallel.pipeline)
        self.schedule = ActionSchedule(
            model, mesh, self._loss, shape, device, self.param_dtype, plan.stage_layers,
            plan.num_micro_batches, self.timers,
        )

    # ---- pieces -------------------------------------------------------------------------------
    def _loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy summed over this rank's tokens, divided by the step's global token
        count: the replicas' gradient sum is then the gradient of the global mean. ``out`` is
        the logits (materialized) or the final norm's output (chunked: the loss applies the LM
        head chunk by chunk, runtime.loss)."""
        chunked = self.plan.cross_entropy == CrossEntropy.chunked
        with self.timers.region(Component.loss):
            if self.pm.vocab is not None:  # the vocabulary split by TP (runtime.parallel.tensor)
                return sharded_cross_entropy(out, labels, self.loss_scale, self.pm.vocab,
                                             self.model.output.weight if chunked else None,
                                             self.model.cfg.ops)
            if chunked:
                return chunked_cross_entropy(out.flatten(0, 1), self.model.output.weight,
                                             labels.flatten(), self.loss_scale,
                                             self.model.cfg.ops)
            return materialized_cross_entropy(out.flatten(0, 1), labels.flatten(),
                                              self.loss_scale)

    # ---- a step ---------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> float:
        """Gradients of step ``step`` before synchronisation; returns the global mean loss."""
        return float(self._forward_backward(step))

    def _forward_backward(self, step: int) -> torch.Tensor:
        """forward_backward with the loss left on the device (reading it waits for the step)."""
        self.optimizer.zero_grad()
        micro = rank_micro_batches(self.data.batch(step), self.plan, self.mesh, self.device)
        with self.timers.region(Component.forward_backward):
            local = self.schedule.run(micro)
        total = local.detach().float().reshape(1)
        if self.mesh.world > 1:
            dist.all_reduce(total)  # every token's loss is on exactly one last-stage rank
        return total

    def sync_gradients(self) -> None:
        with self.timers.region(Component.grad_sync):
            self.optimizer.sync_gradients()

    def clip_gradients(self) -> float | None:
        """Clip the synchronised gradients to OptimizerConfig.clip_grad (none when 0): the
        global norm before clipping, every rank's the same."""
        if not self.optim.clip_grad:
            return None
        return self.optimizer.clip_grad_norm(self.optim.clip_grad, self.mesh.world)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (every parameter group)."""
        for group in self.optimizer.opt.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> None:
        """The optimizer's step, then the routers' expert biases (runtime.moe.
        update_expert_biases), their slots summed over the stage's ranks."""
        with self.timers.region(Component.optimizer):
            self.optimizer.step()
            group = self.mesh.groups[MeshAxis.stage]
            update_expert_biases(self.model.moe_layers(), self.plan.model.expert_bias_update_rate,
                                 identity if group is None else partial(_summed, group=group))

    def train_step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        loss_on_device = self._forward_backward(step)
        # the loss is read after the optimizer is queued: reading it first would hold the host
        # until the backward ends, and the GPU would wait for the sync's and optimizer's launches
        self.sync_gradients()
        grad_norm = self.clip_gradients()
        self.optimizer_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        loss = float(loss_on_device)
        elapsed = time.perf_counter() - t0
        moes = self.model.moe_layers()
        skew = routing_skew(moes) or (None, None)
        rows = [m.experts.take_rows() for m in moes] if moes else None
        tokens = self.plan.training.tokens_per_step
        return StepMetrics(
            step=step,
            loss=loss,
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed,
            mfu=mfu(self.plan.model, self.plan.training.seq_len, tokens, elapsed,
                    self.mesh.world, self.plan.cluster.gpu),
            peak_memory_gib=peak_memory_gib(self.device),
            components_s=self.timers.collect(),
            routing_skew=skew[0],
            routing_skew_max=skew[1],
            expert_rows=rows,
            grad_norm=grad_norm,
        )

    def checkpoint_key(self, name: str) -> str:
        """Global name of a parameter plus the slice this rank holds, if any."""
        key = self.model.init_key(name)
        shard = self.pm.shards.get(name)
        return key if shard is None else f"{key}.shard{shard.index}of{shard.parts}"

    def local_gradients(self) -> dict[str, tuple[torch.Tensor, Shard | None]]:
        """Each parameter's main gradient (in fp32) under its global (init) name, with this
        rank's shard: all-reduced after ``sync_gradients`` with replicated AdamW; with ZeRO-1
        this rank's own sum (the reduce-scattered slices live in the optimizer)."""
        return {
            self.model.init_key(name): (
                p.main_grad.detach().to(torch.float32, copy=True), self.pm.shards.get(name)
            )
            for name, p in self.model.named_parameters()
        }

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, main gradients and optimizer states on this rank."""
        return self.optimizer.state_bytes()

    def close(self) -> None:
        """Release what outlives a dropped trainer: the gradient-sync hooks on its parameters
        (they keep the optimizer and its buffers alive) and its process groups. Every rank
        calls it after its last step; the trainer cannot step afterwards."""
        self.optimizer.close()
        self.mesh.close()


def _summed(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def build_trainer(
    plan: Plan,
    rank: int,
    world: int,
    device: torch.device,
    seed: int,
    data: TokenSource,
    options: ModelOptions | None = None,
    optim: OptimizerConfig | None = None,
    param_dtype: torch.dtype | None = None,
) -> Trainer:
    mesh = build_mesh(plan, rank, world, device.type)
    return Trainer(plan, mesh, device, seed, data, options, optim, param_dtype)
