"""Converters from each dataset's official release layout (and a class-per-folder layout) to listings.

Every converter takes the release's root (a local path or s3:// URI; for a catalogue table, the
table file), reads only the annotation files, and returns a ``DatasetListing``: item ids, labels
(training classes first), split and role, and where each image's bytes are. Bytes are read later,
by ``puma.data.prepare``.

Splits follow DESIGN.md section 2: the first half of the classes train and the second half test
(official image-level splits ignored) for CUB, Cars, NABirds, Dogs, Flowers and Aircraft; SOP by
Ebay_train.txt / Ebay_test.txt; In-Shop by list_eval_partition.txt (train / query / gallery).
"""

from __future__ import annotations

import io
import posixpath
from collections.abc import Callable

import numpy as np

from puma import storage
from puma.data import schema
from puma.data.listing import (
    DatasetListing,
    Entry,
    LayoutError,
    SourceItem,
    build_listing,
    check_unique,
    find_file,
    half_split_listing,
    num_train_classes,
    read_lines,
    split_pairs,
    unlabeled_listing,
)
from puma.data.rejects import Reject, reject_counts
from puma.data.tables import NO_LABEL, REJECT_STAGE, read_item_table

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def _sorted_numeric(keys) -> list[str]:
    return sorted(set(keys), key=lambda k: (int(k), k) if k.isdigit() else (float("inf"), k))


# ----------------------------------------------------------------------------- CUB-200-2011, NABirds


def convert_cub(root: str, name: str = "cub") -> DatasetListing:
    """CUB_200_2011: images.txt, image_class_labels.txt, classes.txt; images under images/."""
    return _convert_caltech_style(root, name, "cub", "CUB_200_2011")


def convert_nabirds(root: str, name: str = "nabirds") -> DatasetListing:
    """NABirds: the same files as CUB; classes are the 555 leaf categories that have images."""
    return _convert_caltech_style(root, name, "nabirds", "NABirds")


def _convert_caltech_style(root: str, name: str, kind: str, release: str) -> DatasetListing:
    """images.txt (id path), image_class_labels.txt (id class), classes.txt (class name)."""
    where = f"{release} at {root}"
    paths = dict(split_pairs(read_lines(storage.join(root, "images.txt")), f"{where}: images.txt"))
    labels = dict(split_pairs(read_lines(storage.join(root, "image_class_labels.txt")),
                              f"{where}: image_class_labels.txt"))
    names = dict(split_pairs(read_lines(storage.join(root, "classes.txt")), f"{where}: classes.txt"))
    if set(paths) != set(labels):
        raise LayoutError(f"{where}: images.txt and image_class_labels.txt list different image ids "
                          f"({len(paths)} vs {len(labels)})")
    classes = _sorted_numeric(labels.values())  # only classes that have images (NABirds: 555 leaves)
    unknown = sorted(set(classes) - set(names))
    if unknown:
        raise LayoutError(f"{where}: class ids {unknown[:5]} are not in classes.txt")
    entries = [Entry(posixpath.join("images", paths[i]), labels[i]) for i in paths]
    return half_split_listing(name, kind, root, entries, classes, names)


# ----------------------------------------------------------------------------- Cars-196


def _loadmat(uri: str) -> dict:
    from scipy.io import loadmat

    try:
        data = storage.read_bytes(uri)
    except FileNotFoundError as exc:
        raise LayoutError(f"missing annotation file {uri}") from exc
    return loadmat(io.BytesIO(data), squeeze_me=True, struct_as_record=False)


def _mat_field(mat: dict, key: str, uri: str) -> np.ndarray:
    if key not in mat:
        found = sorted(k for k in mat if not k.startswith("_"))
        raise LayoutError(f"{uri} has no variable {key!r}; found {found}")
    return np.atleast_1d(mat[key])


CARS_ANNOS = ["cars_annos.mat", "devkit/cars_annos.mat"]  # one file: every image, car_ims/
CARS_DEVKIT = "devkit/cars_train_annos.mat"  # the devkit layout: cars_train/ and cars_test/ apart


def convert_cars(root: str, name: str = "cars") -> DatasetListing:
    """Cars-196 in either layout: cars_annos.mat (annotations.relative_im_path, .class; class_names) over
    car_ims/, or the devkit's (see _cars_devkit) over cars_train/ and cars_test/; the same images get
    the same labels, class names and split in both (their item ids follow their paths)."""
    uri = find_file(root, [*CARS_ANNOS, CARS_DEVKIT], f"Cars-196 at {root}")
    devkit = posixpath.basename(uri) == posixpath.basename(CARS_DEVKIT)
    entries, names = _cars_devkit(root, uri) if devkit else _cars_annos(uri)
    classes = [str(i) for i in range(1, len(names) + 1)]
    return half_split_listing(name, "cars", root, entries, classes, dict(zip(classes, names, strict=True)))


def _cars_annos(uri: str) -> tuple[list[Entry], list[str]]:
    """cars_annos.mat: every image's relative_im_path and 1-based class; class_names."""
    mat = _loadmat(uri)
    annotations = _mat_field(mat, "annotations", uri)
    names = [str(n) for n in _mat_field(mat, "class_names", uri)]
    try:
        entries = [Entry(str(a.relative_im_path), str(int(getattr(a, "class")))) for a in annotations]
    except AttributeError as exc:
        raise LayoutError(f"{uri}: annotations need fields relative_im_path and class ({exc})") from exc
    return entries, names


def _cars_devkit(root: str, train_uri: str) -> tuple[list[Entry], list[str]]:
    """The devkit layout: devkit/cars_train_annos.mat (fname in cars_train/, 1-based class) and
    cars_test_annos_withlabels.mat (cars_test/; next to devkit/ or inside it); devkit/cars_meta.mat's
    class_names. The release's image-level train / test split is ignored, as cars_annos.mat's is."""
    where = f"Cars-196 devkit layout at {root}"
    test_uri = find_file(root, ["cars_test_annos_withlabels.mat", "devkit/cars_test_annos_withlabels.mat"],
                         f"{where} (the test images' labels: devkit/cars_test_annos.mat has none)")
    meta_uri = find_file(root, ["devkit/cars_meta.mat", "cars_meta.mat"], f"{where} (the class names)")
    names = [str(n) for n in _mat_field(_loadmat(meta_uri), "class_names", meta_uri)]
    return _cars_fname_entries(train_uri, "cars_train") + _cars_fname_entries(test_uri, "cars_test"), names


def _cars_fname_entries(uri: str, folder: str) -> list[Entry]:
    """A devkit annotation file's images (``fname`` under ``folder``) with their 1-based class."""
    annotations = _mat_field(_loadmat(uri), "annotations", uri)
    try:
        return [Entry(posixpath.join(folder, str(a.fname)), str(int(getattr(a, "class"))))
                for a in annotations]
    except AttributeError as exc:
        raise LayoutError(f"{uri}: annotations need fields fname and class ({exc})") from exc


# ----------------------------------------------------------------------------- Stanford Dogs, Flowers-102


def convert_dogs(root: str, name: str = "dogs") -> DatasetListing:
    """Stanford Dogs: file_list.mat (file_list, labels 1..120); images under Images/."""
    uri = find_file(root, ["file_list.mat", "lists/file_list.mat"], f"Stanford Dogs at {root}")
    mat = _loadmat(uri)
    files = [str(f) for f in _mat_field(mat, "file_list", uri)]
    labels = [str(int(v)) for v in _mat_field(mat, "labels", uri)]
    if len(files) != len(labels):
        raise LayoutError(f"{uri}: {len(files)} files but {len(labels)} labels")
    names = {lab: f.split("/")[0].split("-", 1)[-1] for f, lab in zip(files, labels, strict=True)}
    entries = [Entry(posixpath.join("Images", f), lab) for f, lab in zip(files, labels, strict=True)]
    return half_split_listing(name, "dogs", root, entries, _sorted_numeric(labels), names)


def convert_flowers(root: str, name: str = "flowers") -> DatasetListing:
    """Flowers-102: imagelabels.mat (labels 1..102) for jpg/image_%05d.jpg; setid.mat checked if present."""
    uri = find_file(root, ["imagelabels.mat"], f"Flowers-102 at {root}")
    labels = [str(int(v)) for v in _mat_field(_loadmat(uri), "labels", uri)]
    setid = storage.join(root, "setid.mat")
    if storage.exists(setid):
        _check_flowers_setid(setid, len(labels))
    entries = [Entry(f"jpg/image_{i:05d}.jpg", lab) for i, lab in enumerate(labels, 1)]
    classes = _sorted_numeric(labels)
    names = {c: f"class_{int(c):03d}" for c in classes}  # the release has no class-name file
    return half_split_listing(name, "flowers", root, entries, classes, names)


def _check_flowers_setid(uri: str, num_images: int) -> None:
    """setid.mat's trnid/valid/tstid must cover exactly the labelled images (its split is ignored)."""
    mat = _loadmat(uri)
    ids = np.concatenate([_mat_field(mat, key, uri).astype(np.int64) for key in ("trnid", "valid", "tstid")])
    if sorted(ids.tolist()) != list(range(1, num_images + 1)):
        raise LayoutError(f"{uri}: trnid/valid/tstid do not cover images 1..{num_images} exactly once")


# ----------------------------------------------------------------------------- FGVC-Aircraft


def convert_aircraft(root: str, name: str = "aircraft") -> DatasetListing:
    """FGVC-Aircraft: data/images_variant_{train,val,test}.txt ("id variant"), data/variants.txt."""
    has_data_dir = not storage.exists(storage.join(root, "images_variant_test.txt"))
    data = storage.join(root, "data") if has_data_dir else root
    variants: dict[str, str] = {}
    for part in ("train", "val", "trainval", "test"):
        uri = storage.join(data, f"images_variant_{part}.txt")
        if part != "trainval" and not storage.exists(uri):
            raise LayoutError(f"FGVC-Aircraft at {root}: missing {uri}")
        if storage.exists(uri):
            for image_id, variant in split_pairs(read_lines(uri), uri):
                if variants.setdefault(image_id, variant) != variant:
                    raise LayoutError(f"{uri}: image {image_id} has variants "
                                      f"{variants[image_id]!r} and {variant!r}")
    order_uri = storage.join(data, "variants.txt")
    order = read_lines(order_uri) if storage.exists(order_uri) else sorted(set(variants.values()))
    entries = [Entry(f"images/{i}.jpg", v) for i, v in sorted(variants.items())]
    listing = half_split_listing(name, "aircraft", data, entries, order)
    listing.source = root
    return listing


# ----------------------------------------------------------------------------- SOP, In-Shop


def convert_sop(root: str, name: str = "sop") -> DatasetListing:
    """Stanford Online Products: Ebay_train.txt / Ebay_test.txt (image_id class_id super_class_id path)."""
    entries, classes = [], {schema.TRAIN: set(), schema.TEST: set()}
    names: dict[str, str] = {}
    for split, role, file in ((schema.TRAIN, schema.ROLE_TRAIN, "Ebay_train.txt"),
                              (schema.TEST, schema.QUERY, "Ebay_test.txt")):
        uri = storage.join(root, file)
        lines = read_lines(uri)
        for _, class_id, _, path in split_pairs(lines[1:], uri, parts=4):  # line 1 is the header
            entries.append(Entry(path, class_id, role))
            classes[split].add(class_id)
            names[class_id] = f"{path.split('/')[0].removesuffix('_final')}/{class_id}"
    test_only = classes[schema.TEST] - classes[schema.TRAIN]  # a class in both is reported by build_listing
    order = _sorted_numeric(classes[schema.TRAIN]) + _sorted_numeric(test_only)
    return build_listing(name, "sop", root, entries, order, names)


INSHOP_ROLES = {"train": schema.ROLE_TRAIN, "query": schema.QUERY, "gallery": schema.GALLERY}


def convert_inshop(root: str, name: str = "inshop") -> DatasetListing:
    """In-Shop: list_eval_partition.txt (count, header, then "image_name item_id evaluation_status")."""
    uri = find_file(root, ["Eval/list_eval_partition.txt", "list_eval_partition.txt"], f"In-Shop at {root}")
    rows = split_pairs(read_lines(uri)[2:], uri, parts=3)
    unknown = sorted({status for _, _, status in rows} - set(INSHOP_ROLES))
    if unknown:
        raise LayoutError(f"{uri}: unknown evaluation_status {unknown}; valid: {sorted(INSHOP_ROLES)}")
    entries = [Entry(path, item, INSHOP_ROLES[status]) for path, item, status in rows]
    train = sorted({e.class_key for e in entries if e.role == schema.ROLE_TRAIN})
    test = sorted({e.class_key for e in entries} - set(train))
    image_root = _inshop_image_root(root, entries[0].rel_path if entries else "")
    return build_listing(name, "inshop", root, entries, train + test, image_root=image_root)


def _inshop_image_root(root: str, first: str) -> str:
    """Image paths start with img/: the release keeps img/ at the root or under Img/."""
    for base in (root, storage.join(root, "Img")):
        if first and storage.exists(storage.join(base, first)):
            return base
    return root


# ----------------------------------------------------------------------------- class-per-folder


def convert_folder(root: str, name: str, class_depth: int = 1) -> DatasetListing:
    """``root/<class>/.../<image>``; the class is the first ``class_depth`` folders (Omniglot: 2).

    ``class_depth = 0``: an unlabeled catalogue, every image under ``root`` at any depth, all in the
    training split without labels (``schema.UNLABELED``; see puma.data.schema).

    Files that are not images (by extension) or that sit above the class level are ignored and
    counted in ``notes['ignored_files']``.
    """
    if class_depth < 0:
        raise LayoutError(f"class_depth must be >= 0 (0: unlabeled), got {class_depth}")
    base = _listing_base(root)
    entries, ignored = [], []
    for uri in storage.list_files(root):
        rel = uri[len(base):].lstrip("/")
        parts = rel.split("/")
        if len(parts) <= class_depth or not rel.lower().endswith(IMAGE_EXTENSIONS):
            ignored.append(rel)
            continue
        entries.append(Entry(rel, "/".join(parts[:class_depth])))
    if not entries:
        raise LayoutError(f"no images found under {root} at class depth {class_depth} "
                          f"(extensions {list(IMAGE_EXTENSIONS)})")
    if class_depth == 0:
        listing = unlabeled_listing(name, "folder", root, [e.rel_path for e in entries])
    else:
        listing = half_split_listing(name, "folder", root, entries, sorted({e.class_key for e in entries}))
    listing.notes["ignored_files"] = len(ignored)
    return listing


def _listing_base(root: str) -> str:
    """The prefix ``storage.list_files`` puts before relative paths under ``root``."""
    if storage.is_s3(root):
        return str(root).rstrip("/")
    return storage.resolve(root)[1]


# ----------------------------------------------------------------------------- catalogue table


def convert_table(root: str, name: str) -> DatasetListing:
    """A catalogue table (CSV, JSONL or Parquet; see puma.data.tables); ``root`` is the table file.

    Labels come from its ``label`` column, classes in label order (text labels sorted), the first
    half training; a table without labels is an unlabeled catalogue (as ``folder`` at class depth 0).
    Item ids are ``<name>/<item_id>``. Rows the table reader rejects and, in a labeled table, rows
    without a label (``missing_label``) go to ``listing.rejects``. Every row belongs to dataset
    ``name``: a ``dataset`` column naming another is an error (prepare one table per dataset).
    """
    table = read_item_table(root, name)
    rows = table.rows.to_pylist()
    _check_one_dataset(root, name, rows)
    rejects = _table_rejects(name, table.rejects)
    labeled = [r for r in rows if r["label"] != NO_LABEL]
    if labeled:
        listing = _labeled_table_listing(root, name, labeled)
        rejects += [_missing_label(root, name, r) for r in rows if r["label"] == NO_LABEL]
    else:
        items = [_table_item(name, r, schema.UNLABELED, "", schema.ROLE_TRAIN) for r in rows]
        listing = DatasetListing(name, "table", root, items, [], 0, notes={schema.LABELED_KEY: False})
    if not listing.items:
        counts = reject_counts(r.to_dict() for r in rejects)
        raise LayoutError(f"{root}: no usable rows ({len(rejects)} rejected: {counts}); every row needs "
                          "an item_id and an image_uri")
    check_unique(name, listing.items)
    listing.rejects = rejects
    return listing


def _labeled_table_listing(root: str, name: str, rows: list[dict]) -> DatasetListing:
    """Classes in the reader's label order; the first half train (role train), the rest test (query)."""
    keys = sorted({r["label"] for r in rows})
    index = {key: i for i, key in enumerate(keys)}
    class_names = {r["label"]: r["class_name"] or str(r["label"]) for r in rows}
    n_train = num_train_classes(len(keys))
    items = [_table_item(name, r, index[r["label"]], class_names[r["label"]],
                         schema.ROLE_TRAIN if index[r["label"]] < n_train else schema.QUERY) for r in rows]
    return DatasetListing(name, "table", root, items, [class_names[k] for k in keys], n_train)


def _table_item(name: str, row: dict, label: int, class_name: str, role: str) -> SourceItem:
    split = schema.TRAIN if role == schema.ROLE_TRAIN else schema.TEST
    return SourceItem(item_id=schema.make_item_id(name, row["item_id"]), dataset=name, label=label,
                      class_name=class_name, split=split, role=role, source_path=row["image_uri"])


def _table_rejects(name: str, rejects: list[dict]) -> list[Reject]:
    """The reader's rejects with prepared item ids, one per item id (its detail names every row)."""
    out: dict[str, Reject] = {}
    for r in rejects:
        item_id = schema.make_item_id(name, r["item_id"])
        out.setdefault(item_id, Reject(**{**r, "item_id": item_id, "dataset": name}))
    return list(out.values())


def _missing_label(root: str, name: str, row: dict) -> Reject:
    """The reject of a row without a label in a labeled table."""
    return Reject(schema.make_item_id(name, row["item_id"]), name, "missing_label", REJECT_STAGE,
                  row["image_uri"], detail=f"{root} row {row['source_row']}: no label, though other rows "
                                           "have one")


def _check_one_dataset(root: str, name: str, rows: list[dict]) -> None:
    """LayoutError when a row's dataset column names another dataset than ``name``."""
    others = sorted({r["dataset"] for r in rows} - {name})
    if others:
        raise LayoutError(f"{root}: rows name datasets {others[:5]}, but the table is prepared as dataset "
                          f"{name!r}; prepare one table per dataset (split the table, or drop its dataset "
                          "column and name it with --name)")


CONVERTERS: dict[str, Callable[..., DatasetListing]] = {
    "cub": convert_cub, "cars": convert_cars, "sop": convert_sop, "inshop": convert_inshop,
    "nabirds": convert_nabirds, "dogs": convert_dogs, "flowers": convert_flowers,
    "aircraft": convert_aircraft, "folder": convert_folder, "table": convert_table,
}
