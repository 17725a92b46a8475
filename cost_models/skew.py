"""Expert load imbalance: how much more than the mean the busiest expert-parallel rank gets.

The grouped GEMMs of an EP group end when its busiest rank's do, and under all-to-all the
busiest rank receives the most rows, so a layer is paced by the busiest rank's load, not the
mean (the reason for the paper's Sec. 3.2 device-level balance loss).

Model: the E experts' loads in one micro-batch's EP group vary independently around the mean
mu_e with a coefficient of variation sigma, made of

- sampling: even a router balanced on average assigns the R routed copies at random, so an
  expert's load is binomial: sigma_s^2 = (1 - 1/E) / mu_e;
- a skewed router (``TrainingSpec.routing_skew`` = s, max / mean tokens per expert, as the
  runtime logs it): the expected maximum of E loads is about mu_e (1 + sigma_r sqrt(2 ln E))
  (the Gaussian extreme-value bound, e.g. Cramér, Mathematical Methods of Statistics, 1946,
  Sec. 28.6), so sigma_r = (s - 1) / sqrt(2 ln E).

A rank holds g = E / ep experts: its load has a CV of sigma / sqrt(g), and the busiest of the
ep ranks carries 1 + sigma / sqrt(g) x sqrt(2 ln ep) of the mean. With one expert per rank
that is s (plus sampling); with one rank, 1. Capacity-padded experts (a capacity factor)
compute their full buffers whatever the routing, so imbalance does not slow them.
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
    sampling = (1 - 1 / experts) / per_expert
    router = ((routing_skew - 1) / _extreme(experts)) ** 2 if experts > 1 else 0.0
    cv = math.sqrt(sampling + router)
    return 1.0 + cv / math.sqrt(experts / ep) * _extreme(ep)
