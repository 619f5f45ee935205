"""Few-shot training data: k training images per class (``data.shots_per_class``), seeded and stable.

Which images: within each (dataset, label) of the stored training split, the k items whose
blake2b(shots_seed, item_id) is smallest. The choice depends only on the seed and the item ids,
not on shard order, the number of workers or the run, so every run, rank and re-run of a config
trains on the same images; growing k keeps the smaller k's images (the k+1 smallest contain the
k smallest). Classes with fewer than k images keep all of them. No Ray in this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from puma import storage
from puma.data import schema
from puma.data.manifest import Manifest

COLUMNS = [schema.ITEM_ID, schema.DATASET, schema.LABEL]


def shot_rank(seed: int, item_id: str) -> bytes:
    """The sort key that orders a class's items for the draw (seeded, independent of everything else)."""
    return hashlib.blake2b(f"{seed}:{item_id}".encode(), digest_size=8).digest()


def select_shots(manifest: Manifest, names: Sequence[str], k: int, seed: int) -> frozenset[str]:
    """Item ids of the k (>= 1) training images per class of the datasets ``names``."""
    if k <= 0:
        raise ValueError(f"data.shots_per_class={k} selects nothing; 0 means every image (no selection)")
    by_class: dict[tuple[str, int], list[tuple[bytes, str]]] = {}
    wanted = set(names)
    for uri in manifest.shard_uris(schema.TRAIN):
        table = _read_columns(uri)
        for item_id, name, label in zip(*(table[c].to_pylist() for c in COLUMNS), strict=True):
            if name in wanted:
                by_class.setdefault((name, label), []).append((shot_rank(seed, item_id), item_id))
    return frozenset(item for items in by_class.values() for _, item in sorted(items)[:k])


def _read_columns(uri: str) -> pa.Table:
    fs, path = storage.resolve(uri)
    return storage.call("reading", uri, lambda: pq.read_table(path, columns=COLUMNS, filesystem=fs))
