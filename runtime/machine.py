"""Does this machine hold the ranks a plan launches here? Checked by ``runtime.train --check``
(which ``moeplan train`` runs before torchrun) so that a plan too big for the machine is refused
in one line instead of starting its workers.

- On CUDA: the local ranks need one GPU each, each with the plan's predicted peak free
  (``runtime.memory.check_fits``, which every rank runs again before its first step).
- On CPU: every local rank holds what the plan predicts for one GPU (``prediction.peak_memory_gib``;
  on CPU the runtime keeps fp32 parameters as their own masters, about the bytes the cost model
  counts for bf16 weights plus fp32 masters) plus the process itself; the sum must fit in the
  memory the kernel reports available (``MemAvailable`` in /proc/meminfo).
"""

from __future__ import annotations

from pathlib import Path

import torch

from plans import Plan, SpecError
from runtime.memory import check_fits

CPU_RANK_OVERHEAD_GIB = 0.3
"""One CPU rank before its model: Python, torch and gloo (measured: 0.21 GiB for importing torch
and torch.distributed, maximum resident set size, on this CI machine)."""
MEMINFO = Path("/proc/meminfo")


def available_gib() -> float | None:
    """MemAvailable in GiB, or None where the kernel does not say (not Linux)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError, IndexError):
        return None
    return None


def rank_gib(plan: Plan) -> float:
    """Memory one CPU rank needs: the plan's predicted peak (when the plan carries a prediction;
    otherwise its share of fp32 weights, gradients and AdamW states, 16 B per parameter) plus the
    process."""
    if plan.prediction is not None:
        states = plan.prediction.peak_memory_gib
    else:
        states = 16 * plan.model.total_params / plan.degrees.world / 2**30
    return states + CPU_RANK_OVERHEAD_GIB


def check_machine(plan: Plan, local_ranks: int) -> None:
    """Refuse (SpecError, one line) ``local_ranks`` ranks of ``plan`` this machine cannot run."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            raise SpecError(f"--nproc-per-node: {local_ranks} ranks on this machine, which has "
                            f"{gpus} GPU{'s' if gpus != 1 else ''}")
        for i in range(local_ranks):  # the predicted peak against each GPU's free memory
            check_fits(plan, torch.device("cuda", i))
        return
    free = available_gib()
    need = local_ranks * rank_gib(plan)
    if free is not None and need > free:
        raise SpecError(f"degrees: {local_ranks} CPU ranks of this plan need about {need:,.1f} "
                        f"GiB ({rank_gib(plan):,.2f} GiB each: the predicted peak plus the "
                        f"process), this machine has {free:,.1f} GiB available")
