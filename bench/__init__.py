"""Benchmarks writing typed results (plans/results.py), run as `python -m bench.GROUP.SCRIPT`."""
