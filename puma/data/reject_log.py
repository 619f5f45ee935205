"""The RejectLog actor: one per rejects file, fed by the decode tasks of the training and embedding
streams (see puma.data.pipeline). A module of its own, light to import: the actor's process loads this
module to build the class, and nothing of Ray Data, pandas or the image code."""

from __future__ import annotations

from collections.abc import Sequence

import ray

from puma import storage
from puma.data.rejects import dumps, reject_counts


@ray.remote(num_cpus=0)
class RejectLog:
    """Collects rejects from decode tasks, one row per item id, and keeps the rejects file current."""

    def __init__(self, uri: str, storage_cfg, initial: Sequence[dict]) -> None:
        storage.configure(storage_cfg)
        self._uri = uri
        self._rows: dict[str, dict] = {}
        self.record(list(initial), force=True)

    def record(self, rows: Sequence[dict], force: bool = False) -> int:
        """Add rows; rewrite the file if any item is new. Returns the number of new items."""
        new = [r for r in rows if r["item_id"] not in self._rows]
        for row in new:
            self._rows[row["item_id"]] = row
        if new or force:
            storage.write_text(self._uri, dumps(self._rows.values()))
        if new:
            counts = reject_counts(self._rows.values())
            print(f"[puma.data] {len(self._rows)} rejected image(s) so far {counts} -> {self._uri}",
                  flush=True)
        return len(new)

    def rows(self) -> list[dict]:
        return [self._rows[k] for k in sorted(self._rows)]
