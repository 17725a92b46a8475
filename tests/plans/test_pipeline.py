"""The in-flight peak's closed form against the stage's action list."""

import pytest

from plans.pipeline import peak_in_flight_chunks, stage_actions


def walked_peak(pp, vpp, m, stage):
    held = peak = 0
    for a in stage_actions(pp, vpp, m, stage):
        held += 1 if a.forward else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
def test_peak_in_flight_is_the_action_lists_peak(pp, vpp):
    for m in range(1, 40):
        if vpp > 1 and m % pp:
            continue  # interleaving needs a multiple of pp (Plan)
        for stage in range(pp):
            assert peak_in_flight_chunks(pp, vpp, m, stage) == walked_peak(pp, vpp, m, stage)
