"""Sharded FAISS indexes: build once-trained shards with a manifest, extend, remove, compact, verify,
search; versions of an index location, one per model, behind an alias (``puma.index.versions``).

An index is a folder (local path or s3://) of shards plus ``manifest.json``; see
``puma.index.manifest`` for what it holds, ``puma.index.layout`` for every path under an index location
and ``puma.index.plan`` for how the type is chosen.
Importing this package imports numpy and pyarrow, never faiss (loaded on first use, see
``puma.index.backend``), Ray or torch.
"""

from puma.index.build import (
    AddReport,
    CommitReport,
    add_items,
    add_shard,
    build_index,
    check_compatible,
    clean_orphans,
    commit_changes,
    compact,
    create_index,
    indexed_item_ids,
    live_table,
    rebuild,
)
from puma.index.manifest import IndexIntegrityError, Manifest, ShardEntry, read_manifest
from puma.index.plan import IndexInputError, IndexPlan, estimate_memory_bytes, plan_index
from puma.index.search import ShardedIndex, merge_topk
from puma.index.verify import VerifyReport, verify

__all__ = ["AddReport", "CommitReport", "IndexInputError", "IndexIntegrityError", "IndexPlan", "Manifest",
           "ShardEntry", "ShardedIndex", "VerifyReport", "add_items", "add_shard", "build_index",
           "check_compatible", "clean_orphans", "commit_changes", "compact", "create_index",
           "estimate_memory_bytes", "indexed_item_ids", "live_table", "merge_topk", "plan_index",
           "read_manifest", "rebuild", "verify"]
