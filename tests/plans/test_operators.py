"""The named layer operators, timer components and recomputation sets (plans.operators)."""

from __future__ import annotations

from plans import (
    COMPONENT_KEYS,
    LAYER_REGIONS,
    RECOMPUTED,
    TIMER_OF,
    Component,
    LayerOperator,
    Recompute,
)


def test_every_operator_has_one_timer_region_and_every_layer_region_operators():
    assert set(TIMER_OF) == set(LayerOperator)
    assert set(TIMER_OF.values()) == {*LAYER_REGIONS, Component.forward}
    assert TIMER_OF[LayerOperator.flash_attn] == Component.attention_core
    assert TIMER_OF[LayerOperator.ep_dispatch] == Component.dispatch
    assert TIMER_OF[LayerOperator.attn_norm] == Component.forward


def test_component_keys_are_the_components_and_the_layer_regions_backward():
    assert len(set(COMPONENT_KEYS)) == len(COMPONENT_KEYS)
    assert set(COMPONENT_KEYS) == {c.value for c in Component} | {
        f"{c.value}_bwd" for c in LAYER_REGIONS}


def test_recompute_levels_are_nested_operator_sets():
    assert set(RECOMPUTED) == set(Recompute)
    none, sel, full = (RECOMPUTED[r] for r in (Recompute.none, Recompute.selective,
                                               Recompute.full))
    assert none == frozenset() and full == frozenset(LayerOperator)
    assert none < sel < full
    assert sel == {LayerOperator.rope, LayerOperator.flash_attn}  # the attention core
