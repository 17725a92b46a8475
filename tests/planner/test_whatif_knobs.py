"""What-if knob parsing and application to clusters (no search)."""

import pytest

from planner.whatif import Knob, Setting, parse_vary, plan_changes
from plans import SpecError, catalog


def test_parse_values_and_multipliers():
    settings = parse_vary("nvlink_gb_s=1x,2x,900")
    assert [s.text for s in settings] == ["1x", "2x", "900"]
    c = catalog.load_cluster("h800", gpus=64)
    assert [s.apply(c).node.nvlink_gb_s for s in settings] == [200, 400, 900]


@pytest.mark.parametrize("spec,words", [
    ("nvlink", "must look like KNOB=V1,V2"),
    ("flops=2x", "unknown knob 'flops'"),
    ("gpu_tflops=", "no values given"),
])
def test_parse_errors(spec, words):
    with pytest.raises(SpecError, match=words):
        parse_vary(spec)


def test_bad_values():
    c = catalog.load_cluster("h800", gpus=64)
    with pytest.raises(SpecError, match="'fast' is not a number"):
        Setting(Knob.hbm_gib, "fast").apply(c)
    with pytest.raises(SpecError, match="must be positive"):
        Setting(Knob.hbm_gib, "-2x").apply(c)
    with pytest.raises(SpecError, match="nvlink_domain=7.*multiple of node.gpus_per_node"):
        Setting(Knob.nvlink_domain, "7").apply(c)


def test_knobs_change_the_right_fields():
    c = catalog.load_cluster("h800", gpus=1440)
    faster = Setting(Knob.gpu_tflops, "2x").apply(c)
    assert faster.gpu.bf16_dense_tflops == 1978 and faster.gpu.fp8_dense_tflops == 3958
    assert Setting(Knob.hbm_tb_s, "4.8").apply(c).gpu.hbm_tb_s == 4.8
    assert Setting(Knob.network_gb_s, "2x").apply(c).network_gb_s_per_gpu == 100
    rack = Setting(Knob.nvlink_domain, "72").apply(c)
    assert rack.nvlink_domain == 72 and rack.network_gb_s_per_gpu == c.network_gb_s_per_gpu


def test_plan_changes_lists_differences():
    from plans import Degrees, Plan, TrainingSpec

    base = dict(model=catalog.load_model("mixtral-8x7b"), cluster=catalog.load_cluster("h100"),
                training=TrainingSpec(global_batch=8, seq_len=64), stage_layers=(32,))
    a = Plan(**base, degrees=Degrees(dp=1, sp=8, ep=4))
    b = Plan(**base, degrees=Degrees(dp=2, sp=4, ep=4), micro_batch_size=2)
    assert plan_changes(a, b) == ["dp 1->2", "sp 8->4", "micro_batch_size 1->2"]
    assert plan_changes(a, None) == ["no longer fits"]


def test_overlap_share_sets_the_hidden_share_and_takes_0_to_1():
    c = catalog.load_cluster("h200-runtime", gpus=8)
    assert c.efficiency.overlap == 0
    assert Setting(Knob.overlap_share, "0.9").apply(c).efficiency.overlap == 0.9
    assert Setting(Knob.overlap_share, "0").apply(c).efficiency.overlap == 0
    assert Setting(Knob.overlap_share, "0.5x").apply(
        catalog.load_cluster("h800")).efficiency.overlap == pytest.approx(0.45)
    with pytest.raises(SpecError, match="overlap_share=1.5: efficiency.overlap"):
        Setting(Knob.overlap_share, "1.5").apply(c)
    with pytest.raises(SpecError, match="must be 0 or more"):
        Setting(Knob.overlap_share, "-0.1").apply(c)
    with pytest.raises(SpecError, match="must be positive"):
        Setting(Knob.hbm_gib, "0").apply(c)
