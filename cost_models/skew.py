"""Expert load imbalance: how much more than the mean the busiest expert-parallel rank gets.

The grouped GEMMs of an EP group end when its busiest rank's do, and under all-to-all the
busiest rank receives the most rows, so a layer is paced by the busiest rank's load, not the
mean (the paper's Sec. 3.2 balance loss exists for this reason). Two causes are priced:

- sampling: even a router that is balanced on average assigns a micro-batch's routed copies
  at random; a rank's load is then binomial with mean mu = R / n (R routed copies in the
  group, n ranks) and standard deviation sqrt(mu (1 - 1/n)), and the expected maximum of n
  such loads is about mu + sd sqrt(2 ln n) (the Gaussian extreme-value bound, e.g. Cramér,
  Mathematical Methods of Statistics, 1946, Sec. 28.6).
- a skewed router (``TrainingSpec.routing_skew`` = s, max / mean tokens per expert, as the
  runtime logs it): the busiest rank holds the hottest expert and its other E/n - 1 experts
  carry the mean load, so the rank's load is (s + E/n - 1) / (E/n) = 1 + (s - 1) n / E of the
  mean.

The larger of the two paces the layer. Capacity-padded experts (a capacity factor) compute
their full buffers whatever the routing, so imbalance does not slow them.
"""

from __future__ import annotations

import math


def sampling_skew(routed: float, ranks: int) -> float:
    """Expected max / mean load of ``ranks`` equal shares of ``routed`` random copies."""
    if ranks <= 1 or routed <= 0:
        return 1.0
    mu = routed / ranks
    return 1.0 + math.sqrt(mu * (1 - 1 / ranks)) * math.sqrt(2 * math.log(ranks)) / mu


def rank_skew(routed: float, experts: int, ep: int, routing_skew: float,
              capacity_factor: float | None) -> float:
    """Busiest EP rank's routed rows / the mean, for ``routed`` copies in one EP group of
    ``ep`` ranks holding ``experts`` / ep experts each."""
    if capacity_factor is not None or ep <= 1:
        return 1.0
    router = 1.0 + (routing_skew - 1.0) * ep / experts
    return max(router, sampling_skew(routed, ep))
