"""The one definition of the prepared-data contract: column names, splits, roles, schema version.

Every stage imports its names from here (prepare, the Ray Data pipeline, training, evaluation).

Rows (one per image, Parquet):

- ``item_id``: ``"<dataset>/<path relative to the dataset's source root>"``; stable across re-runs.
- ``dataset``: short dataset name (``cub``, ``cars``, ``sop``, ``inshop``, ...).
- ``label``: int64 class index *within its dataset*. Converters number the training classes first:
  labels ``[0, num_train_classes)`` are training classes, ``[num_train_classes, num_classes)`` test
  classes. Training uses the global label map (``puma.data.splits.global_label_map``), unique
  across datasets.
- Unlabeled catalogues (a folder prepared with class depth 0; methods that make their own labels,
  e.g. ``model.method=udml_ss``, train on them): every row has ``label = UNLABELED`` (-1),
  ``class_name = ""``, ``split=train``, ``role=train``; the manifest marks the dataset
  ``labeled: false`` with no classes (``is_labeled``). Such a dataset has no val or test rows.
- ``class_name``: the release's class name; ``split``: ``train`` | ``test`` on storage;
  ``role``: ``train`` | ``query`` | ``gallery``.
- ``image``: the original encoded bytes, untouched; ``source_path``: where they were read from.

Splits and roles (DESIGN.md section 2):

- ``split=train, role=train``: training images.
- ``split=test``: In-Shop keeps its official ``query`` and ``gallery`` roles (queries search the
  gallery). Every other test image has ``role=query`` and means *query and gallery at once*: it
  queries all other test images of its dataset and is in their gallery (all-vs-all). The
  metrics treat a dataset whose items carry both roles query and gallery as query -> gallery and
  any other dataset as all-vs-all (``puma.eval.metrics.query_gallery_masks``).
- ``split=val`` exists only in the stream: the last ``data.val_fraction`` of each dataset's
  training classes (highest labels) are read as ``split=val, role=query`` (all-vs-all) and left
  out of training, so one prepared copy serves every sweep (``puma.data.splits.val_labels``).
"""

from __future__ import annotations

import pyarrow as pa

from puma.errors import UserError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
PREPARE_REJECTS_NAME = "rejects/prepare.jsonl"

# column names
ITEM_ID = "item_id"
DATASET = "dataset"
LABEL = "label"
CLASS_NAME = "class_name"
SPLIT = "split"
ROLE = "role"
IMAGE = "image"
SOURCE_PATH = "source_path"
COLUMNS = (ITEM_ID, DATASET, LABEL, CLASS_NAME, SPLIT, ROLE, IMAGE, SOURCE_PATH)

UNLABELED = -1  # the label of every row of an unlabeled dataset
LABELED_KEY = "labeled"  # manifest datasets[name][LABELED_KEY]: false for an unlabeled catalogue

# splits (train/test on storage; val carved from training classes at read time)
TRAIN = "train"
VAL = "val"
TEST = "test"
SPLITS = (TRAIN, VAL, TEST)
STORED_SPLITS = (TRAIN, TEST)

# roles
ROLE_TRAIN = "train"
QUERY = "query"
GALLERY = "gallery"
ROLES = (ROLE_TRAIN, QUERY, GALLERY)

ARROW_SCHEMA = pa.schema([
    pa.field(ITEM_ID, pa.string(), nullable=False),
    pa.field(DATASET, pa.string(), nullable=False),
    pa.field(LABEL, pa.int64(), nullable=False),
    pa.field(CLASS_NAME, pa.string(), nullable=False),
    pa.field(SPLIT, pa.string(), nullable=False),
    pa.field(ROLE, pa.string(), nullable=False),
    pa.field(IMAGE, pa.binary(), nullable=False),
    pa.field(SOURCE_PATH, pa.string(), nullable=False),
])

# columns of the decoded numpy batches the pipeline yields to training and evaluation
BATCH_IMAGE = "image"  # uint8 (B, 3, H, W), device_views.batch_images normalises (absent: decode_on=worker)
BATCH_ENCODED = "encoded"  # data.decode_on=worker: bytes the consumer decodes (JPEG as stored, or a PNG view)
BATCH_CROP = "crop"  # data.decode_on=worker: float32 (B, 4) source box of each image's view
BATCH_FLIP = "flip"  # data.decode_on=worker: bool (B,) mirror the view
BATCH_VIEW = "view"  # float32 (B, 7) mean (3), std (3), img_size: how batch_images normalises
BATCH_COLUMNS = (BATCH_IMAGE, BATCH_VIEW, LABEL, DATASET, ROLE, ITEM_ID)


class SchemaError(UserError, ValueError):
    """Prepared data does not match this schema; the message names the file and the difference."""


def make_item_id(dataset: str, rel_path: str) -> str:
    """The stable id of an image: ``<dataset>/<relative path>`` with forward slashes."""
    return f"{dataset}/{rel_path.replace(chr(92), '/').lstrip('/')}"


def is_labeled(dataset_info: dict) -> bool:
    """Whether a manifest dataset entry has labels (entries written before the key existed do)."""
    return bool(dataset_info.get(LABELED_KEY, True))


def check_schema(schema: pa.Schema, where: str) -> None:
    """Raise SchemaError unless ``schema`` has exactly the contract's columns and types."""
    got = {f.name: f.type for f in schema}
    want = {f.name: f.type for f in ARROW_SCHEMA}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise SchemaError(f"{where}: schema differs from version {SCHEMA_VERSION}: missing {missing}, "
                          f"unexpected {extra}, wrong types {wrong}; re-run jobs/prepare_data.py")
