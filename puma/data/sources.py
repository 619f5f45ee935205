"""What to prepare: source specs (layout, dataset name, root URI) and the presets that build them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from puma import storage
from puma.data.demo import DEMO_PER_CLASS, convert_fashion_mnist, resolve_local_root
from puma.data.layouts import CONVERTERS
from puma.data.listing import DatasetListing, LayoutError
from puma.data.tables import table_stem

OFFICIAL = ("cub", "cars", "sop", "inshop", "nabirds", "dogs", "flowers", "aircraft")
KINDS = (*CONVERTERS, "fashion_mnist")
PRESETS = ("demo", *OFFICIAL, "folder", "table", "paper")  # paper: all eight official datasets


@dataclass(frozen=True)
class SourceSpec:
    """One dataset to convert: its layout (``kind``), its name in the prepared data, its root."""

    kind: str
    name: str
    uri: str
    class_depth: int = 1  # folder layout only
    max_per_class: int | None = None  # fashion_mnist only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"unknown layout {self.kind!r}; valid: {list(KINDS)}")
        if not self.name or "/" in self.name or self.name in ("unified", "harmonic"):
            raise LayoutError(f"dataset name {self.name!r} must be non-empty, without '/', "
                              "and not 'unified' or 'harmonic' (reserved by the metrics)")

    def to_dict(self) -> dict:
        return asdict(self)


def convert(spec: SourceSpec) -> DatasetListing:
    """Run the converter for ``spec``, then keep at most ``max_per_class`` images per class."""
    if spec.kind == "fashion_mnist":
        return convert_fashion_mnist(spec.uri, spec.name, spec.max_per_class)
    if spec.kind == "folder":
        listing = CONVERTERS["folder"](spec.uri, spec.name, spec.class_depth)
    else:
        listing = CONVERTERS[spec.kind](spec.uri, spec.name)
    return cap_per_class(listing, spec.max_per_class)


def cap_per_class(listing: DatasetListing, max_per_class: int | None) -> DatasetListing:
    """The first ``max_per_class`` items of each class in item-id order (None: all)."""
    if max_per_class is None:
        return listing
    taken: dict[int, int] = {}
    kept = []
    for item in sorted(listing.items, key=lambda i: i.item_id):
        taken[item.label] = taken.get(item.label, 0) + 1
        if taken[item.label] <= max_per_class:
            kept.append(item)
    listing.items = kept
    listing.notes["max_per_class"] = max_per_class
    return listing


def demo_specs(data_cfg) -> list[SourceSpec]:
    """The demo preset from ``data.source_root`` and ``data.fashion_mnist_dir`` (see puma.data.demo)."""
    root = resolve_local_root(data_cfg.source_root)
    cap = data_cfg.max_images_per_class or DEMO_PER_CLASS
    return [SourceSpec("cub", "cub", storage.join(root, "cub200-subset", "CUB_200_2011"), max_per_class=cap),
            SourceSpec("folder", "flowers", storage.join(root, "flowers12-subset"), 1, cap),
            SourceSpec("folder", "omniglot", storage.join(root, "omniglot-subset"), 2, cap),
            SourceSpec("fashion_mnist", "fashion_mnist", resolve_local_root(data_cfg.fashion_mnist_dir),
                       max_per_class=data_cfg.fashion_mnist_per_class)]


def preset_specs(presets: Sequence[str], sources: Sequence[str], name: str = "", class_depth: int = 1
                 ) -> list[SourceSpec]:
    """Specs for official presets: one plain root per preset, or ``name=root`` pairs in any order.

    ``paper`` expands to the eight official datasets. The folder preset takes ``name`` (default:
    the root's last path component) and ``class_depth``; the table preset (the source is a CSV,
    JSONL or Parquet catalogue table, see puma.data.tables) takes ``name`` (default: the file's stem).
    """
    presets = [p for preset in presets for p in (OFFICIAL if preset == "paper" else [preset])]
    bad = sorted(set(presets) - set(PRESETS) | ({"demo"} & set(presets)))
    if bad:
        raise LayoutError(f"presets {bad} cannot be combined here; valid: {list(PRESETS)} (demo alone)")
    roots = _match_sources(presets, sources)
    specs = []
    for preset in presets:
        root = roots[preset]
        if preset == "folder":
            specs.append(SourceSpec("folder", name or root.rstrip("/").split("/")[-1], root, class_depth))
        elif preset == "table":
            specs.append(SourceSpec("table", name or table_stem(root), root))
        else:
            specs.append(SourceSpec(preset, preset, root))
    return specs


def _match_sources(presets: Sequence[str], sources: Sequence[str]) -> dict[str, str]:
    """``--source ROOT`` for a single preset, else ``--source preset=ROOT`` for each."""
    if len(presets) == 1 and len(sources) == 1 and "=" not in sources[0].split("/")[0]:
        return {presets[0]: sources[0]}
    pairs = dict(s.split("=", 1) for s in sources if "=" in s)
    missing = [p for p in presets if p not in pairs]
    if missing or len(pairs) != len(sources):
        raise LayoutError(f"give one --source preset=ROOT for each of {list(presets)}; missing {missing}, "
                          f"got {list(sources)}")
    return pairs
