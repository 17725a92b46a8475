"""torch.compile's on-disk caches, shared by every launch of every plan on a machine: a
relaunch of the same plan loads its compiled kernels instead of compiling them again.

Inductor keys its caches by the graph, its inputs' shapes and dtypes, the compiler's
configuration and torch's version, never by the plan or the run: one folder serves every
plan. What it holds (torch._inductor.codecache): the FX graph cache (the generated code of
every compiled region, ``fxgraph/``), AOTAutograd's cache (the forward and backward graphs of
a region, ``aotautograd/``), the Triton kernels' binaries (``triton/``) and the autotuner's
picks. torch turns these caches on by default and puts them under ``/tmp`` (lost on a reboot);
the runtime keeps them under the user's cache folder instead (``default_cache_dir``), or in the
folder ``--compile-cache`` (runtime.train, bench/steps/train_step.py) or ``TORCHINDUCTOR_CACHE_DIR``
names.

Dynamo still traces every region's Python on a relaunch (its bytecode analysis is not
cached); what the cache saves is the compilation behind it (lowering, code generation, the
C++ / Triton compiler), most of a first step's time.
"""

from __future__ import annotations

import os
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where torch._inductor.runtime.cache_dir_utils.cache_dir looks (read at each compile)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moeplan/torch_compile`` (``~/.cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeplan" / "torch_compile"


def use_cache_dir(folder: Path | None = None) -> Path:
    """Point torch.compile's caches at ``folder`` (created), before the process compiles
    anything; None keeps a TORCHINDUCTOR_CACHE_DIR the environment sets, else
    ``default_cache_dir``. Returns the folder in use. The environment variable is what
    inductor reads, and ranks started from this process (torchrun's workers) inherit it."""
    if folder is None:
        folder = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else (
            default_cache_dir())
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(folder)
    return folder


@dataclass(frozen=True)
class CacheCounts:
    """Compiled graphs this process loaded from the cache (``hits``) and compiled (``misses``)
    so far: inductor's FX graph cache counters (torch._dynamo.utils.counters["inductor"]), one
    per forward or backward graph of a region; and AOTAutograd's cache of whole regions
    (counters["aot_autograd"]: one per region, its forward and backward graphs together;
    ``aot_bypasses``: regions the cache cannot store, compiled every launch)."""

    hits: int = 0
    misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    aot_bypasses: int = 0

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def cache_counts() -> CacheCounts:
    """The process's FX graph and AOTAutograd cache counts so far."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return CacheCounts(int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"]),
                       int(aot["autograd_cache_hit"]), int(aot["autograd_cache_miss"]),
                       int(aot["autograd_cache_bypass"]))


COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "build_guards",
                  "OutputGraph.call_user_compiler", "create_aot_dispatcher_function",
                  "compile_fx_inner", "PyCodeCache.load_by_key_path", "async_compile.wait")
"""The phases of torch.compile that split a first step's time: Dynamo's tracing and guards,
then the compiler behind it (AOTAutograd, inductor, loading the generated modules, waiting
for the Triton compiler)."""


def compile_phases() -> dict[str, float]:
    """Seconds this process spent so far in each of COMPILE_PHASES that ran
    (torch._dynamo.utils.compile_times, summed over its calls)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    spent = dict(zip(names, (float(v) for v in values), strict=True))
    return {name: spent[name] for name in COMPILE_PHASES if name in spent}
