"""Plots for what-if and scaling studies (matplotlib, optional: `pip install moeplan[plot]`)."""

from __future__ import annotations

import io
from pathlib import Path

from planner.scale import ScalePoint
from planner.whatif import Point
from plans import SpecError
from plans.io import check_destination, write_atomic


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--plot: needs matplotlib (pip install 'moeplan[plot]')") from None
    return plt


def check_plot_path(path: Path, force: bool) -> None:
    """Refuse a plot path before any work is done: the suffix, and what `write_atomic` checks
    (an existing file without --force, a directory, a FIFO, a missing folder)."""
    if path.suffix.lower() not in (".png", ".svg"):
        raise SpecError(f"--plot: {path.name} must end in .png or .svg")
    check_destination(path, "--plot", force)


def literal(text: str) -> str:
    """``text`` as matplotlib shows it literally: ``$`` would start mathtext (and an unpaired
    one raise)."""
    return text.replace("$", r"\$")


def _save(fig, path: Path, force: bool) -> None:
    check_plot_path(path, force)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lower().lstrip("."), dpi=120, bbox_inches="tight")
    write_atomic(path, buffer.getvalue(), "--plot", force)


def whatif_plot(points: list[Point], path: Path, title: str, force: bool) -> None:
    plt = _pyplot()
    knobs = {s.knob for p in points for s in p.settings}
    single = len(knobs) == 1
    xs = list(range(len(points)))
    labels = [p.label.split("=", 1)[1] if single else p.label for p in points]
    best = [p.result.best.evaluation.tokens_per_s if p.result.best else float("nan")
            for p in points]
    base = [p.result.baseline.evaluation.tokens_per_s if p.result.baseline else float("nan")
            for p in points]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, best, marker="o", label="moeplan best plan")
    ax.plot(xs, base, marker="s", label="Megatron-LM-style (TP in node)")
    for x, p, y in zip(xs, points, best, strict=True):
        if p.result.best is not None:
            ax.annotate(p.result.best.plan.layout_notation(), (x, y), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=7)
    ax.set_xticks(xs, labels, rotation=30 if not single else 0)
    ax.set_xlabel(next(iter(knobs)).value if single else "setting")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(literal(title))
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path, force)
    plt.close(fig)


def scale_plot(points: list[ScalePoint], path: Path, title: str, force: bool) -> None:
    plt = _pyplot()
    gpus = [p.gpus for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series = (("moeplan best", lambda r: r.best), ("Megatron-style", lambda r: r.baseline))
    for label, pick in series:
        tps = [pick(p.result).evaluation.tokens_per_s if pick(p.result) else float("nan")
               for p in points]
        mfu = [pick(p.result).evaluation.mfu if pick(p.result) else float("nan") for p in points]
        ax1.plot(gpus, tps, marker="o", label=label)
        ax2.plot(gpus, mfu, marker="o", label=label)
    ax1.set_xlabel("GPUs")
    ax1.set_ylabel("predicted tokens/s")
    ax2.set_xlabel("GPUs")
    ax2.set_ylabel("MFU")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(literal(title))
    _save(fig, path, force)
    plt.close(fig)
