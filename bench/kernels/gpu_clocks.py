"""Run a benchmark with the GPU's clocks and power sampled beside it.

    python -m bench.kernels.gpu_clocks --csv OUT.csv [--interval-ms 250] -- python3 -m bench.X
    ARGS...

nvidia-smi samples, every ``--interval-ms``, the SM clock and its maximum, the power draw and
limit, the temperature and the active clock-event reasons (bit 0x4: the software power cap)
into ``--csv`` while the command runs; the command's exit status is this script's. Where
nvidia-smi is missing (CPU machines) the command runs alone and the CSV says why in its one
line. Used by campaign ``h200_layers`` (docs/performance.md: why the Mixtral-shaped
layer's GEMMs run at the rate they do).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from bench._meta import bad_input

FIELDS = ("timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,"
          "clocks_event_reasons.active")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", required=True, type=Path, help="the samples (written as they come)")
    p.add_argument("--interval-ms", type=int, default=250)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark's command line")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return bad_input("command: give the benchmark to run after --")
    if args.interval_ms <= 0:
        return bad_input("--interval-ms: must be positive")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        args.csv.write_text("unavailable: no nvidia-smi on this machine\n")
        return subprocess.call(command)
    with args.csv.open("w") as out:
        sampler = subprocess.Popen(
            [smi, f"--query-gpu={FIELDS}", "--format=csv", f"--loop-ms={args.interval_ms}"],
            stdout=out, stderr=subprocess.DEVNULL)
        try:
            return subprocess.call(command)
        finally:
            sampler.terminate()
            sampler.wait()


if __name__ == "__main__":
    sys.exit(main())
