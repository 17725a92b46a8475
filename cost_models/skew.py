"""Expert load imbalance: how much more than the mean the busiest expert-parallel rank gets.

The grouped GEMMs of an EP group end when its busiest rank's do, and under all-to-all the
busiest rank receives the most rows, so a layer is paced by the busiest rank's load, not the
mean (the reason for the paper's Sec. 3.2 device-level balance loss).

Model: the busiest rank's load over the mean is 1 plus two excesses,

- sampling: even a router balanced on average assigns the R routed copies at random, so an
  expert's load is binomial, with a CV of sigma_s = sqrt((1 - 1/E) / mu_e) around the mean
  mu_e; a rank of g = E / ep independent experts has a CV of sigma_s / sqrt(g), and the
  busiest of the ep ranks is sqrt(2 ln ep) deviations above the mean (the Gaussian
  extreme-value bound, e.g. Cramér, Mathematical Methods of Statistics, 1946, Sec. 28.6);
- a skewed router (``TrainingSpec.routing_skew`` = s, max / mean tokens per expert, as the
  runtime logs it): the least spread loads with that maximum, one expert at s mu_e and the
  other E - 1 sharing the rest equally. The hot expert's rank then carries
  1 + (s - 1) (E - g) / (g (E - 1)) of the mean: s with one expert per rank, 1 with one rank.

Why not the Gaussian bound for the router too (every expert's load spread with the CV whose
expected maximum over E is s, sigma_r = (s - 1) / sqrt(2 ln E)): the logged maximum is one
expert's, and the measured ranks do not spread that way. In the fidelity suite's seven 2-GPU
EP runs (bench/results/h200/fidelity/train_step_*.json, components_s_per_rank) the busiest
rank's expert_compute (forward + backward) is 1.01-1.04 of the ranks' mean at logged skews of
1.5 to 13.1, where the Gaussian bound derives 1.16-1.57 and this one 1.07-1.12 (sampling
alone: 1.005-1.012). Those timers, like the routed rows the runtime now counts per rank
(``ep_rank_load_step``: 1.014-1.032), sum every layer of the step, so they bound the per-layer
imbalance from below: different layers' hot experts sit on different ranks and average out.
The per-layer count (``ep_rank_load_layer``) is what a layer is paced by; its measurement
decides between the two derivations.

Capacity-padded experts (a capacity factor) compute their full buffers whatever the routing,
so imbalance does not slow them.
"""

from __future__ import annotations

import math


def _extreme(n: int) -> float:
    """Expected maximum of n standard normal draws, to first order: sqrt(2 ln n)."""
    return math.sqrt(2 * math.log(n)) if n > 1 else 0.0


def rank_skew(routed: float, experts: int, ep: int, routing_skew: float,
              capacity_factor: float | None) -> float:
    """Busiest EP rank's routed rows / the mean, for ``routed`` copies in one EP group of
    ``ep`` ranks holding ``experts`` / ep experts each."""
    if capacity_factor is not None or ep <= 1 or routed <= 0:
        return 1.0
    per_expert = routed / experts
    local = experts / ep
    sampling = math.sqrt((1 - 1 / experts) / per_expert) / math.sqrt(local) * _extreme(ep)
    hot = (routing_skew - 1) * (experts - local) / (local * (experts - 1)) if experts > 1 else 0.0
    return 1.0 + hot + sampling
