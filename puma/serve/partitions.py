"""Partitioned serving: which shards an index partition holds, how many partitions an index needs,
and the exact merge of the partitions' hits.

An index of many shards is served by ``serve.index_partitions`` = N index deployments; partition p
holds the shards whose number (``shard-00012`` -> 12) is p modulo N. A shard keeps its number for
life (names are never reused), so a shard committed by jobs/embed.py, or one whose removals change,
lands in the same partition on every replica without any coordination, and the partitions stay
within one shard of each other in size. A query goes to every partition; each returns its own top-k
(filters applied there) and the merge keeps the best k by score, ties broken by the FAISS global
id: the order one index holding every shard gives (its shards merge in id order).

No Ray here: puma.serve.fanout asks every partition and merges their answers with these (the tests
fan out over LiveIndexes in one process).
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from dataclasses import dataclass

from puma.index.filtered import merged_type
from puma.index.manifest import Manifest
from puma.serve.errors import RequestError

SHARD_NUMBER = re.compile(r"shard-(\d+)")
ORDER = "_order"  # a partition's hits carry (-score unrounded, FAISS global id) for the merge (dropped after)
HEADROOM = 1.2  # memory a loaded shard's FAISS index takes over its file (search buffers, the stacked lists)
ITEM_BYTES = 88  # memory a served item takes beside FAISS: the id lookup (12 B), the live flag, dataset and
# catalogue codes, cached filter bits (about 46 B measured at 10M items), its row of the filter table
# (puma.index.filtered: about 21 B measured with the scale bench's metadata: category, brand, price, in
# stock; more with more columns); its hit fields and embedding are in the replica's local column file
# (page cache, not process memory; a selective filter's exact scan maps the embedding column)


@dataclass(frozen=True)
class Partition:
    """Partition ``index`` of ``count``: the shards it holds (all of them when count is 1)."""

    index: int = 0
    count: int = 1

    def holds(self, shard_name: str) -> bool:
        return self.count == 1 or shard_number(shard_name) % self.count == self.index

    def of(self, manifest: Manifest) -> Manifest:
        """``manifest`` with only this partition's shards (the rest of it unchanged)."""
        if self.count == 1:
            return manifest
        return dataclasses.replace(manifest, shards=[s for s in manifest.shards if self.holds(s.name)])

    def describe(self) -> str:
        return "every shard" if self.count == 1 else f"partition {self.index} of {self.count}"


def shard_number(name: str) -> int:
    """The number in a shard's name (``shard-00012`` -> 12); another name: a stable hash of it."""
    match = SHARD_NUMBER.fullmatch(name)
    return int(match.group(1)) if match else zlib.crc32(name.encode())


def index_bytes(manifest: Manifest) -> int:
    """What serving the index takes in a replica's memory, estimated: its FAISS files with HEADROOM and
    ITEM_BYTES per row (removed rows included until compacted)."""
    faiss_files = sum(s.index.bytes for s in manifest.shards) + manifest.trained.bytes
    return int(faiss_files * HEADROOM + sum(s.count for s in manifest.shards) * ITEM_BYTES)


def partitions_for(manifest: Manifest, configured: int, budget_gb: float) -> tuple[int, str]:
    """(partition count, one line saying why): ``configured`` when > 0, else as many as keep each
    partition's estimated memory within ``budget_gb`` (at most one partition per shard)."""
    need = index_bytes(manifest)
    size = f"{need / 1e9:.2f} GB estimated in memory over {len(manifest.shards)} shard(s)"
    if configured > 0:
        return configured, f"index: {size}; serve.index_partitions={configured}"
    count = max(1, min(len(manifest.shards), math.ceil(need / (budget_gb * 1e9))))
    return count, (f"index: {size}; serve.index_replica_memory_gb={budget_gb:g} -> {count} partition(s) "
                   f"(serve.index_partitions=0 picks; set it to choose)")


def merge_hits(parts: list[list[dict]], k: int, drop_item: str = "") -> list[dict]:
    """The best ``k`` of the partitions' hit lists (each best first), by unrounded score then FAISS
    global id; ``drop_item``: an item id left out (an item query's own item). Ranks from 1."""
    hits = [h for part in parts for h in part if not (drop_item and h["item_id"] == drop_item)]
    hits.sort(key=lambda h: tuple(h[ORDER]))
    return [{**without_order(h), "rank": rank} for rank, h in enumerate(hits[:k], start=1)]


def without_order(hit: dict) -> dict:
    return {key: value for key, value in hit.items() if key != ORDER}


def merged_answer(answers: list[dict], k: int, drop_item: str = "") -> list[dict]:
    """The hits of a query from every partition's ``LiveIndex.search_part`` answer: 503 while no
    partition holds an item, 422 for a filter name no partition knows, else ``merge_hits``."""
    if not any(a["items"] for a in answers):
        raise RequestError(503, "the index has no items yet; embed a catalogue with jobs/embed.py (the "
                                "service picks it up without a restart)")
    unknown = [n for n in answers[0]["unknown"] if all(n in a["unknown"] for a in answers[1:])]
    if unknown:
        raise RequestError(422, f"unknown {', '.join(unknown)}: no item of the index has it; GET /stats "
                                "lists the datasets, catalogues and filterable columns")
    return merge_hits([a["hits"] for a in answers], k, drop_item)


def merged_stats(parts: list[dict]) -> dict:
    """One index's stats from its partitions' (``LiveIndex.stats``): items, shards and counts summed."""
    out = dict(parts[0])
    for key in ("items", "shards", "removed_rows"):
        out[key] = sum(p[key] for p in parts)
    datasets: dict[str, int] = {}
    catalogues: dict[str, dict] = {}
    for part in parts:
        for name, n in part["datasets"].items():
            datasets[name] = datasets.get(name, 0) + n
        for c in part["catalogues"]:
            catalogues.setdefault(c["uri"], {**c, "items": 0})["items"] += c["items"]
    out["datasets"] = dict(sorted(datasets.items()))
    out["filterable"] = merged_filterable([p.get("filterable", {}) for p in parts])
    out["catalogues"] = [catalogues[uri] for uri in sorted(catalogues)]
    out["on_gpu"] = any(p["on_gpu"] for p in parts)
    out["refused_update"] = next((p["refused_update"] for p in parts if p["refused_update"]), "")
    out["loaded_at"] = min(p["loaded_at"] for p in parts)
    out.pop("channel", None)
    out["partitions"] = [{"items": p["items"], "shards": p["shards"],
                          **({"channel": p["channel"]} if "channel" in p else {})} for p in parts]
    return out


def merged_filterable(parts: list[dict], max_values: int = 50) -> dict:
    """The partitions' filterable columns as one index's: a type the partitions agree on ("json" where
    any holds nested values, else "string" where they differ), and the text values while few."""
    out: dict[str, dict] = {}
    for part in parts:
        for name, info in part.items():
            have = out.setdefault(name, {"type": info["type"], "values": set(info.get("values", []))})
            have["type"] = merged_type({have["type"], info["type"]})
            if have["values"] is not None and "values" in info:
                have["values"].update(info["values"])
            elif info["type"] == "string":
                have["values"] = None
    for info in out.values():
        values = info.pop("values")
        if info["type"] == "string" and values is not None and len(values) <= max_values:
            info["values"] = sorted(values)
    return dict(sorted(out.items()))
