"""Shared plans for the cost-model tests."""

import pytest

from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Overlap,
    Plan,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
)
from plans.catalog import load_cluster, load_model


@pytest.fixture(scope="session")
def h800():
    return load_cluster("h800")


@pytest.fixture(scope="session")
def plan_352b() -> Plan:
    """The paper's production layout: Internal-352B on 1,440 H800, pp 15, sp = ep = 8, dp 12."""
    return Plan(
        model=load_model("internal-352b"), cluster=load_cluster("h800", gpus=1440),
        training=TrainingSpec(global_batch=720, seq_len=8192),
        degrees=Degrees(pp=15, dp=12, sp=8, ep=8), attention=UlyssesAttention(),
        ffn=EPFFN(dispatch=Dispatch.all_to_all), stage_layers=(4,) * 15, micro_batch_size=1,
    )


@pytest.fixture(scope="session")
def megatron_352b(plan_352b: Plan) -> Plan:
    """The Megatron-LM baseline: TP attention and TP experts inside the node, no overlap."""
    return Plan.model_validate({
        **plan_352b.model_dump(),
        "degrees": Degrees(pp=15, dp=12, tp=8, etp=8).model_dump(),
        "attention": TPAttention().model_dump(), "ffn": TPFFN().model_dump(),
        "overlap": Overlap.none,
    })


@pytest.fixture(scope="session")
def node_plan():
    """A factory of one-node plans (conftest is not importable under importlib mode)."""
    return one_node_plan


def one_node_plan(model_name: str = "mixtral-8x7b", **update) -> Plan:
    """One 8-GPU H800 node, sp = ep = 8, micro-batch 1, seq 8192."""
    model = load_model(model_name)
    fields = dict(
        model=model, cluster=load_cluster("h800"),
        training=TrainingSpec(global_batch=8, seq_len=8192), degrees=Degrees(sp=8, ep=8),
        stage_layers=(model.layers,), micro_batch_size=1,
    )
    fields.update(update)
    return Plan(**fields)
