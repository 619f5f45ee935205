"""Batch embedding of catalogues into the sharded index (what jobs/embed.py runs).

``embed_catalogue(cfg, catalogue)`` embeds one catalogue (a prepared dataset or images under a
prefix) with a checkpoint, in a Ray Data actor pool, and adds the new items to the index;
``watch(cfg, prefix)`` does it for every catalogue under a prefix. See ``puma.inference.job``.
"""

from puma.inference.catalogue import CatalogueError, catalogue_refs, list_catalogues
from puma.inference.embedder import Embedder
from puma.inference.job import (
           EmbedReport,
           checkpoint_id,
           embed_catalogue,
           rejects_uri,
           resolve_checkpoint,
           watch,
)

__all__ = ["CatalogueError", "EmbedReport", "Embedder", "catalogue_refs", "checkpoint_id", "embed_catalogue",
           "list_catalogues", "rejects_uri", "resolve_checkpoint", "watch"]
