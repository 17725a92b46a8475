"""Developer tools run from the repository root as `python -m tools.NAME`."""
