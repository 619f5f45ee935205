"""Catalogue tables (CSV, JSONL, Parquet) on disk and on S3: rows, labels, metadata, rejects, prepare."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from puma import storage
from puma.data import schema
from puma.data.rejects import TABLE_REASONS, read_rejects
from puma.data.tables import ROWS_SCHEMA, TableError, is_table, read_item_table, table_stem
from puma.errors import UserError

REPO = Path(__file__).resolve().parents[1]
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
SPECIES = ("bluebell", "daisy", "iris", "sunflower")
sys.path.insert(0, str(REPO / "jobs"))
import prepare_data  # noqa: E402


def _photos(species: str, n: int) -> list[Path]:
    """The first ``n`` real photos of a flower species."""
    found = sorted((FLOWERS / species).glob("*.jpg"))[:n]
    if len(found) < n:
        pytest.skip(f"the flowers sample ({FLOWERS}) is not here")
    return found


def _csv(path: Path, header: str, rows: list[str]) -> Path:
    path.write_text(header + "\n" + "".join(r + "\n" for r in rows))
    return path


def _meta(table, column: str = "metadata") -> list[dict]:
    return [json.loads(m) for m in table.rows[column].to_pylist()]


def test_csv_table_resolves_paths_numbers_text_labels_and_keeps_other_columns(tmp_path):
    daisy, iris = _photos("daisy", 2), _photos("iris", 1)
    (tmp_path / "img").mkdir()
    shutil.copy(daisy[1], tmp_path / "img" / "d1.jpg")
    table_path = _csv(tmp_path / "Shop.CSV", "item_id, image_uri ,label,price,colour", [
        f"007,{daisy[0]},daisy,12.5,white",  # absolute path; '007' stays text
        "008,img/d1.jpg,daisy,,",  # relative to the table's folder; empty cells are null
        f"009,./img/../{iris[0].name},iris,3,blue",  # relative, normalised (the file need not exist here)
    ])
    assert is_table(str(table_path)) and table_stem(str(table_path)) == "Shop"
    table = read_item_table(str(table_path))
    assert table.rows.schema == ROWS_SCHEMA and table.rows.column_names == [
        "item_id", "image_uri", "label", "class_name", "dataset", "metadata", "source_row"]
    assert table.rows["item_id"].to_pylist() == ["007", "008", "009"]
    assert table.rows["image_uri"].to_pylist() == [str(daisy[0]), str(tmp_path / "img" / "d1.jpg"),
                                                   str(tmp_path / iris[0].name)]
    assert table.rows["label"].to_pylist() == [0, 0, 1]  # sorted text labels: daisy 0, iris 1
    assert table.rows["class_name"].to_pylist() == ["daisy", "daisy", "iris"]
    assert table.rows["dataset"].to_pylist() == ["Shop"] * 3  # the file's stem
    assert table.rows["source_row"].to_pylist() == [2, 3, 4]  # the header is row 1
    assert table.metadata_columns == ["price", "colour"]
    assert table.rows["metadata"][0].as_py() == '{"colour": "white", "price": "12.5"}'  # keys sorted
    assert _meta(table)[1:] == [{"colour": None, "price": None}, {"colour": "blue", "price": "3"}]
    assert table.rejects == [] and table.uri == str(table_path)
    assert Path(table.rows["image_uri"][1].as_py()).read_bytes() == daisy[1].read_bytes()


def test_jsonl_table_integer_labels_datasets_and_typed_metadata(tmp_path):
    photos = _photos("sunflower", 4)
    lines = [
        {"item_id": 1, "image_uri": str(photos[0]), "label": 7, "price": 9.5, "tags": ["a", "b"]},
        {"item_id": "2", "image_uri": str(photos[1]), "label": "3", "in_stock": True},
        {"item_id": "3", "image_uri": str(photos[2]), "label": None, "dataset": "garden"},
        {"item_id": "4", "image_uri": str(photos[3]), "label": "rose", "dataset": "garden"},
        {"item_id": "5", "image_uri": str(photos[3])},
    ]
    path = tmp_path / "items.jsonl"
    text = [json.dumps(r) for r in lines]
    path.write_text("\n".join(text[:2]) + "\n\n" + "\n".join(text[2:]))  # a blank line 3
    table = read_item_table(str(path), dataset="shop")
    rows = table.rows.to_pylist()
    assert [r["item_id"] for r in rows] == ["1", "2", "3", "4", "5"]
    assert [r["source_row"] for r in rows] == [1, 2, 4, 5, 6]  # file lines; the blank line 3 is skipped
    assert [r["dataset"] for r in rows] == ["shop", "shop", "garden", "garden", "shop"]
    labels = [(r["label"], r["class_name"]) for r in rows]
    assert labels == [(7, ""), (3, ""), (-1, ""), (0, "rose"), (-1, "")]  # ints per dataset, text numbered
    assert table.metadata_columns == ["price", "tags", "in_stock"]
    assert _meta(table)[:2] == [{"price": 9.5, "tags": ["a", "b"], "in_stock": None},
                                {"price": None, "tags": None, "in_stock": True}]


def test_parquet_table_float_labels_with_gaps_stay_integer(tmp_path):
    photos = _photos("iris", 3)
    (tmp_path / "cat").mkdir()
    for p in photos:
        shutil.copy(p, tmp_path / "cat" / p.name)
    pq.write_table(pa.table({  # as pandas writes an integer column with a gap: float64 with NaN
        "item_id": pa.array([101, 102, 103], pa.int64()),
        "image_uri": [p.name for p in photos],
        "label": pa.array([2.0, None, 5.0], pa.float64()),
        "score": pa.array([0.5, float("nan"), 1.0]),
    }), tmp_path / "cat" / "iris.parquet")
    table = read_item_table(str(tmp_path / "cat" / "iris.parquet"))
    assert table.rows["item_id"].to_pylist() == ["101", "102", "103"]
    assert table.rows["label"].to_pylist() == [2, -1, 5] and set(table.rows["class_name"].to_pylist()) == {""}
    assert table.rows["image_uri"].to_pylist() == [str(tmp_path / "cat" / p.name) for p in photos]
    assert table.rows["source_row"].to_pylist() == [1, 2, 3] and table.rows["dataset"][0].as_py() == "iris"
    assert _meta(table) == [{"score": 0.5}, {"score": None}, {"score": 1.0}]  # NaN is null, valid JSON


def test_bad_rows_are_rejected_with_their_row_and_the_first_duplicate_is_kept(tmp_path):
    photos = _photos("daisy", 4)
    path = _csv(tmp_path / "shop.csv", "item_id,image_uri,label", [
        f"a,{photos[0]},daisy",  # row 2, kept
        f",{photos[1]},daisy",  # row 3: no item_id
        "b,,daisy",  # row 4: no image
        f"a,{photos[2]},iris",  # row 5: repeats row 2
        f"  ,{photos[3]},daisy",  # row 6: blank item_id
        f"c,{photos[3]},iris",  # row 7, kept
        f"a,{photos[3]},daisy",  # row 8: repeats row 2
    ])
    table = read_item_table(str(path))
    assert table.rows["item_id"].to_pylist() == ["a", "c"] and table.rows["source_row"].to_pylist() == [2, 7]
    got = [(r["item_id"], r["reason"], r["stage"]) for r in table.rejects]
    assert got == [("<row 3>", "empty_item_id", "catalogue"), ("b", "missing_image_uri", "catalogue"),
                   ("a", "duplicate_item_id", "catalogue"), ("<row 6>", "empty_item_id", "catalogue"),
                   ("a", "duplicate_item_id", "catalogue")]
    assert {r["reason"] for r in table.rejects} <= set(TABLE_REASONS)
    assert [r["detail"].split(":")[0] for r in table.rejects] == [f"{path} row {n}" for n in (3, 4, 5, 6, 8)]
    assert "rows 2, 5, 8" in table.rejects[2]["detail"] and "(row 2) is kept" in table.rejects[4]["detail"]
    assert table.rejects[0]["source_path"] == str(photos[1]) and table.rejects[1]["source_path"] == ""
    assert set(table.rejects[0]) == {"item_id", "dataset", "reason", "stage", "source_path", "split",
                                     "detail"}


def test_missing_columns_and_unreadable_tables_raise_one_line_errors(tmp_path):
    path = _csv(tmp_path / "shop.csv", "id,image_uri,label", ["a,x.jpg,1"])
    with pytest.raises(TableError) as err:
        read_item_table(str(path))
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert str(path) in message and "no item_id column" in message
    assert "it has ['id', 'image_uri', 'label']" in message
    (tmp_path / "none.jsonl").write_text('{"name": "a"}\n')
    with pytest.raises(TableError, match="no item_id or image_uri column; it has \\['name'\\]"):
        read_item_table(str(tmp_path / "none.jsonl"))
    (tmp_path / "list.jsonl").write_text('{"item_id": "a", "image_uri": "a.jpg"}\n[1, 2]\n')
    with pytest.raises(TableError, match="list.jsonl line 2 is a JSON list, not an object"):
        read_item_table(str(tmp_path / "list.jsonl"))
    _csv(tmp_path / "ragged.csv", "item_id,image_uri", ["a,a.jpg", "b,b.jpg,extra"])
    with pytest.raises(TableError, match="ragged.csv is not a readable CSV table .*Expected 2 columns, "
                                         "got 3"):
        read_item_table(str(tmp_path / "ragged.csv"))
    with pytest.raises(TableError, match="must end in one of"):
        read_item_table(str(tmp_path / "items.txt"))
    empty = _csv(tmp_path / "empty.csv", "item_id,image_uri,label", [])
    assert read_item_table(str(empty)).rows.num_rows == 0  # a header alone: an empty table, no error


def test_tables_on_s3_resolve_relative_uris_against_their_folder(s3_storage):
    photos = _photos("bluebell", 3)
    for p in photos[:2]:
        storage.write_bytes(storage.join(s3_storage, "shop", "img", p.name), p.read_bytes())
    elsewhere = storage.join(s3_storage, "other", photos[2].name)
    storage.write_bytes(elsewhere, photos[2].read_bytes())
    text = f"item_id,image_uri,label\na,img/{photos[0].name},5\nb,./img/{photos[1].name},6\nc,{elsewhere},5\n"
    storage.write_text(storage.join(s3_storage, "shop", "items.csv"), text)
    lines = [{"item_id": "d", "image_uri": f"../shop/img/{photos[0].name}"},  # relative to feed/
             {"item_id": "e", "image_uri": ""}]
    feed_text = "".join(json.dumps(r) + "\n" for r in lines)
    storage.write_text(storage.join(s3_storage, "feed", "new.jsonl"), feed_text)

    table = read_item_table(storage.join(s3_storage, "shop", "items.csv"), dataset="shop")
    img = storage.join(s3_storage, "shop", "img")
    uris = table.rows["image_uri"].to_pylist()
    assert uris == [f"{img}/{photos[0].name}", f"{img}/{photos[1].name}", elsewhere]
    assert table.rows["label"].to_pylist() == [5, 6, 5]
    assert [storage.read_bytes(u) for u in uris] == [p.read_bytes() for p in photos]
    feed = read_item_table(storage.join(s3_storage, "feed", "new.jsonl"))
    assert feed.rows["image_uri"].to_pylist() == [f"{img}/{photos[0].name}"]
    assert feed.rows["dataset"].to_pylist() == ["new"]
    assert [(r["item_id"], r["reason"], r["dataset"]) for r in feed.rejects] == [
        ("e", "missing_image_uri", "new")]


def _shop_table(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A CSV of 4 species x 3 real photos (relative paths), one listed photo missing, and bad rows."""
    (tmp_path / "photos").mkdir()
    rows, labels = [], {}
    for species in SPECIES:
        for k, photo in enumerate(_photos(species, 3)):
            shutil.copy(photo, tmp_path / "photos" / f"{species}-{k}.jpg")
            rows.append(f"{species}-{k},photos/{species}-{k}.jpg,{species},{k * 10}")
            labels[f"{species}-{k}"] = species
    rows += ["gone,photos/gone.jpg,daisy,0", ",photos/daisy-0.jpg,daisy,1", "nopic,,iris,2",
             "daisy-0,photos/iris-0.jpg,iris,3", "nolabel,photos/iris-1.jpg,,4"]
    return _csv(tmp_path / "items.csv", "item_id,image_uri,label,price", rows), labels


def test_prepare_data_job_prepares_a_table_and_lists_its_rejects(tmp_path, capsys):
    table, labels = _shop_table(tmp_path)
    out = tmp_path / "prepared"
    assert prepare_data.main(["--preset", "table", "--source", str(table), "--name", "shop",
                              "--out", str(out)]) == 0
    assert "shop: 13 images, 4 classes, 4 rows rejected (table layout" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    info = manifest["datasets"]["shop"]
    assert (info["kind"], info["classes"], info["num_train_classes"]) == ("table", sorted(SPECIES), 2)
    assert info["counts"]["train"] == {"images": 6, "classes": 2} and info["counts"]["test"]["images"] == 6
    shards = pq.read_table([out / s["path"] for s in manifest["shards"]]).to_pylist()
    assert sorted(r["item_id"] for r in shards) == sorted(f"shop/{i}" for i in labels)
    for row in shards:
        species = labels[row["item_id"].removeprefix("shop/")]
        assert (row["label"], row["class_name"]) == (sorted(SPECIES).index(species), species)
        assert row["image"] == (tmp_path / "photos" / f"{row['item_id'][5:]}.jpg").read_bytes()
    rows = read_rejects(str(out / schema.PREPARE_REJECTS_NAME))
    rejects = {r["item_id"]: (r["reason"], r["stage"]) for r in rows}
    assert rejects == {"shop/gone": ("missing_file", "prepare"),
                       "shop/<row 15>": ("empty_item_id", "catalogue"),
                       "shop/nopic": ("missing_image_uri", "catalogue"),
                       "shop/daisy-0": ("duplicate_item_id", "catalogue"),
                       "shop/nolabel": ("missing_label", "catalogue")}
    assert manifest["rejects"]["count"] == 5 and manifest["rejects"]["by_reason"]["duplicate_item_id"] == 1


def test_a_table_without_labels_prepares_an_unlabeled_catalogue(tmp_path, capsys):
    photos = _photos("iris", 2) + _photos("daisy", 2)
    rows = [f"p{i},{p}," for i, p in enumerate(photos)]  # a label column, every label empty
    table = _csv(tmp_path / "catalogue.csv", "item_id,image_uri,label", rows)
    out = tmp_path / "prepared"
    assert prepare_data.main(["--preset", "table", "--source", str(table), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    info = manifest["datasets"]["catalogue"]  # named after the file
    assert (info["labeled"], info["num_classes"]) == (False, 0)
    assert manifest["totals"] == {"train": 4, "test": 0, "rows": 4}
    shards = pq.read_table([out / s["path"] for s in manifest["shards"]]).to_pylist()
    assert {(r["item_id"], r["label"], r["split"], r["role"]) for r in shards} == {
        (f"catalogue/p{i}", -1, "train", "train") for i in range(4)}
    assert manifest["rejects"]["count"] == 0
    named = _csv(tmp_path / "mixed.csv", "item_id,image_uri,dataset", [f"x,{photos[0]},other"])
    assert prepare_data.main(["--preset", "table", "--source", str(named), "--out", str(tmp_path / "x")]) == 2
    assert "rows name datasets ['other']" in capsys.readouterr().err
