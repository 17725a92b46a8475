"""bench/kernels/hopper_factors.py: the Hopper factors the catalog carries are the committed fit to
the H200 micro-benchmark sweep, and exactly the catalog's GH100 clusters carry them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from plans import Efficiency, catalog

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hopper():
    return importlib.import_module("bench.kernels.hopper_factors")


def test_committed_results_are_what_the_script_computes(hopper):
    committed = json.loads((ROOT / "bench/results/hopper_factors.json").read_text())
    fresh = json.loads(json.dumps(hopper.results()))
    assert {k: committed[k] for k in fresh} == fresh


def test_the_gh100_clusters_carry_the_fit_and_blackwell_as_its_prior(hopper):
    committed = json.loads((ROOT / "bench/results/hopper_factors.json").read_text())
    carried = committed["carried"]
    assert set(carried) == set(hopper.CARRIED)
    for name in hopper.HOPPER:
        eff = catalog.load_cluster(name).efficiency
        assert {k: getattr(eff, k) for k in carried} == carried, name
        # the eager memory-bound factor keeps the prior
        assert eff.elementwise == Efficiency().elementwise
    assert catalog.load_cluster("a100").efficiency == Efficiency()
    # Blackwell has no measurement: its prior is the same kernels' Hopper factors, but not
    # the sm90 grouped kernel's operand stream (its grouped GEMM keeps 128-row tiles)
    for name in ("b200", "gb200-nvl72", "gb300-nvl72"):
        cluster = catalog.load_cluster(name)
        prior = {k: v for k, v in carried.items() if k != "grouped_gemm_stream_tb_s"}
        assert {k: getattr(cluster.efficiency, k) for k in prior} == prior, name
        assert cluster.efficiency.grouped_gemm_stream_tb_s is None, name
        assert cluster.efficiency_source.kind == "prior", name


def test_the_fused_rate_is_the_device_time_of_the_fused_operators(hopper):
    """fused_elementwise is the fused operators' bytes over their device time (the host ahead)
    at every measured shape, and one call at a time would have carried the host's dispatch:
    lower at every shape, an order of magnitude at the 352B job's 1,024 tokens."""
    rate = json.loads((ROOT / "bench/results/hopper_factors.json").read_text())["fused_rate"]
    shapes = rate["per_shape"]
    assert set(shapes) == set(hopper.FUSED_SHAPES)
    assert min(s["device"] for s in shapes.values()) <= rate["fraction"] <= max(
        s["device"] for s in shapes.values())
    assert all(s["one_call"] < s["device"] for s in shapes.values())
    assert shapes["352b"]["one_call"] < shapes["352b"]["device"] / 5
    assert "router" not in rate["ops"]  # priced at elementwise under both kernel sets


def test_on_the_device_a_gemm_call_has_almost_no_fixed_time(hopper):
    """Fitted to device times (the host ahead), the dense GEMMs' fixed time per call is a few
    us, where one call on an idle GPU fitted tens (the host's dispatch)."""
    doc = json.loads((ROOT / "bench/results/hopper_factors.json").read_text())
    device_us = doc["carried"]["gemm_launch_us"]
    one_call_us, _ = doc["not_carried"]["gemm_launch_us, grouped_gemm_launch_us (one call)"][
        "fitted"]
    assert device_us < 5.0 and one_call_us > 4 * device_us


def test_the_host_dispatch_dominates_one_small_timed_call(hopper):
    """Why the fixed time per GEMM call is not carried: the sweep's smallest GEMM took more
    than twice what its FLOPs take at the fitted peak, tiles and waves included."""
    share = json.loads((ROOT / "bench/results/hopper_factors.json").read_text())["host_share"]
    assert share["measured_us"] > 2 * share["work_us"]
