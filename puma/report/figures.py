"""The report's figures as PNG bytes, drawn with matplotlib's Agg canvas (no pyplot, no display).

Each function takes plain numbers and returns the encoded PNG; nothing here reads or writes storage.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 100
SUMMARIES = ("unified", "harmonic")


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    """The figure encoded as PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def group_names(sources: dict[str, dict[str, float]], metric: str) -> list[str]:
    """Datasets (sorted) then unified and harmonic: every name some source has ``metric`` for."""
    names = {k.split("/")[0] for values in sources.values() for k in values if k.endswith(f"/{metric}")}
    return sorted(names - set(SUMMARIES)) + [s for s in SUMMARIES if s in names]


def metric_bars(sources: dict[str, dict[str, float]], metric: str, title: str) -> bytes:
    """Grouped bars: per dataset, unified and harmonic ``metric``, one bar per source (zero-shot, ...)."""
    groups = group_names(sources, metric)
    fig = _figure(max(6.0, 1.1 * len(groups) * max(1, len(sources)) ** 0.5 + 2), 3.8)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(sources))
    x = np.arange(len(groups))
    for i, (source, values) in enumerate(sources.items()):
        heights = [values.get(f"{g}/{metric}", np.nan) for g in groups]
        bars = ax.bar(x + (i - (len(sources) - 1) / 2) * width, heights, width, label=source)
        ax.bar_label(bars, labels=["" if np.isnan(h) else f"{h:.2f}" for h in heights], fontsize=7, padding=1)
    ax.set_xticks(x, groups, rotation=20 if len(groups) > 6 else 0)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", ncols=min(4, max(1, len(sources))))
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def training_curves(history: Sequence[dict[str, float]], before: dict[str, float]) -> bytes:
    """Loss per epoch (left) and per-dataset, unified and harmonic R@1 per evaluated epoch (right; the
    zero-shot value at epoch 0)."""
    fig = _figure(11, 3.8)
    loss_ax, r1_ax = fig.subplots(1, 2)
    epochs = [h.get("epoch", i + 1) for i, h in enumerate(history)]
    loss = [h.get("train/loss", np.nan) for h in history]
    loss_ax.plot(epochs, loss, marker="o")
    loss_ax.set(xlabel="epoch", ylabel="train/loss", title="training loss")
    for name in group_names({"history": {k: v for h in history for k, v in h.items()}, "before": before},
                            "r@1"):
        points = [(0, before[f"{name}/r@1"])] if f"{name}/r@1" in before else []
        points += [(e, h[f"{name}/r@1"]) for e, h in zip(epochs, history, strict=True) if f"{name}/r@1" in h]
        if points:
            xs, ys = zip(*points, strict=True)
            r1_ax.plot(xs, ys, marker="o", label=name, linewidth=2.5 if name in SUMMARIES else 1.2,
                       linestyle="--" if name == "unified" else "-")
    r1_ax.set(xlabel="epoch (0: zero-shot)", ylabel="R@1", title="R@1 per epoch", ylim=(0, 1.05))
    r1_ax.legend(fontsize=8)
    for ax in (loss_ax, r1_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig)


def embedding_map(xy: np.ndarray, groups: np.ndarray, title: str, legend_limit: int = 20) -> bytes:
    """A scatter of 2-D points (N, 2) coloured by group (a legend when there are few groups)."""
    fig = _figure(7, 6)
    ax = fig.add_subplot()
    names = sorted(set(groups.tolist()))  # dataset names, or class ids (numeric order)
    size = float(np.clip(6000 / max(1, len(xy)), 6, 40))  # points: larger when there are few
    for name, colour in zip(names, _colours(len(names)), strict=True):
        sel = groups == name
        ax.scatter(xy[sel, 0], xy[sel, 1], s=size, color=colour, label=str(name), alpha=0.8, linewidths=0)
    if len(names) <= legend_limit:
        ax.legend(fontsize=8, markerscale=1.5, loc="best")
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    return _png(fig)


def _colours(n: int) -> list:
    """n distinguishable colours (tab10/tab20, then a hue circle)."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["hsv"](i / n) for i in range(n)]


def prompt_heatmap(datasets: Sequence[str], alpha: np.ndarray) -> bytes:
    """Mean prompt weight alpha per dataset (rows) x prompt (columns), values written in the cells."""
    fig = _figure(max(5.0, 0.6 * alpha.shape[1] + 2.5), max(2.5, 0.5 * len(datasets) + 1.5))
    ax = fig.add_subplot()
    image = ax.imshow(alpha, cmap="viridis", aspect="auto")
    ax.set_xticks(range(alpha.shape[1]), [str(m) for m in range(alpha.shape[1])])
    ax.set_yticks(range(len(datasets)), list(datasets))
    ax.set(xlabel="prompt m", title="mean prompt weight alpha_m (Eq. 8) per dataset")
    if alpha.size <= 400:
        middle = (np.nanmax(alpha) + np.nanmin(alpha)) / 2
        for (i, j), value in np.ndenumerate(alpha):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if value > middle else "white")
    fig.colorbar(image, ax=ax)
    return _png(fig)


def keep_prob_curve(keep_prob: Sequence[float], values: Sequence[float], completed: Sequence[bool],
                    objective: str) -> bytes:
    """The sweep's objective against the adapters' keep probability p, one point per trial (hollow: a
    trial stopped early, scored after fewer epochs); the other tuned keys vary too, so no line."""
    fig = _figure(6, 4)
    ax = fig.add_subplot()
    x, y, done = np.asarray(keep_prob), np.asarray(values), np.asarray(completed, dtype=bool)
    ax.scatter(x[done], y[done], s=36, color="tab:blue", label="completed")
    if (~done).any():
        ax.scatter(x[~done], y[~done], s=36, facecolors="none", edgecolors="tab:blue", label="stopped early")
    best = int(np.argmax(y))
    ax.annotate(f"best {y[best]:.3f} at p={x[best]:.2f}", (x[best], y[best]), textcoords="offset points",
                xytext=(0, -14), ha="center", fontsize=8)
    ax.margins(x=0.08, y=0.15)
    ax.set(xlabel="model.adapter.keep_prob (p)", ylabel=objective, title="sweep: keep probability")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def fewshot_curve(rows: Sequence[dict]) -> bytes:
    """Harmonic R@1 against shots per class, one line per method (a band of +- one std); the zero-shot
    row (0 shots, the frozen backbone) is a dashed level, so k runs on a log2 axis."""
    fig = _figure(6.5, 4)
    ax = fig.add_subplot()
    trained = [r for r in rows if r["shots"] > 0]
    for method in sorted({r["method"] for r in trained}):
        mine = sorted((r for r in trained if r["method"] == method), key=lambda r: r["shots"])
        shots = np.array([r["shots"] for r in mine])
        mean = np.array([r["harmonic_r1_mean"] for r in mine])
        std = np.array([r["harmonic_r1_std"] for r in mine])
        ax.plot(shots, mean, marker="o", label=method)
        ax.fill_between(shots, mean - std, mean + std, alpha=0.2)
    for r in rows:
        if r["shots"] == 0:
            ax.axhline(r["harmonic_r1_mean"], color="grey", linestyle="--", label=f"{r['method']} (0 shots)")
    shots = sorted({r["shots"] for r in trained})
    if shots:
        ax.set_xscale("log", base=2)
        ax.set_xticks(shots, [str(s) for s in shots])
    ax.set(xlabel="shots per class", ylabel="harmonic R@1", title="few-shot", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)
