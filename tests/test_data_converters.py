"""Each official-layout converter on a small tree written here in that layout (real image bytes)."""

from __future__ import annotations

import gzip
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from puma.data import schema
from puma.data.demo import convert_fashion_mnist
from puma.data.layouts import (
    convert_aircraft,
    convert_cars,
    convert_cub,
    convert_dogs,
    convert_flowers,
    convert_folder,
    convert_inshop,
    convert_nabirds,
    convert_sop,
)
from puma.data.listing import DatasetListing, LayoutError
from puma.data.sources import SourceSpec, cap_per_class, convert, preset_specs
from puma.data.stats import count_rows, paper_check

CUB_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "cub200-subset" / "CUB_200_2011"


def _write_images(root: Path, rels, image_bytes) -> None:
    for i, rel in enumerate(rels):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image_bytes(seed=i))


def _check_listing(listing: DatasetListing, num_images: int, train_classes: list[str],
                   test_classes: list[str]) -> None:
    """Counts, class-disjoint splits, training labels first, ids unique, every source file present."""
    assert len(listing.items) == num_images
    by_split = {s: {i.class_name for i in listing.items if i.split == s} for s in ("train", "test")}
    assert by_split == {"train": set(train_classes), "test": set(test_classes)}
    assert listing.class_names == train_classes + test_classes
    assert listing.num_train_classes == len(train_classes)
    for item in listing.items:
        assert (item.label < listing.num_train_classes) == (item.split == "train")
        assert listing.class_names[item.label] == item.class_name
        assert item.item_id.startswith(f"{listing.name}/")
        assert Path(item.source_path).is_file(), item.source_path
    assert len({i.item_id for i in listing.items}) == num_images


def test_cub_layout(tmp_path, cub_tree):
    cub_tree(tmp_path / "CUB_200_2011", num_classes=4, per_class=3)
    listing = convert_cub(str(tmp_path / "CUB_200_2011"))
    _check_listing(listing, 12, ["001.Class_1", "002.Class_2"], ["003.Class_3", "004.Class_4"])
    assert {i.role for i in listing.items if i.split == "test"} == {schema.QUERY}
    assert listing.items[0].item_id == "cub/images/001.Class_1/img_0.jpg"


def test_cub_real_sample():
    listing = convert_cub(str(CUB_SAMPLE))
    assert len(listing.items) == 5902 and listing.num_classes == 100 and listing.num_train_classes == 50
    train = {i.label for i in listing.items if i.split == "train"}
    test = {i.label for i in listing.items if i.split == "test"}
    assert train == set(range(50)) and test == set(range(50, 100)) and not train & test
    assert listing.class_names[0] == "001.Black_footed_Albatross"
    assert sum(i.split == "train" for i in listing.items) == 2949
    assert paper_check("cub", listing.num_classes, {})["status"] == "not_compared"  # a subset


def test_nabirds_layout_uses_leaf_classes_with_images(tmp_path, image_bytes):
    root = tmp_path / "nabirds"
    files = {"a1": ("0295", "295"), "a2": ("0295", "295"), "b1": ("0313", "313"), "c1": ("1010", "1010"),
             "c2": ("1010", "1010")}
    rels = [f"images/{folder}/{uid}.jpg" for uid, (folder, _) in files.items()]
    _write_images(root, rels, image_bytes)
    (root / "images.txt").write_text("".join(f"{u} {f}/{u}.jpg\n" for u, (f, _) in files.items()))
    (root / "image_class_labels.txt").write_text("".join(f"{u} {c}\n" for u, (_, c) in files.items()))
    (root / "classes.txt").write_text(
        "0 Birds\n22 Perching Birds\n295 Blue Jay\n313 Cardinal\n1010 Wren (Carolina)\n")
    listing = convert_nabirds(str(root))
    _check_listing(listing, 5, ["Blue Jay", "Cardinal"], ["Wren (Carolina)"])  # 3 leaves: 2 / 1


def test_cars_layout(tmp_path, image_bytes):
    root = tmp_path / "cars"
    names = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "BMW M3 Coupe 2012", "Volvo 240 Sedan 1993"]
    rows = [(f"car_ims/{i:06d}.jpg", i % 4 + 1, i % 2) for i in range(1, 11)]
    _write_images(root, [r for r, _, _ in rows], image_bytes)
    dtype = [("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"), ("bbox_y2", "O"),
             ("relative_im_path", "O"), ("class", "O"), ("test", "O")]
    annotations = np.zeros((1, len(rows)), dtype=dtype)
    for k, (rel, cls, test) in enumerate(rows):
        annotations[0, k] = (1, 2, 30, 20, rel, np.uint8(cls), np.uint8(test))
    class_names = np.empty((1, 4), dtype=object)
    class_names[0, :] = names
    scipy.io.savemat(root / "cars_annos.mat", {"annotations": annotations, "class_names": class_names})
    listing = convert_cars(str(root))
    _check_listing(listing, 10, names[:2], names[2:])  # the image-level 'test' flag is ignored


CARS_NAMES = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "BMW M3 Coupe 2012",
              "Volvo 240 Sedan 1993"]


def _mat_structs(rows: list[dict]) -> np.ndarray:
    """A MATLAB struct array (1, N) of ``rows``, as scipy.io.savemat writes the releases' annotations."""
    out = np.zeros((1, len(rows)), dtype=[(key, "O") for key in rows[0]])
    for k, row in enumerate(rows):
        out[0, k] = tuple(row.values())
    return out


def _cell(values: list[str]) -> np.ndarray:
    cell = np.empty((1, len(values)), dtype=object)
    cell[0, :] = values
    return cell


def _cars_both_layouts(root: Path, image_bytes, test_annos_in: str) -> tuple[Path, Path]:
    """Twelve images (class k % 4 + 1, the release's image-level test flag k % 3 == 0) written as
    cars_annos.mat over car_ims/ and as the devkit layout over cars_train/ and cars_test/."""
    images = [(k, k % 4 + 1, int(k % 3 == 0)) for k in range(12)]
    box = {"bbox_x1": 1, "bbox_y1": 2, "bbox_x2": 30, "bbox_y2": 20}
    annos, devkit = root / "annos", root / "devkit_layout"
    rows, parts = [], {0: [], 1: []}
    for k, cls, test in images:
        rel = f"car_ims/{k + 1:06d}.jpg"
        (annos / rel).parent.mkdir(parents=True, exist_ok=True)
        (annos / rel).write_bytes(image_bytes(seed=k))
        rows.append({**box, "relative_im_path": rel, "class": np.uint8(cls), "test": np.uint8(test)})
        fname = f"{len(parts[test]) + 1:05d}.jpg"  # each folder numbers its own images from 00001
        folder = devkit / ("cars_test" if test else "cars_train")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / fname).write_bytes(image_bytes(seed=k))
        parts[test].append({**box, "class": np.uint8(cls), "fname": fname})
    scipy.io.savemat(annos / "cars_annos.mat", {"annotations": _mat_structs(rows),
                                                "class_names": _cell(CARS_NAMES)})
    (devkit / "devkit").mkdir()
    scipy.io.savemat(devkit / "devkit" / "cars_train_annos.mat", {"annotations": _mat_structs(parts[0])})
    scipy.io.savemat(devkit / test_annos_in / "cars_test_annos_withlabels.mat",
                     {"annotations": _mat_structs(parts[1])})
    scipy.io.savemat(devkit / "devkit" / "cars_meta.mat", {"class_names": _cell(CARS_NAMES)})
    return annos, devkit


def _by_image(listing: DatasetListing) -> dict[bytes, tuple]:
    """Each item's label, class name, split and role, keyed by its image's bytes."""
    return {Path(i.source_path).read_bytes(): (i.label, i.class_name, i.split, i.role) for i in listing.items}


@pytest.mark.parametrize("test_annos_in", [".", "devkit"])
def test_cars_devkit_layout_converts_exactly_as_cars_annos(tmp_path, image_bytes, test_annos_in):
    """The same images in both layouts: the same items (by image), labels, class names and split; the
    devkit's image-level train / test split is ignored like cars_annos.mat's test flag."""
    annos, devkit = _cars_both_layouts(tmp_path, image_bytes, test_annos_in)
    want, got = convert_cars(str(annos)), convert_cars(str(devkit))
    _check_listing(got, 12, CARS_NAMES[:2], CARS_NAMES[2:])
    assert len(_by_image(want)) == 12 and _by_image(got) == _by_image(want)
    assert (got.class_names, got.num_train_classes) == (want.class_names, want.num_train_classes)
    assert {i.item_id for i in got.items} >= {"cars/cars_train/00001.jpg", "cars/cars_test/00001.jpg"}


def test_cars_devkit_layout_without_test_labels_names_the_file(tmp_path, image_bytes):
    _, devkit = _cars_both_layouts(tmp_path, image_bytes, "devkit")
    (devkit / "devkit" / "cars_test_annos_withlabels.mat").unlink()
    with pytest.raises(LayoutError, match="cars_test_annos_withlabels.mat"):
        convert_cars(str(devkit))


def test_sop_layout_splits_by_files(tmp_path, image_bytes):
    root = tmp_path / "Stanford_Online_Products"
    train = [(1, 1, 1, "bicycle_final/111_0.JPG"), (2, 1, 1, "bicycle_final/111_1.JPG"),
             (3, 2, 2, "chair_final/222_0.JPG"), (4, 2, 2, "chair_final/222_1.JPG")]
    test = [(5, 3, 1, "bicycle_final/333_0.JPG"), (6, 3, 1, "bicycle_final/333_1.JPG"),
            (7, 4, 3, "lamp_final/444_0.JPG")]
    _write_images(root, [r[3] for r in train + test], image_bytes)
    header = "image_id class_id super_class_id path\n"
    (root / "Ebay_train.txt").write_text(header + "".join(" ".join(map(str, r)) + "\n" for r in train))
    (root / "Ebay_test.txt").write_text(header + "".join(" ".join(map(str, r)) + "\n" for r in test))
    listing = convert_sop(str(root))
    _check_listing(listing, 7, ["bicycle/1", "chair/2"], ["bicycle/3", "lamp/4"])
    assert {i.role for i in listing.items} == {schema.ROLE_TRAIN, schema.QUERY}


def test_sop_class_in_both_splits_is_an_error(tmp_path, image_bytes):
    root = tmp_path / "sop"
    _write_images(root, ["a_final/1_0.JPG", "a_final/1_1.JPG"], image_bytes)
    header = "image_id class_id super_class_id path\n"
    (root / "Ebay_train.txt").write_text(header + "1 1 1 a_final/1_0.JPG\n")
    (root / "Ebay_test.txt").write_text(header + "2 1 1 a_final/1_1.JPG\n")
    with pytest.raises(LayoutError, match="both train and test"):
        convert_sop(str(root))


def test_inshop_layout_keeps_query_and_gallery(tmp_path, image_bytes):
    root = tmp_path / "inshop"
    rows = [("img/WOMEN/Dresses/id_00000002/01_1_front.jpg", "id_00000002", "train"),
            ("img/WOMEN/Dresses/id_00000002/01_2_side.jpg", "id_00000002", "train"),
            ("img/MEN/Tees/id_00000001/01_1_front.jpg", "id_00000001", "query"),
            ("img/MEN/Tees/id_00000001/01_2_side.jpg", "id_00000001", "gallery"),
            ("img/MEN/Tees/id_00000005/02_1_front.jpg", "id_00000005", "train"),
            ("img/MEN/Tees/id_00000003/02_1_front.jpg", "id_00000003", "gallery")]
    _write_images(root / "Img", [r[0] for r in rows], image_bytes)
    (root / "Eval").mkdir()
    (root / "Eval" / "list_eval_partition.txt").write_text(
        f"{len(rows)}\nimage_name item_id evaluation_status\n"
        + "".join(f"{p}   {i}   {s}\n" for p, i, s in rows))
    listing = convert_inshop(str(root))
    _check_listing(listing, 6, ["id_00000002", "id_00000005"], ["id_00000001", "id_00000003"])
    roles = {i.item_id.split("/", 1)[1]: i.role for i in listing.items}
    assert [roles[p] for p, _, _ in rows] == ["train", "train", "query", "gallery", "train", "gallery"]


def test_dogs_layout(tmp_path, image_bytes):
    root = tmp_path / "dogs"
    files = ["n02085620-Chihuahua/n02085620_1.jpg", "n02085620-Chihuahua/n02085620_2.jpg",
             "n02085782-Japanese_spaniel/n02085782_1.jpg", "n02086079-Pekinese/n02086079_1.jpg",
             "n02086240-Shih-Tzu/n02086240_1.jpg"]
    _write_images(root / "Images", files, image_bytes)
    file_list = np.empty((len(files), 1), dtype=object)
    file_list[:, 0] = files
    scipy.io.savemat(root / "file_list.mat", {"file_list": file_list, "annotation_list": file_list,
                                              "labels": np.array([[1], [1], [2], [3], [4]])})
    listing = convert_dogs(str(root))
    _check_listing(listing, 5, ["Chihuahua", "Japanese_spaniel"], ["Pekinese", "Shih-Tzu"])


def test_flowers_layout_checks_setid(tmp_path, image_bytes):
    root = tmp_path / "flowers102"
    labels = [1, 2, 2, 3, 4, 4, 1]
    _write_images(root, [f"jpg/image_{i:05d}.jpg" for i in range(1, 8)], image_bytes)
    scipy.io.savemat(root / "imagelabels.mat", {"labels": np.array([labels])})
    scipy.io.savemat(root / "setid.mat", {"trnid": np.array([[1, 2]]), "valid": np.array([[3]]),
                                          "tstid": np.array([[4, 5, 6, 7]])})
    listing = convert_flowers(str(root))
    _check_listing(listing, 7, ["class_001", "class_002"], ["class_003", "class_004"])
    scipy.io.savemat(root / "setid.mat", {"trnid": np.array([[1, 2]]), "valid": np.array([[3]]),
                                          "tstid": np.array([[4, 5]])})
    with pytest.raises(LayoutError, match="setid.mat"):
        convert_flowers(str(root))


def test_aircraft_layout_orders_classes_by_variants_file(tmp_path, image_bytes):
    data = tmp_path / "fgvc-aircraft-2013b" / "data"
    parts = {"train": [("0001", "Cessna 172"), ("0002", "A300B4")], "val": [("0003", "747-400")],
             "test": [("0004", "DHC-1"), ("0005", "Cessna 172")]}
    _write_images(data, [f"images/{i}.jpg" for rows in parts.values() for i, _ in rows], image_bytes)
    for part, rows in parts.items():
        (data / f"images_variant_{part}.txt").write_text("".join(f"{i} {v}\n" for i, v in rows))
    (data / "variants.txt").write_text("A300B4\nCessna 172\n747-400\nDHC-1\n")
    listing = convert_aircraft(str(tmp_path / "fgvc-aircraft-2013b"))
    _check_listing(listing, 5, ["A300B4", "Cessna 172"], ["747-400", "DHC-1"])


def test_folder_layout_class_depth_and_ignored_files(tmp_path, image_bytes):
    root = tmp_path / "omni"
    rels = ["Greek/char01/a.png", "Greek/char01/b.png", "Greek/char02/a.png", "Latin/char01/a.PNG",
            "Latin/char02/a.jpg", "Latin/char02/b.jpg"]
    _write_images(root, rels, image_bytes)
    (root / "README.txt").write_text("not an image")
    (root / "Greek" / "notes.md").write_text("not an image")
    listing = convert_folder(str(root), "omniglot", class_depth=2)
    _check_listing(listing, 6, ["Greek/char01", "Greek/char02"], ["Latin/char01", "Latin/char02"])
    assert listing.notes["ignored_files"] == 2
    assert convert_folder(str(root), "alphabets", class_depth=1).class_names == ["Greek", "Latin"]


def test_fashion_mnist_idx_with_cap(tmp_path):
    rng = np.random.default_rng(0)
    for part, n in (("train", 40), ("t10k", 20)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (tmp_path / f"{part}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes()))
        (tmp_path / f"{part}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", 0x801, n) + labels.tobytes()))
    listing = convert_fashion_mnist(str(tmp_path), max_per_class=5)
    assert len(listing.items) == 50 and listing.num_train_classes == 5
    counts = count_rows((i.dataset, i.label, i.split, i.role) for i in listing.items)["fashion_mnist"]
    assert counts["train"] == {"images": 25, "classes": 5} and counts["test"] == {"images": 25, "classes": 5}
    first = listing.items[0]
    assert first.item_id == "fashion_mnist/train/00000.png" and first.class_name == "T-shirt/top"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(first.data))), images_of(tmp_path, "train")[0])
    assert any(i.item_id.startswith("fashion_mnist/t10k/") for i in listing.items)  # cap not reached in train


def images_of(root: Path, part: str) -> np.ndarray:
    raw = gzip.decompress((root / f"{part}-images-idx3-ubyte.gz").read_bytes())
    n = struct.unpack(">I", raw[4:8])[0]
    return np.frombuffer(raw, np.uint8, offset=16).reshape(n, 28, 28)


def test_cap_per_class_keeps_first_items(tmp_path, cub_tree):
    cub_tree(tmp_path / "c", num_classes=2, per_class=5)
    listing = cap_per_class(convert(SourceSpec("cub", "cub", str(tmp_path / "c"))), 2)
    assert sorted(i.item_id.rsplit("/", 1)[1] for i in listing.items) == ["img_0.jpg", "img_0.jpg",
                                                                         "img_1.jpg", "img_1.jpg"]


def test_missing_annotation_file_is_a_layout_error(tmp_path):
    with pytest.raises(LayoutError, match="images.txt"):
        convert_cub(str(tmp_path))
    with pytest.raises(LayoutError, match="cars_annos.mat"):
        convert_cars(str(tmp_path))


def test_paper_table1_check():
    full_cub = {"train": {"images": 5864, "classes": 100}, "test": {"images": 5924, "classes": 100}}
    assert paper_check("cub", 200, full_cub)["status"] == "ok"
    wrong = {**full_cub, "train": {"images": 5500, "classes": 100}}
    check = paper_check("cub", 200, wrong)
    assert check["status"] == "differs" and not check["values"]["train_images"]["ok"]
    inshop = {"train": {"images": 25882, "classes": 3997}, "test": {"images": 26830, "classes": 3985}}
    check = paper_check("inshop", 7982, inshop)
    assert check["status"] == "differs" and "26,830" in check["note"]
    assert [k for k, v in check["values"].items() if not v["ok"]] == ["test_images"]
    sop = {"train": {"images": 59551, "classes": 11318}, "test": {"images": 60502, "classes": 11316}}
    assert paper_check("sop", 22634, sop)["status"] == "ok"


def test_preset_specs_parsing():
    assert preset_specs(["cub"], ["/data/CUB_200_2011"]) == [SourceSpec("cub", "cub", "/data/CUB_200_2011")]
    specs = preset_specs(["cub", "cars"], ["cars=s3://b/cars", "cub=/d/cub"])
    assert [(s.name, s.uri) for s in specs] == [("cub", "/d/cub"), ("cars", "s3://b/cars")]
    assert len(preset_specs(["paper"], [f"{p}=/r/{p}" for p in ("cub", "cars", "sop", "inshop", "nabirds",
                                                                 "dogs", "flowers", "aircraft")])) == 8
    assert preset_specs(["folder"], ["/x/products"], class_depth=2)[0] == SourceSpec("folder", "products",
                                                                                      "/x/products", 2)
    with pytest.raises(LayoutError, match="missing"):
        preset_specs(["cub", "cars"], ["cub=/d/cub"])
    with pytest.raises(LayoutError, match="reserved"):
        SourceSpec("folder", "unified", "/x")
