"""Plots where a picture reads better than a table (matplotlib, optional: `pip install
moeplan[plot]`): stacked step-time breakdowns (explain, compare, search), what-if studies (a
line over one knob, a heatmap over a grid of two) and scaling with its ideal."""

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


def breakdown_plot(rows, path: Path, title: str, force: bool) -> None:
    """One horizontal bar per plan, its step time stacked by breakdown component (ms), the
    first plan on top. ``rows``: (label, plan, evaluation)."""
    plt = _pyplot()
    keys = list(dict.fromkeys(k for _, _, e in rows for k in e.breakdown_s))
    labels = [f"{label}: {p.layout_notation()}" for label, p, _ in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(rows)))
    ys = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    colors = plt.get_cmap("tab20")
    for i, key in enumerate(keys):
        widths = [e.breakdown_s.get(key, 0.0) * 1e3 for _, _, e in rows]
        ax.barh(ys, widths, left=left, label=key, color=colors(i % 20))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(ys, [literal(t) for t in labels], fontsize=8)
    ax.set_xlabel("predicted ms per step")
    ax.set_title(literal(title), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path, force)
    plt.close(fig)


def _axes(points: list[Point]) -> list[tuple[str, list[str]]]:
    """The dimensions of a what-if grid: (name, values in order), the machines first."""
    dims: list[tuple[str, list[str]]] = []
    machines = list(dict.fromkeys(p.machine for p in points if p.machine is not None))
    if len(machines) > 1:
        dims.append(("machine", machines))
    for i, setting in enumerate(points[0].settings if points else ()):
        values = list(dict.fromkeys(p.settings[i].text for p in points))
        if len(values) > 1:
            dims.append((setting.knob.value, values))
    return dims


def _coordinate(p: Point, name: str) -> str:
    if name == "machine":
        return p.machine or ""
    return next(s.text for s in p.settings if s.knob.value == name)


def whatif_plot(points: list[Point], path: Path, title: str, force: bool) -> None:
    """A line over one varied dimension, a heatmap of the best plan's tokens/s over two
    (machines count as one), bars per point over more."""
    dims = _axes(points)
    if len(dims) == 2:
        _whatif_heatmap(points, dims, path, title, force)
    elif len(dims) == 1:
        _whatif_line(points, dims[0][0], path, title, force)
    else:
        _whatif_bars(points, path, title, force)


def _whatif_heatmap(points, dims, path: Path, title: str, force: bool) -> None:
    plt = _pyplot()
    (row_name, row_values), (col_name, col_values) = dims
    grid = [[float("nan")] * len(col_values) for _ in row_values]
    notes = [[""] * len(col_values) for _ in row_values]
    for p in points:
        r = row_values.index(_coordinate(p, row_name))
        c = col_values.index(_coordinate(p, col_name))
        if p.result.best is not None:
            grid[r][c] = p.result.best.evaluation.tokens_per_s
            notes[r][c] = (f"{grid[r][c]:,.0f}\n"
                           + p.result.best.plan.layout_notation().replace(" mbs", "\nmbs"))
        else:
            notes[r][c] = "does not fit"
    fig, ax = plt.subplots(figsize=(1.5 + 2.2 * len(col_values), 1.2 + 1.1 * len(row_values)))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    for r, row in enumerate(notes):
        for c, text in enumerate(row):
            ax.text(c, r, literal(text), ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks(range(len(col_values)), [literal(v) for v in col_values])
    ax.set_yticks(range(len(row_values)), [literal(v) for v in row_values])
    ax.set_xlabel(col_name)
    ax.set_ylabel(row_name)
    ax.set_title(literal(title), fontsize=9)
    fig.colorbar(image, ax=ax, label="best plan's predicted tokens/s")
    _save(fig, path, force)
    plt.close(fig)


def _whatif_bars(points: list[Point], path: Path, title: str, force: bool) -> None:
    plt = _pyplot()
    xs = list(range(len(points)))
    best = [p.result.best.evaluation.tokens_per_s if p.result.best else 0.0 for p in points]
    base = [p.result.baseline.evaluation.tokens_per_s if p.result.baseline else 0.0
            for p in points]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(points)), 4.5))
    ax.bar([x - 0.2 for x in xs], best, width=0.4, label="moeplan best plan")
    ax.bar([x + 0.2 for x in xs], base, width=0.4, label="Megatron-LM-style (TP in node)")
    ax.set_xticks(xs, [literal(p.label) for p in points], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(literal(title))
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, force)
    plt.close(fig)


def _whatif_line(points: list[Point], name: str, path: Path, title: str, force: bool) -> None:
    plt = _pyplot()
    xs = list(range(len(points)))
    labels = [_coordinate(p, name) for p in points]
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
    ax.set_xticks(xs, [literal(v) for v in labels])
    ax.set_xlabel(name)
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(literal(title))
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path, force)
    plt.close(fig)


def scale_plot(points: list[ScalePoint], path: Path, title: str, force: bool) -> None:
    """Tokens/s of the best plan and the baseline against the GPUs, with the ideal: the
    first count's best throughput growing in proportion to the GPUs; MFU beside."""
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
    start = next((p for p in points if p.result.best is not None), None)
    if start is not None:
        rate = start.result.best.evaluation.tokens_per_s / start.gpus
        ax1.plot(gpus, [rate * g for g in gpus], linestyle="--", color="gray",
                 label=f"ideal (linear from {start.gpus:,} GPUs)")
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
