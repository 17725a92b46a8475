"""The stage split against brute force: the slowest stage over every split of small cases,
and the end stages' layers over every pair on random larger ones."""

import itertools

import pytest

from planner.staging import SplitCosts, split_layers


def slowest(split, pp, costs):
    chunks = len(split)
    worst = 0.0
    for s in range(pp):
        mine = range(s, chunks, pp)
        t = sum(split[c] for c in mine) * costs.layer_s
        t += costs.embedding_s if 0 in mine else 0
        t += costs.head_s if chunks - 1 in mine else 0
        worst = max(worst, t)
    return worst


def brute_force(layers, pp, vpp, costs):
    chunks = pp * vpp
    best = None
    for split in itertools.product(range(1, layers + 1), repeat=chunks):
        if sum(split) == layers:
            t = slowest(split, pp, costs)
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("layers,pp,vpp", [(8, 4, 1), (10, 3, 1), (12, 2, 2), (9, 4, 1), (8, 2, 3)])
@pytest.mark.parametrize("head", [0.0, 1.0, 2.5])
def test_the_split_is_optimal(layers, pp, vpp, head):
    costs = SplitCosts(layer_s=1.0, embedding_s=0.2, head_s=head)
    split = split_layers(layers, pp, vpp, costs)
    assert len(split) == pp * vpp and sum(split) == layers and min(split) >= 1
    assert slowest(split, pp, costs) == pytest.approx(brute_force(layers, pp, vpp, costs))


def test_heavy_head_moves_layers_off_the_last_stage():
    split = split_layers(60, 15, 1, SplitCosts(layer_s=1.0, embedding_s=0.1, head_s=2.0))
    assert split[-1] < split[0]
    assert sum(split) == 60


def test_dense_layers_stay_in_the_first_chunk():
    split = split_layers(8, 4, 1, SplitCosts(1.0, 0.0, 0.0, dense_extra_s=0.0), dense_layers=3)
    assert split[0] >= 3


def test_too_many_chunks_refused():
    with pytest.raises(ValueError, match=r"pp x vpp \(4 x 3 = 12\) exceeds model.layers \(8\)"):
        split_layers(8, 4, 3, SplitCosts(1.0, 0.0, 0.0))


def test_dense_layers_that_leave_a_chunk_empty_are_one_line():
    # 4 layers, 3 of them dense, over pp 2 x vpp 2: the first chunk holds 3, three chunks remain
    with pytest.raises(ValueError, match=r"model.layers \(4\).*3 dense layers, need 6"):
        split_layers(4, 2, 2, SplitCosts(1.0, 0.0, 0.0), dense_layers=3)
    assert split_layers(4, 2, 1, SplitCosts(1.0, 0.0, 0.0), dense_layers=3) == (3, 1)


def test_search_skips_splits_the_dense_layers_cannot_fill(tmp_path):
    """A 4-layer model with 3 dense layers on 4 GPUs: the search offers only splits its
    layers fill (no pp 4, no interleaving), never a solver failure."""
    from planner.search import search
    from plans import TrainingSpec, catalog

    model = catalog.load_model("tiny-moe").model_copy(
        update={"dense_layers": 3, "dense_ffn_hidden": 128})
    result = search(model, catalog.load_cluster("h200", gpus=4),
                    TrainingSpec(global_batch=8, seq_len=256), top=50)
    assert result.top
    for r in result.top:
        assert r.plan.stage_layers[0] >= 3 and min(r.plan.stage_layers) >= 1


def exact_ends(layers, pp, vpp, dense, first_extra, last_extra, grain):
    """Every (n_first, n_last) the stages allow, by (slowest stage, fewest layers on the
    middle stages, fewest on the first)."""
    middle, least_first = pp - 2, max(vpp, dense + vpp - 1)
    best = None
    for n_first in range(least_first, layers + 1):
        for n_last in range(vpp, layers - n_first + 1):
            rest = layers - n_first - n_last
            if (middle == 0 and rest) or rest < middle * vpp:
                continue
            n, k = divmod(rest, middle) if middle else (0, 0)
            slowest = max(n_first * grain + first_extra, n_last * grain + last_extra,
                          (n + (k > 0)) * grain if middle else 0)
            key = (slowest, -(n_first + n_last), n_first)
            best = key if best is None or key < best else best
    return best[2], -best[1] - best[2]


def test_the_end_stages_are_the_exact_optimum():
    """The closed form (planner.staging._ends) against every pair of end-stage counts."""
    import random

    from planner.staging import _COST_GRAIN, _ends, least_layers

    rng = random.Random(7)
    checked = 0
    for _ in range(600):
        layers = rng.choice([8, 12, 27, 32, 48, 60, 61, 64, 94, 95])
        pp, vpp, dense = rng.randint(2, 20), rng.randint(1, 4), rng.choice([0, 1, 3])
        if pp * vpp > layers or least_layers(pp, vpp, dense) > layers:
            continue
        case = (layers, pp, vpp, dense, rng.randint(-12, 40), rng.randint(-12, 40))
        assert _ends(*case) == exact_ends(*case, round(1 / _COST_GRAIN)), case
        checked += 1
    assert checked > 300
