"""Which classes each split reads, and the global training label map (no Ray here).

Labels within a dataset number training classes first (``puma.data.schema``), so every split is a
label range per dataset:

- train: ``[0, num_train - num_val)``; val: ``[num_train - num_val, num_train)``;
- test: ``[num_train, num_classes)``;

with ``num_val = round(val_fraction * num_train)`` (at least 1 when val_fraction > 0, at most
``num_train - 1``): the last training classes are held out, class-disjoint from train and test.
An unlabeled dataset (``schema.is_labeled``) reads all its rows (label ``UNLABELED``) as train,
none as val or test, and has no entries in the global label map.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from puma import storage
from puma.data import schema
from puma.data.manifest import Manifest

LabelMap = dict[tuple[str, int], int]


def num_val_classes(num_train: int, val_fraction: float) -> int:
    """Training classes held out for validation."""
    if val_fraction <= 0 or num_train < 2:
        return 0
    return min(num_train - 1, max(1, round(val_fraction * num_train)))


def label_range(manifest: Manifest, dataset: str, split: str, val_fraction: float = 0.0) -> range:
    """The within-dataset labels that ``split`` (train | val | test) reads from ``dataset``."""
    info = manifest.datasets[dataset]
    if not schema.is_labeled(info):
        unlabeled = range(schema.UNLABELED, schema.UNLABELED + 1)
        return {schema.TRAIN: unlabeled, schema.VAL: range(0), schema.TEST: range(0)}[_check_split(split)]
    num_train, num_classes = int(info["num_train_classes"]), int(info["num_classes"])
    cut = num_train - num_val_classes(num_train, val_fraction)
    ranges = {schema.TRAIN: range(0, cut), schema.VAL: range(cut, num_train),
              schema.TEST: range(num_train, num_classes)}
    if split not in ranges:
        raise ValueError(f"split {split!r} is not valid; choose one of {list(schema.SPLITS)}")
    return ranges[split]


def global_label_map(manifest: Manifest, val_fraction: float = 0.0,
                     datasets: Sequence[str] | None = None) -> LabelMap:
    """(dataset, label) -> global training class id, 0..N-1, ordered by dataset name then label.

    Covers the training classes of the selected datasets, minus the validation classes; stable for
    a given manifest and options, and saved with training artifacts (``save_label_map``).
    """
    out: LabelMap = {}
    for name in labeled_datasets(manifest, datasets):
        for label in label_range(manifest, name, schema.TRAIN, val_fraction):
            out[(name, label)] = len(out)
    return out


def _check_split(split: str) -> str:
    if split not in schema.SPLITS:
        raise ValueError(f"split {split!r} is not valid; choose one of {list(schema.SPLITS)}")
    return split


def labeled_datasets(manifest: Manifest, datasets: Sequence[str] | None = None) -> list[str]:
    """The selected datasets that carry labels."""
    return [n for n in manifest.select(datasets) if schema.is_labeled(manifest.datasets[n])]


def unlabeled_datasets(manifest: Manifest, datasets: Sequence[str] | None = None) -> list[str]:
    """The selected datasets prepared without labels (e.g. a folder at class depth 0)."""
    return [n for n in manifest.select(datasets) if not schema.is_labeled(manifest.datasets[n])]


def save_label_map(label_map: LabelMap, uri: str) -> None:
    """Write the label map as JSON rows [dataset, label, global_id]."""
    rows = [[d, int(c), int(i)] for (d, c), i in sorted(label_map.items(), key=lambda kv: kv[1])]
    storage.write_text(uri, json.dumps({"label_map": rows}) + "\n")


def load_label_map(uri: str) -> LabelMap:
    """Read a label map written by ``save_label_map``."""
    rows = json.loads(storage.read_text(uri))["label_map"]
    return {(d, int(c)): int(i) for d, c, i in rows}
