"""The two-stream list scheduler: its back-to-back case agrees with the general one."""

import random

import pytest

from cost_models.schedule import Stream, Task, list_schedule

COMPUTE = frozenset({Stream.compute})
BOTH = frozenset(Stream)


def _serial_dag(rng: random.Random, n: int) -> list[Task]:
    """Tasks that all hold the compute stream (compute, or blocking communication), each
    after up to three earlier ones, some of zero duration, some marked first."""
    tasks = []
    for i in range(n):
        preds = tuple(sorted(rng.sample(range(i), min(i, rng.randint(0, 3)))))
        comm = rng.random() < 0.3
        duration = 0.0 if rng.random() < 0.1 else rng.choice((1.0, 2.0, 0.5, rng.random()))
        tasks.append(Task(f"op{i % 7}", duration, BOTH if comm else COMPUTE, preds,
                          "ep_dispatch" if comm else None, rng.random() < 0.2))
    return tasks


@pytest.mark.parametrize("seed", range(40))
def test_back_to_back_tasks_schedule_as_the_general_case_does(seed):
    # a communication-only task of no duration, ready at once and followed by nothing, sends
    # the scheduler down its general path without moving any other task
    tasks = _serial_dag(random.Random(seed), 25)
    serial = list_schedule(tasks)
    general = list_schedule([*tasks, Task("probe", 0.0, frozenset({Stream.comm}), (), "x")])
    n = len(tasks)
    assert serial.start_s == general.start_s[:n]
    assert serial.exposed_s == general.exposed_s[:n]
    assert serial.makespan_s == general.makespan_s
    assert serial.makespan_s == pytest.approx(sum(t.duration_s for t in tasks))
    assert serial.critical_path == general.critical_path
