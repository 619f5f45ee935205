"""The RejectLog actor: one per rejects file, fed by the decode tasks of the training and embedding
streams (see puma.data.pipeline). A module of its own, light to import: the actor's process loads this
module to build the class, and nothing of Ray Data, pandas or the image code.

``start_reject_log`` places it on the node of the process that starts it (the job's driver): a job
outlives the loss of any other node, and the rejects it holds must too. Placed by Ray anywhere, it
could land on a worker node, and losing that node failed the whole embedding run at its end.
"""

from __future__ import annotations

import hashlib
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


def start_reject_log(prefix: str, uri: str, initial: Sequence[dict]) -> ray.actor.ActorHandle:
    """The RejectLog of the rejects file ``uri``, named ``prefix`` + a hash of it (created with
    ``initial`` if it is not running), on this process's node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = prefix + hashlib.sha1(uri.encode()).hexdigest()[:16]
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return RejectLog.options(name=name, get_if_exists=True, scheduling_strategy=here).remote(
        uri, storage.current_config(), initial)
