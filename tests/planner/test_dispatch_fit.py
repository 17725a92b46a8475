"""Dispatch truth (issue 12, item 1): the planner's dispatcher against the committed sweep of
the runtime's two dispatchers on 2 H200s, and the fit of the eager dispatch's factors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_models.dispatch import ALL_GATHER, ALL_TO_ALL, LOCAL, eager_permutation
from planner import dispatch_fit as df
from plans import Dispatch, catalog

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "bench" / "results" / "h200" / "moe_layer" / "dispatch_sweep_x2.json"


@pytest.fixture(scope="module")
def sweep():
    return df.load(SWEEP)


@pytest.fixture(scope="module")
def choices(sweep):
    return df.choices(sweep, catalog.load_cluster("h200-runtime"), catalog.load_model(df.MODEL))


def test_the_sweep_covers_the_issue_grid(sweep):
    shapes = {(c.hidden, c.experts, c.tokens_per_rank) for c in sweep.configs}
    assert {h for h, _, _ in shapes} >= {2048, 4096}
    assert {e for _, e, _ in shapes} >= {8, 128}
    assert len({t for _, _, t in shapes}) >= 2
    assert all([r.top_k for r in c.rows] == list(range(1, 9)) for c in sweep.configs)


def test_the_planner_picks_the_faster_measured_dispatcher_at_every_point(choices):
    wrong = [(c.hidden, c.experts, c.tokens_per_rank, c.top_k) for c in choices
             if c.pick != c.faster]
    assert not wrong, wrong
    s = df.summary(choices)
    assert s["median_abs_error"] < 0.10
    assert s["over"] > 0 and s["under"] > 0  # no one-sided bias


def test_the_catalog_factors_are_the_fit_of_the_committed_sweep(sweep):
    """`moeplan calibrate --dispatch` sets them (tests/planner/test_calibrate.py derives
    h200-runtime): refitted on the cluster they are part of, they stay."""
    cluster = catalog.load_cluster("h200-runtime")
    f = df.fit_sweep(sweep, cluster)
    assert f.gather_scatter == pytest.approx(cluster.efficiency.gather_scatter, abs=1e-3)
    for d in df.SHORT:
        assert f.floors_us[d] == pytest.approx(cluster.efficiency.dispatch_floor_us.of(d),
                                               abs=5.0)


def test_the_fit_recovers_known_factors():
    gs, floors = 0.2, {Dispatch.all_to_all: 2e-3, Dispatch.allgather_reduce_scatter: 1.5e-3}
    pts = []
    for d in df.SHORT:
        for i in range(1, 30):
            p = df.Point(1024, 8, 1024, 1, d, 1.0, i * 1e-4, i * 2e-4, 0.5)
            pts.append(df.Point(1024, 8, 1024, 1, d, p.predicted_s(gs, floors[d]), p.collectives_s,
                                p.permutation_s, 0.5))
    f = df.fit(pts)
    assert f.gather_scatter == pytest.approx(gs, abs=1e-3)
    for d in df.SHORT:
        assert f.floors_us[d] == pytest.approx(floors[d] * 1e6, abs=5.0)
    assert f.max_abs_error < 0.01


def test_eager_passes_follow_the_runtime_dispatchers():
    assert eager_permutation(Dispatch.all_to_all, 1) is LOCAL
    assert eager_permutation(Dispatch.allgather_reduce_scatter, 1) is LOCAL
    assert eager_permutation(Dispatch.all_to_all, 2) is ALL_TO_ALL
    assert eager_permutation(None, 2) is ALL_GATHER  # expert TP
    # the all-to-all regroups the received rows and back: two more gathers and their scatters
    rows = lambda p: p.dispatch_fwd.routed + p.dispatch_bwd.routed + p.combine_fwd.routed \
        + p.combine_bwd.routed  # noqa: E731
    assert rows(ALL_TO_ALL) == rows(ALL_GATHER) + 12
    assert ALL_TO_ALL.host_sync and ALL_GATHER.host_sync and not LOCAL.host_sync


def test_the_dispatch_doc_is_current():
    from bench.layers import dispatch_report

    text, _ = dispatch_report.render()
    assert (ROOT / "docs" / "dispatch.md").read_text() == text
