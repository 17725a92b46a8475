"""A reusable pool of gloo worker processes: one process group per pool, tasks named by
(module, function) so spawned workers import them from this directory."""

from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

HERE = Path(__file__).parent
TASK_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from runtime.parallel.mesh import start_process_group

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    start_process_group(rank, world, torch.device("cpu"), timedelta(seconds=60),
                        f"tcp://127.0.0.1:{port}")
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
            continue  # the pool is closed after a failure
        _release_groups()
    dist.destroy_process_group()


def _release_groups() -> None:
    """Free what a task's trainers held, once every rank is done with it: their parameters'
    post-accumulate hooks sit in torch's C++ tensors, where the cycle collector does not see
    them, so every trainer (its parameters, buffers and process groups) outlived its task; then
    shut the task's process groups down. Each open gloo group keeps three threads and its TCP
    loop polling: after the parity tests a pool held ~190 groups per rank, and its idle ranks
    took about a core of a 2-core machine from every later test."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    dist.barrier()
    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weakref.proxy (torch.compile keeps some) raises
        if issubclass(type(obj), torch.Tensor) and getattr(obj, "_post_accumulate_grad_hooks",
                                                           None):
            obj._post_accumulate_grad_hooks.clear()
    gc.collect()
    for pg in [pg for pg in _world.pg_map if pg is not dist.GroupMember.WORLD]:
        dist.destroy_process_group(pg)


class DistPool:
    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self._start()

    def _start(self) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results))
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, module: str, name: str, *args) -> list:
        """Run ``module.name(*args)`` on every rank; results in rank order."""
        if not self.procs or any(not p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.tasks:
            q.put((module, name, args))
        out: dict[int, object] = {}
        errors = []
        try:
            for _ in range(self.world):
                rank, ok, value = self.results.get(timeout=TASK_TIMEOUT_S)
                (out.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
        except queue.Empty:
            errors.append(f"timed out after {TASK_TIMEOUT_S} s; ranks done: {sorted(out)}")
        if errors:
            self.close()  # a failed collective leaves the group unusable
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
