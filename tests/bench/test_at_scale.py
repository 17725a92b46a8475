"""bench/fidelity/at_scale.py: the committed comparison with published large runs is what the script
computes from this cost model, and the checks that meet issue 12's 25% still do."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def at_scale():
    return importlib.import_module("bench.fidelity.at_scale")


def test_committed_results_are_what_the_script_computes(at_scale):
    committed = json.loads((ROOT / "bench/results/at_scale.json").read_text())
    fresh = json.loads(json.dumps(at_scale.results()))
    assert {k: committed[k] for k in fresh} == fresh


def test_megatron_mixtral_and_the_speedup_over_megatron_are_within_25_percent(at_scale):
    """The Mixtral run and the 352B speedup over Megatron-LM meet the target (the 352B job's
    absolute throughput, the largest residual, docs/fidelity_at_scale.md)."""
    checks = {c["name"]: c for c in at_scale.results()["checks"]}
    for name in ("Megatron-Core Mixtral-8x7B, 64 H100",
                 "MegaScale-MoE over Megatron-LM, Internal-352B"):
        assert abs(checks[name]["error"]) <= at_scale.TARGET, (name, checks[name]["error"])


def test_megatron_flop_count_matches_its_formula(at_scale):
    """Mixtral-8x7B at 4,096 tokens by hand: 12 L h^2 [(1 + 8/32 + 4096/4096) + 3.5 x 2 x 1.5
    + 32000 / (2 x 32 x 4096)]."""
    from plans import catalog

    m = catalog.load_model("mixtral-8x7b")
    by_hand = 12 * 32 * 4096**2 * ((1 + 0.25 + 1) + 3.5 * 2 * 1.5 + 32000 / (2 * 32 * 4096))
    assert at_scale.megatron_flops_per_token(m, 4096) == pytest.approx(by_hand)


def test_megatron_lm_runs_one_recomputation_over_table_3_the_least_that_fits_at_all(at_scale):
    import cost_models
    from plans import Recompute

    policy = at_scale.sweep_recompute()
    plans = [at_scale.megatron_352b(g) for g in at_scale.TABLE_3_GPUS]
    assert {p.recompute for p in plans} == {policy}
    assert all(cost_models.evaluate(p).feasible for p in plans)
    for weaker in list(Recompute)[:list(Recompute).index(policy)]:
        assert not all(cost_models.evaluate(p.model_copy(update={"recompute": weaker})).feasible
                       for p in plans), weaker


def test_the_papers_kernel_scale_is_the_fit_to_megascale_and_held_out_megatron_lm_is_close(
        at_scale):
    """The paper's cluster's kernel_scale is the one that centres MegaScale-MoE's five Table 3
    errors (a refit would not move it); Megatron-LM's five, not fitted, stay within 15%; the
    plain H800 keeps the measured rates, which DeepSeek-V3's run (held out, a lower bound)
    meets better than the scaled ones."""
    import math

    res = at_scale.table_3_residual()
    logs = [math.log1p(e) for e in res["megascale_error"]]
    assert abs(sum(logs) / len(logs)) < 0.01
    assert res["refit"] == pytest.approx(1.0, abs=0.01)
    assert all(abs(e) <= 0.15 for e in res["megatron_error"])
    ds = at_scale.deepseek_v3_h800()
    assert ds["h800"]["error"] > ds[at_scale.PAPER_CLUSTER]["error"]
    assert abs(ds["h800"]["error"]) < abs(ds[at_scale.PAPER_CLUSTER]["error"])


def test_a_kernel_scale_multiplies_the_profiles_kernel_rates_only(tmp_path):
    from plans import catalog
    from plans.errors import SpecError
    from plans.specs import KERNEL_FACTORS

    hopper = catalog.efficiency_profile("hopper", "test")
    base = (ROOT / "plans/catalog/clusters/h800-megascale.yaml").read_text()
    spec = tmp_path / "half.yaml"
    spec.write_text(base.replace("kernel_scale: 0.767", "kernel_scale: 0.5"))
    eff = catalog.load_cluster(str(spec), gpus=8).efficiency
    for k in KERNEL_FACTORS:
        assert getattr(eff, k) == pytest.approx(hopper[k] * 0.5)
    assert eff.gemm_launch_us == hopper["gemm_launch_us"]
    assert eff.grouped_gemm_stream_tb_s == hopper["grouped_gemm_stream_tb_s"]
    # the last: a scale with no profile to scale
    for i, bad in enumerate(("profile: hopper, kernel_scale: 0",
                             "profile: hopper, kernel_scale: yes",
                             "profile: hopper, kernel_scale: 3", "kernel_scale: 0.5")):
        spec = tmp_path / f"bad{i}.yaml"
        spec.write_text(base.replace("profile: hopper, kernel_scale: 0.767", bad))
        with pytest.raises(SpecError, match="efficiency.kernel_scale"):
            catalog.load_cluster(str(spec), gpus=8)


def test_the_papers_cluster_is_the_catalogs_h800_but_for_its_kernel_rates():
    """h800-megascale restates h800's hardware (the catalog has no base clusters): the two
    differ only in the kernel rates the scale multiplies and the source that says so."""
    from plans import catalog
    from plans.specs import KERNEL_FACTORS

    plain, paper = catalog.load_cluster("h800"), catalog.load_cluster("h800-megascale")
    for field in ("gpu", "node", "network", "gpus", "stage_time_cv"):
        assert getattr(plain, field) == getattr(paper, field), field
    scaled = {k: getattr(plain.efficiency, k) * 0.767 for k in KERNEL_FACTORS}
    assert {k: getattr(paper.efficiency, k) for k in KERNEL_FACTORS} == pytest.approx(scaled)
    assert plain.efficiency.model_copy(update=scaled) == paper.efficiency.model_copy(
        update=scaled)
