"""The ``demo`` preset: the embedded default's small, imbalanced, four-domain dataset.

- ``cub``: ../shared/data/cub200-subset/CUB_200_2011 (official layout, 100 species, 5,902 images)
- ``flowers``: ../shared/data/flowers12-subset/<species>/*.jpg (12 species x 80)
- ``omniglot``: ../shared/data/omniglot-subset/<alphabet>/<character>/*.png (242 characters x 20)
- ``fashion_mnist``: Debian's dataset-fashion-mnist IDX files (28x28, encoded as PNG), the large,
  dominant dataset.

So that a 2-core demo trains and evaluates in minutes, each class keeps its first
``data.max_images_per_class`` images (default 12: cub 1,200, flowers 144, omniglot 2,904) and
Fashion-MNIST its first ``data.fashion_mnist_per_class`` (default 400: 4,000 images, half the demo).

Every dataset is split class-disjointly: first half of its classes train, second half test.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
from pathlib import Path

import numpy as np
from PIL import Image

from puma import storage
from puma.data import schema
from puma.data.listing import DatasetListing, LayoutError, SourceItem, num_train_classes

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")
FASHION_MNIST_FILES = (("train", "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                       ("t10k", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"))
DEMO_PER_CLASS = 12  # data.max_images_per_class when null
REPO_ROOT = Path(__file__).resolve().parents[2]


def read_idx(uri: str) -> np.ndarray:
    """An IDX array (images: (N, rows, cols) uint8; labels: (N,) uint8), gzip or plain."""
    data = storage.read_bytes(uri)
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    magic, = struct.unpack(">I", data[:4])
    if magic >> 8 != 0x08:  # 0x00000803 images, 0x00000801 labels: unsigned bytes
        raise LayoutError(f"{uri}: not an unsigned-byte IDX file (magic {magic:#010x})")
    ndim = magic & 0xFF
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise LayoutError(f"{uri}: header says {shape} but holds {array.size} bytes")
    return array.reshape(shape)


def encode_png(pixels: np.ndarray) -> bytes:
    """Lossless PNG bytes of a (H, W) uint8 grayscale image."""
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def convert_fashion_mnist(root: str, name: str = "fashion_mnist",
                          max_per_class: int | None = None) -> DatasetListing:
    """Fashion-MNIST IDX files -> PNG items; the first ``max_per_class`` per class (train file first)."""
    n_train = num_train_classes(len(FASHION_MNIST_CLASSES))
    taken = np.zeros(len(FASHION_MNIST_CLASSES), dtype=np.int64)
    items = []
    for part, images_file, labels_file in FASHION_MNIST_FILES:
        images = read_idx(storage.join(root, images_file))  # (N, 28, 28)
        labels = read_idx(storage.join(root, labels_file))  # (N,)
        if len(images) != len(labels):
            raise LayoutError(f"{root}: {images_file} has {len(images)} images, "
                              f"{labels_file} {len(labels)} labels")
        for index, label in enumerate(labels.tolist()):
            if max_per_class is not None and taken[label] >= max_per_class:
                continue
            taken[label] += 1
            train = label < n_train
            items.append(SourceItem(
                item_id=schema.make_item_id(name, f"{part}/{index:05d}.png"), dataset=name, label=int(label),
                class_name=FASHION_MNIST_CLASSES[label], split=schema.TRAIN if train else schema.TEST,
                role=schema.ROLE_TRAIN if train else schema.QUERY,
                source_path=f"{storage.join(root, images_file)}#{index}", data=encode_png(images[index])))
    return DatasetListing(name, "fashion_mnist", root, items, list(FASHION_MNIST_CLASSES), n_train,
                          notes={"max_per_class": max_per_class})


def resolve_local_root(path: str) -> str:
    """A source root as an absolute path: relative paths are tried from the cwd, then the repo root."""
    if storage.is_s3(path) or os.path.isabs(path):
        return path
    for base in (Path.cwd(), REPO_ROOT):
        candidate = (base / path).resolve()
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(f"source root {path!r} exists neither under {Path.cwd()} nor under {REPO_ROOT}; "
                            "set data.source_root to the folder holding cub200-subset, flowers12-subset "
                            "and omniglot-subset")
