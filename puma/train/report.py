"""Human-readable summaries of training metrics (no Ray)."""

from __future__ import annotations

from typing import Any


def recall_table(metrics: dict[str, Any], key: str = "r@1") -> str:
    """A table of per-dataset, unified and harmonic ``key`` before (frozen backbone) and after."""
    names = sorted({k.split("/")[0] for k in metrics if k.endswith(f"/{key}") and "/" in k}
                   - {"before", "best", "unified", "harmonic"})
    rows = [*names, "unified", "harmonic"]
    lines = [f"{'dataset':<16} {'before ' + key:>12} {'after ' + key:>12} {'change':>8}"]
    for name in rows:
        before = metrics.get(f"before/{name}/{key}")
        after = metrics.get(f"{name}/{key}")
        change = f"{after - before:+8.4f}" if before is not None and after is not None else f"{'':>8}"
        lines.append(f"{name:<16} {_fmt(before):>12} {_fmt(after):>12} {change}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
