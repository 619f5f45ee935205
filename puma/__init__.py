"""PUMA: Parameter-efficient Unified Metric leArning (Kim, Kim and Kwak, WACV 2025) on Ray.

The library is importable without Ray side effects; Ray is imported only by
``puma.data.pipeline``, ``puma.train`` and the batch-inference code. The package layout and the
layer order its imports follow are in docs/architecture.md (checked by tests/test_architecture.py).
"""

from __future__ import annotations

import platform
from collections.abc import Iterable

__version__ = "0.1.0"


def library_versions(packages: Iterable[str]) -> dict[str, str]:
    """Python's version and the installed version of each of ``packages`` (missing ones left out)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return out
