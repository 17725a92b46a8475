"""Modules that stand in for another at its place in the model, so that a transform of the
plan (recomputation, gradient-accumulation fusion, timers) changes how a module runs without
patching it.

A wrapper holds the wrapped module's parameters, buffers, sub-modules and hooks as its own
(the same registries, not copies): parameter names and state_dict keys stay those of the plain
model, so checkpoints load across transforms. Its other attributes are read from the wrapped
module. ``forward`` runs ``inner.forward`` (the hooks already ran, once, on the wrapper)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.moe import activation_kept
from runtime.parallel.recompute import activation_recomputed


class InPlaceOf(nn.Module):
    """The base: ``inner``'s registries as this module's; ``inner`` itself is no child."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        for name, value in vars(inner).items():
            if name.startswith("_") and isinstance(value, (dict, set)):
                object.__setattr__(self, name, value)
        self.training = inner.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)

    def train(self, mode: bool = True) -> InPlaceOf:
        self.inner.train(mode)
        return super().train(mode)


def chain(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and, through its wrappers, the module it stands in for."""
    while True:
        yield module
        if not isinstance(module, InPlaceOf):
            return
        module = module.inner


def plain(module: nn.Module) -> nn.Module:
    """The model's own module under its wrappers."""
    return list(chain(module))[-1]


def replace(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at ``name`` (a dotted path below ``root``, not ``root`` itself)."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, new)


class Recomputed(InPlaceOf):
    """Recompute ``inner`` in backward instead of keeping its activations."""

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner.forward, *args, use_reentrant=False, **kwargs)


class Accumulating(InPlaceOf):
    """A module whose weights' GEMMs add their gradients into the main gradients
    (runtime.parallel.grad_accumulation)."""


class AccumulatingLinear(Accumulating):
    """A bias-free Linear through ``product(weight, x)``."""

    def __init__(self, inner: nn.Linear, product: Callable):
        super().__init__(inner)
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(self.weight, x)


class AccumulatingExperts(Accumulating):
    """Grouped experts (runtime.moe.GroupedExperts) through another ``matmul``."""

    def __init__(self, inner: nn.Module, matmul: Callable):
        super().__init__(inner)
        self.matmul = matmul

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                activation: Callable = activation_kept) -> torch.Tensor:
        return self.inner.forward(x, counts, self.matmul, activation)


class ActivationRecomputed(InPlaceOf):
    """Grouped experts (runtime.moe.GroupedExperts, or their accumulating form) whose
    activation's output is freed after fc2's forward and rerun in backward
    (runtime.parallel.recompute)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(x, counts, activation=activation_recomputed)


class Timed(InPlaceOf):
    """``inner``'s forward (and its backward) run inside ``timed(fn, *args)``."""

    def __init__(self, inner: nn.Module, timed: Callable):
        super().__init__(inner)
        self.timed = timed

    def forward(self, *args):
        return self.timed(self.inner.forward, *args)
