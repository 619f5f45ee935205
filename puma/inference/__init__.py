"""Batch embedding of catalogues into the sharded index (what jobs/embed.py runs).

``embed_catalogue(cfg, catalogue)`` reconciles one catalogue (a prepared dataset, images under a
prefix, or a table) into the index with a checkpoint: new and changed items embedded (a Ray Data
actor pool, or in process for a few), removed ones taken out (``puma.inference.reconcile`` plans
it); ``embed_catalogues`` / ``watch(cfg, prefix)`` do it for several, building a new model's
version for every live catalogue. See ``puma.inference.job``, and its rooms: ``run`` (a run's state
and report), ``planning`` (what to embed), ``running`` (in process or Ray Data), ``commits``,
``rejects`` and ``versions`` (promotion, catalogue removal).
``run_search`` (``puma.inference.search``, what jobs/search.py runs) searches the index by stored
vectors, item ids or query images embedded in-process (``puma.inference.query``) and draws
retrieval grids (``puma.inference.grid``).

The names below are imported on first use (PEP 562), so a Ray Data decode worker that unpickles
``puma.inference.embedder.read_and_decode`` imports that module only, not the job (torch).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CatalogueError": "catalogue", "catalogue_refs": "catalogue", "list_catalogues": "catalogue",
    "Embedder": "embedder",
    "checkpoint_id": "job", "embed_catalogue": "job", "embed_catalogues": "job", "resolve_checkpoint": "job",
    "watch": "job", "Plan": "reconcile", "plan": "reconcile", "rejects_uri": "rejects",
    "EmbedReport": "run", "remove_catalogue": "versions", "settle_version": "versions",
    "SearchOutcome": "search", "run_search": "search",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
