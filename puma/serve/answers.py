"""A query's answer from the rows an index search returned: hit dicts in rank order, each with its
stored fields (puma.serve.live_index reads only the k hits' fields), and a partition's answer, whose
hits carry their merge order (puma.serve.partitions).
"""

from __future__ import annotations

import json

import numpy as np

from puma.index.search import ShardedIndex
from puma.index.table import CATALOGUE, CLASS_NAME, DATASET, IMAGE_ROW, IMAGE_URI, ITEM_ID, LABEL, METADATA
from puma.serve.partitions import ORDER

HIT_COLUMNS = [ITEM_ID, DATASET, LABEL, CLASS_NAME, CATALOGUE, IMAGE_URI, IMAGE_ROW, METADATA]


def hits(index: ShardedIndex, scores: np.ndarray, ids: np.ndarray) -> list[dict]:
    """(k,) scores and rows (-1: none) -> hit dicts in rank order (only these k rows' fields are read)."""
    keep = ids >= 0
    rows = index.describe(ids[keep], HIT_COLUMNS)
    for row in rows:
        row[METADATA] = json.loads(row[METADATA]) if row[METADATA] else {}
        row[CLASS_NAME] = row[CLASS_NAME] or ""
    return [{"rank": rank, "score": round(float(score), 6), **row}
            for rank, (score, row) in enumerate(zip(scores[keep].tolist(), rows, strict=True), start=1)]


def part_answer(index: ShardedIndex, scores: np.ndarray, ids: np.ndarray, unknown: list) -> dict:
    """A partition's answer: its hits for (k,) scores and rows, each carrying its merge order, its live
    items, and the filter names it does not know."""
    found = hits(index, scores, ids)
    keep = ids >= 0
    sign = -1.0 if index.manifest.metric == "ip" else 1.0
    for hit, score, gid in zip(found, scores[keep], index.global_ids(ids[keep]), strict=True):
        hit[ORDER] = (sign * float(score), int(gid))
    return {"hits": found, "items": index.live_total, "unknown": unknown}
