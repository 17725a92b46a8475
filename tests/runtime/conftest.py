import os
import subprocess
import sys
from pathlib import Path

import pytest

# the runtime tests import dist_workers (and the pools, tests/conftest.py, dist_pool) from here
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def train_here(capsys, monkeypatch):
    """``python -m runtime.train ARGS`` as rank 0 of ``world`` run in this process (no worker
    to start, no torch to import again; one rank trains without a process group), one thread
    like the pools' ranks and the launches under OMP_NUM_THREADS=1, so its steps are
    bit-identical to theirs. Returns the exit code and output as a CompletedProcess."""
    import torch

    from runtime.memory import ALLOCATOR_CONF
    from runtime.train import main

    # main sets it if unset (configure_allocator); restored afterwards
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF",
                       os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(*args: str, world: int = 1) -> subprocess.CompletedProcess:
        assert world == 1 or "--check" in args, "several ranks train in a pool, not here"
        for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world), ("RANK", 0),
                            ("LOCAL_RANK", 0)):
            monkeypatch.setenv(name, str(value))
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["runtime.train", *args], code, out.out, out.err)

    yield run
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles as a fresh process would: dynamo keeps its graphs per function across
    tests, and the fused kernels' regions (one graph per width and dtype of RMSNorm, ...) summed
    over the whole suite would pass its recompile limit, a hard failure under fullgraph."""
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture
def python():
    """``python ARGS`` from the repository root (a runtime command, a launch under torchrun),
    one thread a process, its output captured."""
    root = Path(__file__).resolve().parents[2]

    def run(*args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                              timeout=timeout)
    return run


@pytest.fixture
def smoke_run(python, tmp_path):
    """``moeplan COMMAND --smoke ARGS --out F`` (a measurement on CPU processes), then the same
    onto F again: the first writes F, which is returned; the second is refused in one line."""

    def run(command: str, *args: str) -> Path:
        out = tmp_path / f"{command}.json"
        cmd = ("-m", "planner.cli", command, "--smoke", *args, "--out", str(out))
        r = python(*cmd)
        assert r.returncode == 0, r.stdout + r.stderr
        again = python(*cmd)
        assert again.returncode == 2 and again.stderr.strip().splitlines() == [
            f"error: --out: {out} exists; pass --force to replace it"]
        return out
    return run
