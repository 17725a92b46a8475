"""Plan invariants, their messages, and JSON round-trip."""

import pytest
from pydantic import ValidationError

from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    PipelineSchedule,
    Plan,
    Precision,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)
from plans.errors import describe


def make(**kw):
    base = dict(
        model=catalog.load_model("mixtral-8x7b"),
        cluster=catalog.load_cluster("h800", gpus=64),
        training=TrainingSpec(global_batch=256, seq_len=4096),
        degrees=Degrees(pp=4, dp=2, sp=8, ep=8),
        attention=UlyssesAttention(),
        ffn=EPFFN(dispatch=Dispatch.all_to_all),
        stage_layers=(8, 8, 8, 8),
        micro_batch_size=1,
    )
    return Plan(**{**base, **kw})


def error_of(**kw) -> str:
    with pytest.raises(ValidationError) as e:
        make(**kw)
    return describe(e.value)


def test_derived_values():
    p = make()
    assert p.num_micro_batches == 128
    assert p.degrees.edp == 2
    assert p.degrees.world == 64
    from plans.layout import tokens_per_rank

    assert tokens_per_rank(p.micro_batch_size, p.training.seq_len,
                           p.degrees.attention_group) == 512


def test_round_trip_json():
    p = make(ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter, capacity_factor=1.25))
    again = Plan.model_validate_json(p.model_dump_json())
    assert again == p
    assert again.ffn.dispatch is Dispatch.allgather_reduce_scatter


def test_world_size_invariant_prints_numbers():
    msg = error_of(degrees=Degrees(pp=4, dp=4, sp=8, ep=8))
    assert "pp x dp x cp x sp x tp = 4 x 4 x 1 x 8 x 1 = 128 must equal cluster.gpus (64)" in msg


def test_ep_must_divide_experts_and_inner_ranks():
    assert "must divide model.experts (8)" in error_of(degrees=Degrees(pp=2, dp=2, sp=16, ep=16),
                                                       stage_layers=(16, 16))
    with pytest.raises(ValidationError, match=r"ep x etp \(16 x 1 = 16\) must divide"):
        Degrees(pp=1, dp=1, sp=8, ep=16)


def test_strategy_must_agree_with_degrees():
    msg = error_of(attention=TPAttention())
    assert "degrees.sp: attention kind tp needs sp = 1, got 8" in msg
    msg = error_of(ffn=TPFFN())
    assert "degrees.ep: ffn kind tp needs ep = 1, got 8" in msg


def test_megatron_layout_is_valid():
    p = make(degrees=Degrees(pp=4, dp=2, tp=8, etp=8), attention=TPAttention(), ffn=TPFFN())
    assert p.degrees.edp == 2


def test_stage_layers_checked():
    assert "stage_layers: 3 entries, need pp x vpp = 4 x 1 = 4" in error_of(stage_layers=(8, 8, 16))
    assert "sum 31 must equal model.layers (32)" in error_of(stage_layers=(8, 8, 8, 7))


def test_batch_divisibility():
    msg = error_of(micro_batch_size=3)
    assert "global_batch (256) must be a multiple of dp x micro_batch_size (2 x 3 = 6)" in msg


def test_schedule_and_vpp():
    assert "interleaved_1f1b needs vpp >= 2" in error_of(schedule=PipelineSchedule.interleaved_1f1b)
    msg = error_of(degrees=Degrees(pp=4, vpp=2, dp=2, sp=8, ep=8))
    assert "schedule 1f1b needs vpp = 1, got 2" in msg
    ok = make(degrees=Degrees(pp=4, vpp=2, dp=2, sp=8, ep=8), stage_layers=(4,) * 8,
              schedule=PipelineSchedule.interleaved_1f1b)
    assert ok.degrees.stages == 8


def test_fp8_sync_needs_fp8_training():
    assert "fp8 gradient sync needs training.precision fp8" in error_of(
        grad_sync_precision=Precision.fp8)
    make(grad_sync_precision=Precision.fp8,
         training=TrainingSpec(global_batch=256, seq_len=4096, precision="fp8"))


def test_kv_heads_and_sequence_divisibility():
    m = catalog.load_model("mixtral-8x7b").model_copy(update={"kv_heads": 32})
    make(model=m)  # sp 8 divides 32 KV heads
    assert "training.seq_len (4100) must be a multiple of 8" in error_of(
        training=TrainingSpec(global_batch=256, seq_len=4100))


def test_other_schema_version_refused():
    data = make().model_dump(mode="json")
    data["schema_version"] = 2
    with pytest.raises(ValidationError) as e:
        Plan.model_validate(data)
    assert describe(e.value) == (
        "schema_version: this moeplan reads plans of schema_version 1; the file has 2")


def test_json_schema_has_docs():
    schema = Plan.model_json_schema()
    assert "degrees" in schema["properties"]
    assert schema["$defs"]["Degrees"]["properties"]["ep"]["description"]


def test_optimizer_sharding_is_a_validated_plan_field():
    from pydantic import ValidationError

    from plans import OptimizerSharding
    from plans.errors import describe

    assert make().optimizer_sharding == OptimizerSharding.zero1
    assert make(optimizer_sharding="none").optimizer_sharding == OptimizerSharding.none
    with pytest.raises(ValidationError) as e:
        make(optimizer_sharding="zero3")
    assert describe(e.value).startswith("optimizer_sharding: ")
