"""The allocator-history replay behind ``bench/steps/train_step.py --memory-timeline``
(runtime.memory.replay_history), on a synthetic history: which stream's pages are mapped, what
is allocated and still pending when the reserved bytes peak, and who allocated what is live."""

from runtime.memory import GIB, REPOSITORY, memory_timeline, replay_history

MIB = 2**20
CUR, SIDE = 7, 9


def _frames(path: str, line: int) -> list[dict]:
    """A torch frame (a path with the same tail outside the repository) above ours."""
    return [{"filename": f"/opt/venv/lib/torch/{path}", "line": 1},
            {"filename": f"{REPOSITORY}/{path}", "line": line}]


def test_the_replay_keeps_the_state_where_the_reserved_bytes_first_peak():
    trace = [
        {"action": "segment_map", "size": 100 * MIB, "addr": 0, "stream": CUR},
        {"action": "alloc", "size": 60 * MIB, "addr": 1, "stream": CUR,
         "frames": _frames("runtime/moe.py", 181)},
        {"action": "alloc", "size": 30 * MIB, "addr": 2, "stream": CUR,
         "frames": _frames("runtime/kernels.py", 42)},
        # freed by its owner while the side stream still reads it: allocated drops, active not
        {"action": "free_requested", "size": 30 * MIB, "addr": 2, "stream": CUR},
        # a request no hole fits: the side stream maps pages of its own
        {"action": "segment_map", "size": 40 * MIB, "addr": 3, "stream": SIDE},
        {"action": "alloc", "size": 40 * MIB, "addr": 4, "stream": SIDE,
         "frames": _frames("runtime/parallel/overlap.py", 200)},
        {"action": "free_completed", "size": 30 * MIB, "addr": 2, "stream": CUR},
        {"action": "free_requested", "size": 40 * MIB, "addr": 4, "stream": SIDE},
        {"action": "free_completed", "size": 40 * MIB, "addr": 4, "stream": SIDE},
        {"action": "segment_unmap", "size": 40 * MIB, "addr": 3, "stream": SIDE},
        {"action": "oom", "size": 0, "addr": 0, "stream": CUR},  # not replayed
    ]
    base = 10 * MIB
    r = replay_history(trace, base, {CUR: 20 * MIB}, CUR)
    gib = MIB / GIB
    assert r["reserved_peak_gib"] == 160 * gib
    assert r["reserved_at_peak_gib_by_stream"] == {"current": 120 * gib, str(SIDE): 40 * gib}
    # at that peak: base + 60 allocated before the side stream's block, 30 pending a free
    assert r["allocated_at_peak_gib"] == (base / MIB + 60) * gib
    assert r["active_at_peak_gib"] == (base / MIB + 90) * gib
    assert r["allocated_peak_gib"] == (base / MIB + 100) * gib
    assert r["step_allocations_live_at_peak_gib"] == 60 * gib
    assert r["live_at_peak_gib_by_source"] == {"runtime/moe.py:181": 60 * gib}


def test_off_cuda_there_is_no_timeline():
    import torch

    ran = []
    assert memory_timeline(lambda: ran.append(1), torch.device("cpu")) == {}
    assert ran == []
