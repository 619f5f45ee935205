"""The manifest beside prepared Parquet shards: what is there, how many, and checksums.

``<uri>/manifest.json`` holds ``schema_version``, the ``spec`` that produced the data (sources and
options), per-dataset ``datasets[name]`` (kind, source, class names with training classes first,
``num_train_classes``, counts per split and role, the Table 1 check), ``shards`` (path relative to
the root, split, rows, bytes, sha256), ``totals`` and prepare-time ``rejects``. It is written
last, so a manifest always describes complete shards.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from puma import storage
from puma.config import ConfigError
from puma.data import schema
from puma.data.images import eval_resize_size
from puma.errors import UserError


class DataNotPreparedError(UserError, FileNotFoundError):
    """No manifest at the data URI; the message says how to prepare it."""


@dataclass
class Manifest:
    """A loaded manifest and the root URI it describes."""

    uri: str
    data: dict

    @property
    def datasets(self) -> dict[str, dict]:
        return self.data["datasets"]

    def select(self, names: Sequence[str] | None) -> list[str]:
        """The dataset names to use: all (None) or ``names``, which must exist."""
        if names is None:
            return sorted(self.datasets)
        unknown = sorted(set(names) - set(self.datasets))
        if unknown:
            raise ConfigError(f"data.datasets names {unknown} are not in {self.uri}; "
                             f"valid: {sorted(self.datasets)}")
        return sorted(set(names))

    def shard_uris(self, split: str) -> list[str]:
        """URIs of the shards of a stored split (train | test)."""
        if split not in schema.STORED_SPLITS:
            raise ValueError(f"stored split {split!r} is not valid; choose one of "
                             f"{list(schema.STORED_SPLITS)}")
        return [storage.join(self.uri, s["path"]) for s in self.data["shards"] if s["split"] == split]

    def num_train_classes(self, name: str) -> int:
        return int(self.datasets[name]["num_train_classes"])

    @property
    def max_side(self) -> int:
        """The longer side, in px, that prepare shrank larger images to (0: stored as encoded)."""
        return int(self.data.get("spec", {}).get("prepare_max_side", 0))

    def check_view_size(self, img_size: int) -> None:
        """ConfigError if the shards were shrunk below what the eval view of ``img_size`` px resizes to."""
        need = eval_resize_size(img_size)
        if self.max_side and self.max_side < need:
            raise ConfigError(f"{self.uri} holds images shrunk to {self.max_side} px "
                              f"(data.prepare_max_side), "
                              f"less than the {need} px that model.backbone.img_size={img_size} needs; "
                              f"re-prepare it with data.prepare_max_side=0 or >= {need}")

    @property
    def rejects_uri(self) -> str:
        return storage.join(self.uri, self.data["rejects"]["path"])

    def to_json(self) -> str:
        return json.dumps(self.data, indent=1, sort_keys=True) + "\n"


def manifest_uri(uri: str) -> str:
    return storage.join(uri, schema.MANIFEST_NAME)


def load_manifest(uri: str) -> Manifest:
    """Read ``<uri>/manifest.json``; DataNotPreparedError if absent, SchemaError on a version mismatch."""
    path = manifest_uri(uri)
    try:
        data = json.loads(storage.read_text(path))
    except FileNotFoundError as exc:
        raise DataNotPreparedError(
            f"no prepared data at {uri} (missing {schema.MANIFEST_NAME}); run "
            f"python jobs/prepare_data.py --preset PRESET --source ROOT --out {uri}") from exc
    if data.get("schema_version") != schema.SCHEMA_VERSION:
        raise schema.SchemaError(f"{path}: schema_version {data.get('schema_version')!r}, this code reads "
                                 f"{schema.SCHEMA_VERSION}; re-run jobs/prepare_data.py")
    return Manifest(uri=storage.absolute(uri), data=data)


def verify_shards(manifest: Manifest) -> list[str]:
    """Problems found by re-reading every shard (missing, size or sha256 differs); [] when intact."""
    problems = []
    for shard in manifest.data["shards"]:
        uri = storage.join(manifest.uri, shard["path"])
        try:
            data = storage.read_bytes(uri)
        except FileNotFoundError:
            problems.append(f"{uri}: missing")
            continue
        if len(data) != shard["bytes"] or storage.sha256(data) != shard["sha256"]:
            problems.append(f"{uri}: checksum differs from the manifest")
    return problems
