"""What a converter produces: the images of one dataset with class, split and role, no bytes yet."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from puma import storage
from puma.data import schema
from puma.data.rejects import Reject
from puma.errors import UserError


class LayoutError(UserError, ValueError):
    """A source tree does not match the layout it was given as; the message says what was expected."""


@dataclass(frozen=True)
class SourceItem:
    """One image of a release: where its bytes are and what it is (``data`` set for generated images)."""

    item_id: str
    dataset: str
    label: int
    class_name: str
    split: str
    role: str
    source_path: str
    data: bytes | None = None


@dataclass
class DatasetListing:
    """A converted dataset: items plus class names (index = label; training classes first).

    ``rejects``: entries of the source that are not items (e.g. a catalogue table's rows without an
    item_id); prepare writes them to its rejects file with what it rejects itself.
    """

    name: str
    kind: str  # the layout / preset it was read with (cub, cars, ..., folder, fashion_mnist)
    source: str
    items: list[SourceItem]
    class_names: list[str]
    num_train_classes: int
    notes: dict = field(default_factory=dict)  # e.g. ignored files
    rejects: list[Reject] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


@dataclass(frozen=True)
class Entry:
    """An annotation line: a path relative to the source root and its class key."""

    rel_path: str
    class_key: str
    role: str = ""  # '' = decided by the class split; else train | query | gallery (SOP, In-Shop)


def num_train_classes(num_classes: int) -> int:
    """First half of the classes train (the larger half when odd: NABirds 555 -> 278 / 277)."""
    return math.ceil(num_classes / 2)


def half_split_listing(name: str, kind: str, root: str, entries: Sequence[Entry], class_order: Sequence[str],
                       class_names: dict[str, str] | None = None, image_root: str | None = None
                       ) -> DatasetListing:
    """Classes in ``class_order``: the first half train (role train), the rest test (role query)."""
    n_train = num_train_classes(len(class_order))
    roles = {key: (schema.ROLE_TRAIN if i < n_train else schema.QUERY) for i, key in enumerate(class_order)}
    entries = [Entry(e.rel_path, e.class_key, roles.get(e.class_key, "")) for e in entries]
    return build_listing(name, kind, root, entries, class_order, class_names, image_root)


def build_listing(name: str, kind: str, root: str, entries: Sequence[Entry], class_order: Sequence[str],
                  class_names: dict[str, str] | None = None, image_root: str | None = None) -> DatasetListing:
    """Items from entries whose role is set; ``class_order`` must list every training class first."""
    labels = {key: i for i, key in enumerate(class_order)}
    if len(labels) != len(class_order):
        raise LayoutError(f"{name}: duplicate class keys in the class list of {root}")
    class_split = _class_splits(name, entries, labels)
    n_train = sum(1 for split in class_split.values() if split == schema.TRAIN)
    if any(class_split.get(key) == schema.TRAIN for key in class_order[n_train:]):
        raise LayoutError(f"{name}: training classes must come first in the class order")
    base = image_root or root
    names = class_names or {}
    items = [SourceItem(item_id=schema.make_item_id(name, e.rel_path), dataset=name,
                        label=labels[e.class_key], class_name=names.get(e.class_key, e.class_key),
                        split=schema.TRAIN if e.role == schema.ROLE_TRAIN else schema.TEST, role=e.role,
                        source_path=storage.join(base, e.rel_path)) for e in entries]
    check_unique(name, items)
    return DatasetListing(name, kind, root, items, [names.get(key, key) for key in class_order], n_train)


def unlabeled_listing(name: str, kind: str, root: str, rel_paths: Sequence[str]) -> DatasetListing:
    """Every image in the training split without a label (schema.UNLABELED), no classes."""
    items = [SourceItem(item_id=schema.make_item_id(name, rel), dataset=name, label=schema.UNLABELED,
                        class_name="", split=schema.TRAIN, role=schema.ROLE_TRAIN,
                        source_path=storage.join(root, rel)) for rel in rel_paths]
    check_unique(name, items)
    return DatasetListing(name, kind, root, items, [], 0, notes={schema.LABELED_KEY: False})


def _class_splits(name: str, entries: Sequence[Entry], labels: dict[str, int]) -> dict[str, str]:
    """The split of every class; a class in both splits or unknown to the class list is an error."""
    out: dict[str, str] = {}
    for e in entries:
        if e.class_key not in labels:
            raise LayoutError(f"{name}: {e.rel_path} has class {e.class_key!r}, not in the class list")
        if e.role not in schema.ROLES:
            raise LayoutError(f"{name}: {e.rel_path} has role {e.role!r}; valid roles: {list(schema.ROLES)}")
        split = schema.TRAIN if e.role == schema.ROLE_TRAIN else schema.TEST
        if out.setdefault(e.class_key, split) != split:
            raise LayoutError(f"{name}: class {e.class_key!r} has images in both train and test; "
                              "splits must be class-disjoint")
    return out


def check_unique(name: str, items: Sequence[SourceItem]) -> None:
    """LayoutError naming the first item id listed twice."""
    seen: set[str] = set()
    for item in items:
        if item.item_id in seen:
            raise LayoutError(f"{name}: {item.item_id} is listed twice in the annotations")
        seen.add(item.item_id)


def read_lines(uri: str) -> list[str]:
    """Non-empty, stripped lines of a text annotation file (UTF-8; a BOM is dropped)."""
    try:
        text = storage.read_text(uri)
    except FileNotFoundError as exc:
        raise LayoutError(f"missing annotation file {uri}") from exc
    return [line.strip() for line in text.lstrip("\ufeff").splitlines() if line.strip()]


def split_pairs(lines: Sequence[str], where: str, parts: int = 2) -> list[list[str]]:
    """Split each line on whitespace into ``parts`` fields (the last keeps its spaces)."""
    out = []
    for number, line in enumerate(lines, 1):
        fields = line.split(maxsplit=parts - 1)
        if len(fields) != parts:
            raise LayoutError(f"{where} line {number}: expected {parts} fields, got {line!r}")
        out.append(fields)
    return out


def find_file(root: str, candidates: Sequence[str], what: str) -> str:
    """The first of ``candidates`` (relative to root) that exists; LayoutError naming them all if none."""
    for rel in candidates:
        uri = storage.join(root, rel)
        if storage.exists(uri):
            return uri
    raise LayoutError(f"{what}: none of {list(candidates)} exists under {root}")
