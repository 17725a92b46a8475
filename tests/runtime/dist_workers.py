"""Functions the worker processes run (importable by name) and the helpers tests share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plans import EPFFN, Degrees, Dispatch, Plan, Precision, Recompute, TPAttention, TrainingSpec
from plans.catalog import load_cluster, load_model
from runtime.data import SyntheticTokens
from runtime.trainer import OptimizerConfig, build_trainer, model_options, reference_plan

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
    **degrees: int,
) -> Plan:
    d = Degrees(**degrees)
    spec = load_model(model)
    extra = {"attention": TPAttention()} if tp_attention else {}
    return Plan(
        model=spec,
        cluster=load_cluster("h200", gpus=d.world),
        training=TrainingSpec(global_batch=global_batch, seq_len=seq_len),
        degrees=d,
        ffn=EPFFN(dispatch=dispatch),
        stage_layers=stage_layers or (spec.layers,),
        micro_batch_size=micro_batch_size,
        grad_sync_precision=grad_sync_precision,
        recompute=recompute,
        **extra,
    )


def trainer_for(plan: Plan, rank: int, world: int):
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, SEED)
    return build_trainer(
        plan, rank, world, torch.device("cpu"), SEED, data, model_options(plan), OPTIM
    )


def reference_trainer(plan: Plan):
    """The one-rank model the parallel ``plan`` must reproduce (same balance groups)."""
    ref = reference_plan(plan)
    t = ref.training
    data = SyntheticTokens(t.global_batch, t.seq_len, ref.model.vocab, SEED)
    return build_trainer(
        ref, 0, 1, torch.device("cpu"), SEED, data, model_options(plan), OPTIM
    )


# ---- run on every rank ---------------------------------------------------------------------


def one_step_gradients(plan_json: str):
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    loss = trainer.forward_backward(0)
    trainer.sync_gradients()
    return loss, trainer.local_gradients()


def loss_curve(plan_json: str, steps: int) -> list[float]:
    plan = Plan.model_validate_json(plan_json)
    trainer = trainer_for(plan, dist.get_rank(), dist.get_world_size())
    return [trainer.train_step(s).loss for s in range(steps)]
