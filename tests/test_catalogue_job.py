"""Catalogues that change, end to end on real photos: jobs/embed.py reconciles a folder catalogue and a
CSV table catalogue (adds, replaced photos, removals), a new model builds and promotes its own
version, a rollback returns, and a whole catalogue can be removed.

Run 2 of each catalogue must read and embed exactly the replaced and added images; after it the
index holds exactly the catalogue, every replaced item is found first by its new photo, and no
query (every photo, removed ones included) returns a removed item. The table's second run is
`jobs/embed.py` pushing to a real Pushgateway: the pushed counts equal the printed ones.
"""

from __future__ import annotations

import ast
import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pushgateway import Pushgateway, used_by_monitoring
from tiny import make_checkpoint, reference_embeddings

import jobs.embed
import jobs.index
import jobs.search
from puma.config import IndexConfig, load_config
from puma.data.rejects import read_rejects
from puma.index import ShardedIndex, read_manifest, verify
from puma.index.versions import list_versions, read_alias, resolve, version_name
from puma.inference.job import checkpoint_id, embed_catalogue, embed_catalogues
from puma.serve.live_index import LiveIndex

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
CLASSES = ("bluebell", "daisy", "iris", "pansy")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "best"))


def photos(cls: str) -> list[Path]:
    return sorted((FLOWERS / cls).glob("*.jpg"))


def settings(root: Path, checkpoint: str) -> list[str]:
    return [f"index.uri={root / 'index'}", f"embed.checkpoint={checkpoint}", "embed.commit_rows=16",
            "embed.batch_size=8", "data.decode_batch_size=8", "embed.num_cpus=1",
            "index.compact_fraction=0.5"]


def cfg_for(root: Path, checkpoint: str, *overrides: str):
    return load_config(None, [*settings(root, checkpoint), *overrides])


def printed_counts(output: str) -> dict:
    """The counts of jobs/embed.py's summary line of its one catalogue."""
    line = next(x for x in output.splitlines() if ": embedded " in x)
    found = re.search(r"embedded (\d+), already indexed (\d+); added (\d+), changed (\d+), removed (\d+), "
                      r"restamped (\d+); rejected (\d+) (\{[^}]*\})", line)
    assert found, line
    names = ("embedded", "already_indexed", "added", "changed", "removed", "restamped", "rejected")
    return {**dict(zip(names, map(int, found.groups()[:7]), strict=True)),
            "reasons": ast.literal_eval(found.group(8))}


def refs_of(paths: list[Path]) -> pa.Table:
    return pa.table({"image_uri": [str(p) for p in paths], "image_row": [-1] * len(paths)})


def search_all(location: str, queries: np.ndarray, k: int) -> np.ndarray:
    index = ShardedIndex.open(location, use_gpu=False)
    return index.search(queries, min(k, index.live_total))[1]


def assert_index_is_the_catalogue(location: str, expected_ids: set[str], checkpoint: str,
                                  replaced: dict[str, Path], every_photo: list[Path],
                                  removed: set[str]) -> None:
    """Exactly the catalogue's items; replaced items found first by their new photo; no removed item
    returned by any query."""
    index = ShardedIndex.open(location, use_gpu=False)
    live = {str(i) for i in index.to_item_ids(np.flatnonzero(index.live))}
    assert live == expected_ids and index.live_total == len(expected_ids)
    assert verify(resolve(location)).ok
    new = reference_embeddings(checkpoint, refs_of(list(replaced.values())))  # (R, E)
    _, first = index.search(new, 1)
    assert list(first[:, 0]) == list(replaced)
    np.testing.assert_allclose(index.embeddings(list(replaced)), new, atol=1e-5)
    found = search_all(location, reference_embeddings(checkpoint, refs_of(every_photo)), 10)
    assert not removed & {str(i) for i in found.ravel()}


def test_a_folder_catalogue_is_reconciled_run_after_run(ray_cluster, checkpoint, tmp_path):
    shop = tmp_path / "shop"
    for cls in CLASSES:
        (shop / cls).mkdir(parents=True)
        for p in photos(cls)[:10]:
            shutil.copy(p, shop / cls / p.name)
    cfg = cfg_for(tmp_path, checkpoint)
    first = embed_catalogue(cfg, str(shop))
    assert (first.embedded, first.added, first.removed, first.total) == (40, 40, 0, 40)
    ids = {f"shop/{cls}/{p.name}" for cls in CLASSES for p in photos(cls)[:10]}
    # 10 % removed, 5 % replaced by photos of other classes under the same names, 10 % added
    removed = {f"shop/bluebell/{p.name}" for p in photos("bluebell")[:4]}
    for item in removed:
        (tmp_path / item).unlink()
    replaced = {}
    for i, p in enumerate(photos("daisy")[:2]):
        other = photos("pansy")[40 + i]
        shutil.copy(other, shop / "daisy" / p.name)
        replaced[f"shop/daisy/{p.name}"] = other
    added = photos("iris")[10:14]
    for p in added:
        shutil.copy(p, shop / "iris" / p.name)
    second = embed_catalogue(cfg, str(shop))
    assert (second.embedded, second.added, second.changed, second.removed) == (6, 4, 2, 4)
    assert (second.read_to_compare, second.skipped_indexed, second.total) == (2, 34, 40)
    assert second.summary().count("added 4, changed 2, removed 4") == 1
    ids = (ids - removed) | {f"shop/iris/{p.name}" for p in added}
    every = [p for cls in CLASSES for p in photos(cls)[:14]] + [photos("pansy")[40], photos("pansy")[41]]
    assert_index_is_the_catalogue(str(tmp_path / "index"), ids, checkpoint, replaced, every, removed)
    run = read_manifest(resolve(str(tmp_path / "index"))).runs[-1]
    assert (run["catalogue"], run["added"], run["changed"], run["removed"]) == (str(shop), 4, 2, 4)
    # a file rewritten with the same bytes is read to compare, never embedded; nothing else is read
    touched = shop / "iris" / photos("iris")[0].name
    touched.write_bytes(touched.read_bytes())
    third = embed_catalogue(cfg, str(shop))
    assert (third.embedded, third.read_to_compare, third.restamped) == (0, 1, 1)
    assert (third.removed, third.total) == (0, 40)
    fourth = embed_catalogue(cfg, str(shop))
    assert (fourth.embedded, fourth.read_to_compare, fourth.skipped_indexed) == (0, 0, 40)


def write_table(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["item_id", "image_uri", "label", "price"])
        writer.writeheader()
        writer.writerows(rows)


def test_a_csv_table_catalogue_is_reconciled_with_its_metadata_and_rejects(ray_cluster, checkpoint, tmp_path,
                                                                          capsys):
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for cls in CLASSES:
        for p in photos(cls)[20:30]:
            shutil.copy(p, images / p.name)
            rows.append({"item_id": f"sku-{p.stem}", "image_uri": f"images/{p.name}", "label": cls,
                         "price": "10"})
    table = tmp_path / "shop.csv"
    bad = [{"item_id": "", "image_uri": "images/x.jpg", "label": "daisy", "price": "1"},
           {"item_id": rows[0]["item_id"], "image_uri": "images/other.jpg", "label": "daisy", "price": "2"},
           {"item_id": "sku-missing", "image_uri": "images/nowhere.jpg", "label": "daisy", "price": "3"}]
    write_table(table, rows + bad)
    cfg = cfg_for(tmp_path, checkpoint)
    first = embed_catalogue(cfg, str(table))
    assert (first.embedded, first.total, first.rejected) == (40, 40, 3)
    reasons = {r["item_id"]: r["reason"] for r in read_rejects(first.rejects_uri)}
    assert reasons == {"<row 42>": "empty_item_id", rows[0]["item_id"]: "duplicate_item_id",
                       "sku-missing": "missing_file"}
    removed = {r["item_id"] for r in rows[:4]}
    keep = rows[4:]
    replaced = {}
    for i, row in enumerate(keep[10:12]):  # daisy rows now show pansies
        other = photos("pansy")[50 + i]
        shutil.copy(other, images / other.name)
        row["image_uri"] = f"images/{other.name}"
        replaced[row["item_id"]] = other
    keep[20]["price"] = "12.5"  # only its metadata changed: re-added with its stored embedding
    new_rows = []
    for p in photos("iris")[40:44]:
        shutil.copy(p, images / p.name)
        new_rows.append({"item_id": f"sku-{p.stem}", "image_uri": str(images / p.name), "label": "iris",
                         "price": "7"})
    write_table(table, keep + new_rows)
    capsys.readouterr()
    gateway = Pushgateway(tmp_path / "pushgateway")  # the job pushes its counts (puma/job_metrics.py)
    try:
        assert jobs.embed.main(["--catalogue", str(table), *settings(tmp_path, checkpoint),
                                f"metrics.pushgateway={gateway.url}"]) == 0
        second = printed_counts(capsys.readouterr().out)
        assert (second["embedded"], second["added"], second["changed"]) == (6, 4, 2)
        assert (second["removed"], second["restamped"], second["rejected"]) == (4, 1, 3)
        at = {"job": "puma_embed", "catalogue": "shop"}
        pushed = {o: gateway.value("puma_embed_items", outcome=o, **at)
                  for o in ("added", "changed", "removed", "restamped", "unchanged")}
        assert pushed == {**{o: second[o] for o in ("added", "changed", "removed", "restamped")},
                          "unchanged": second["already_indexed"] - second["restamped"]}
        rejects = {s[1]["reason"]: s[2] for s in gateway.samples("puma_embed_rejected_items")}
        assert rejects == second["reasons"]
        assert gateway.value("puma_embed_index_items", **at) == 40
        assert gateway.value("puma_embed_last_run_failed", **at) == 0
        assert used_by_monitoring("puma_embed_") <= {n for n, _, _ in gateway.samples()}
    finally:
        gateway.stop()
    ids = {r["item_id"] for r in keep + new_rows}
    every = [p for cls in CLASSES for p in photos(cls)[20:30]]
    every += list(replaced.values()) + photos("iris")[40:44]
    assert_index_is_the_catalogue(str(tmp_path / "index"), ids, checkpoint, replaced, every, removed)
    location = str(tmp_path / "index")
    dim = read_manifest(resolve(location)).dim
    live = LiveIndex(IndexConfig(uri=resolve(location), use_gpu=False), None, dim)
    hit = live.search_item(keep[20]["item_id"], 1, include_self=True)[0]
    assert (hit["item_id"], hit["metadata"]) == (keep[20]["item_id"], {"price": "12.5"})
    assert hit["class_name"] == "iris"
    assert hit["label"] == sorted(CLASSES).index("iris")
    out = tmp_path / "hits.parquet"
    argv = ["--item-id", keep[20]["item_id"], "--k", "3", "--include-self", "--out", str(out),
            f"index.uri={location}"]
    assert jobs.search.main(argv) == 0
    results = pq.read_table(out).to_pylist()
    assert results[0]["item_id"] == keep[20]["item_id"]
    assert json.loads(results[0]["metadata"]) == {"price": "12.5"}
    assert {r["class_name"] for r in results} <= set(CLASSES) and all(r["dataset"] == "shop" for r in results)


def test_an_item_id_another_catalogue_indexed_is_a_reject_of_the_second(ray_cluster, checkpoint, tmp_path):
    """Two table catalogues list the same item id: the second one's row is rejected (duplicate_item_id,
    naming the catalogue that holds it), its other rows are embedded, and the first one's item stays."""
    images = tmp_path / "images"
    images.mkdir()
    for p in photos("daisy")[70:75]:
        shutil.copy(p, images / p.name)
    names = [p.name for p in photos("daisy")[70:75]]
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    write_table(first, [{"item_id": f"sku-{i}", "image_uri": f"images/{n}", "label": "daisy", "price": "1"}
                        for i, n in enumerate(names[:3])])
    write_table(second, [{"item_id": f"sku-{i}", "image_uri": f"images/{n}", "label": "daisy", "price": "2"}
                         for i, n in zip((2, 3, 4), names[2:], strict=True)])
    cfg = cfg_for(tmp_path, checkpoint)
    assert embed_catalogue(cfg, str(first)).total == 3
    report = embed_catalogue(cfg, str(second))
    assert (report.added, report.total, report.rejected) == (2, 5, 1)
    (reject,) = read_rejects(report.rejects_uri)
    assert (reject["item_id"], reject["reason"]) == ("sku-2", "duplicate_item_id")
    assert str(first) in reject["detail"]
    live = LiveIndex(IndexConfig(uri=resolve(str(tmp_path / "index")), use_gpu=False), None,
                     read_manifest(resolve(str(tmp_path / "index"))).dim)
    assert live.search_item("sku-2", 1, include_self=True)[0]["metadata"] == {"price": "1"}


def test_a_new_model_builds_its_version_for_every_live_catalogue_then_goes_live(ray_cluster, checkpoint,
                                                                              tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, cls in ((a, "daisy"), (b, "pansy")):
        folder.mkdir()
        for p in photos(cls)[60:66]:
            shutil.copy(p, folder / p.name)
    location = str(tmp_path / "index")
    cfg = cfg_for(tmp_path, checkpoint)
    embed_catalogues(cfg, [str(a), str(b)])
    old = version_name(checkpoint_id(checkpoint))
    assert read_alias(location).live == old
    other = make_checkpoint(str(tmp_path / "other"), seed=5)
    new = version_name(checkpoint_id(other))
    reports = embed_catalogues(cfg_for(tmp_path, other), [str(a)])  # b comes along: it is live
    done = [(Path(r.catalogue).name, r.embedded, r.version) for r in reports]
    assert done == [("a", 6, new), ("b", 6, new)]
    assert reports[-1].promoted == new and read_alias(location).live == new
    index = ShardedIndex.open(location, use_gpu=False)
    assert index.manifest.model_id == checkpoint_id(other) and index.live_total == 12
    q = reference_embeddings(other, refs_of([a / p.name for p in photos("daisy")[60:62]]))
    assert list(index.search(q, 1)[1][:, 0]) == [f"a/{p.name}" for p in photos("daisy")[60:62]]
    job = jobs.index
    assert job.main(["remove-catalogue", "--catalogue", str(b), f"index.uri={location}"]) == 0
    assert "removed 6 item(s)" in capsys.readouterr().out
    for version in list_versions(location):
        manifest = read_manifest(version.uri)
        assert str(b) not in manifest.catalogues and manifest.total == 6 and manifest.removed == 0
    assert job.main(["rollback", f"index.uri={location}"]) == 0
    assert read_alias(location).live == old and ShardedIndex.open(location, use_gpu=False).live_total == 6
    again = embed_catalogues(cfg_for(tmp_path, other), [str(a)])  # a scheduled run with the newer model
    assert [r.promoted for r in again] == [""] and read_alias(location).live == old  # the rollback holds
    assert job.main(["versions", f"index.uri={location}"]) == 0
    out = capsys.readouterr().out
    assert f"{old}" in out and "live" in out and "previous" in out


def test_a_rejected_photo_that_is_fixed_is_indexed_by_the_next_run(ray_cluster, checkpoint, tmp_path):
    shop = tmp_path / "fix"
    shop.mkdir()
    for p in photos("iris")[70:73]:
        shutil.copy(p, shop / p.name)
    (shop / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    cfg = cfg_for(tmp_path, checkpoint)
    first = embed_catalogue(cfg, str(shop))
    assert (first.embedded, first.rejected) == (3, 1)
    again = embed_catalogue(cfg, str(shop))  # unchanged: the listed reject is not read again
    assert (again.embedded, again.skipped_rejected, again.rejected) == (0, 1, 1)
    shutil.copy(photos("iris")[73], shop / "broken.jpg")  # the photo is fixed
    fixed = embed_catalogue(cfg, str(shop))
    assert (fixed.embedded, fixed.added, fixed.rejected, fixed.total) == (1, 1, 0, 4)
    assert read_rejects(fixed.rejects_uri) == []


def test_rows_sharing_a_photo_are_decoded_and_embedded_once_and_each_indexed(ray_cluster, checkpoint,
                                                                             tmp_path):
    """Product variants with one photo: each distinct image is read, decoded and embedded once per run
    (report.images), on the Ray path with an IVF index's training sample and in-process; every row is
    indexed with its photo's embedding and fingerprint and its own description and stamp; a shared photo
    that is rejected rejects every row that uses it."""
    images = tmp_path / "images"
    images.mkdir()
    own = photos("daisy")[30:37]
    for p in own:
        shutil.copy(p, images / p.name)
    (images / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    rows = [{"item_id": f"v{i}-{k}", "image_uri": f"images/{p.name}", "label": "daisy", "price": str(k)}
            for i, p in enumerate(own[:6]) for k in range(1 + i % 3)]  # 12 rows over 6 photos
    rows += [{"item_id": f"bad-{k}", "image_uri": "images/broken.jpg", "label": "daisy", "price": "1"}
             for k in range(3)]
    table = tmp_path / "variants.csv"
    write_table(table, rows)
    cfg = cfg_for(tmp_path, checkpoint, "index.index_type=ivf_flat", "index.nlist=1", "index.train_sample=4",
                  "index.nprobe=1")
    first = embed_catalogue(cfg, str(table))
    assert (first.images, first.embedded, first.added, first.total, first.rejected) == (6, 12, 12, 12, 3)
    bad = {r["item_id"]: r for r in read_rejects(first.rejects_uri)}
    assert set(bad) == {"bad-0", "bad-1", "bad-2"} and len({r["reason"] for r in bad.values()}) == 1
    assert all(r["source_path"] == str(images / "broken.jpg") for r in bad.values())
    location = str(tmp_path / "index")
    assert read_manifest(resolve(location)).train_count == 6  # the sample: every distinct photo once
    index = ShardedIndex.open(location, use_gpu=False)
    photo_of = {r["item_id"]: images / Path(r["image_uri"]).name for r in rows[:12]}
    np.testing.assert_allclose(index.embeddings(list(photo_of)),
                               reference_embeddings(checkpoint, refs_of(list(photo_of.values()))), atol=1e-5)
    stored = pq.read_table([p for p in Path(resolve(location)).rglob("*.parquet") if "shards" in str(p)])
    by_id = {r["item_id"]: r for r in stored.to_pylist()}
    assert {by_id[i]["fingerprint"] for i in ("v2-0", "v2-1", "v2-2")} == {by_id["v2-0"]["fingerprint"]}
    assert [json.loads(by_id[i]["metadata"])["price"] for i in ("v2-0", "v2-1", "v2-2")] == ["0", "1", "2"]

    extra = photos("daisy")[40]
    shutil.copy(extra, images / extra.name)
    rows[0]["image_uri"] = f"images/{extra.name}"  # v0-0 now shows the new photo, as three new rows do
    rows += [{"item_id": f"n{k}", "image_uri": f"images/{extra.name}", "label": "daisy", "price": "2"}
             for k in range(3)]
    rows += [{"item_id": "m", "image_uri": f"images/{own[1].name}", "label": "daisy", "price": "9"},
             {"item_id": "bad-3", "image_uri": "images/broken.jpg", "label": "daisy", "price": "1"}]
    write_table(table, rows)
    second = embed_catalogue(cfg, str(table))  # a few images: embedded in this process
    assert (second.images, second.embedded, second.changed, second.added) == (2, 5, 1, 4)
    assert (second.total, second.rejected, second.skipped_rejected) == (16, 4, 3)
    index = ShardedIndex.open(location, use_gpu=False)
    np.testing.assert_allclose(index.embeddings(["v0-0", "n0", "n1", "n2", "m"]),
                               reference_embeddings(checkpoint, refs_of([extra] * 4 + [own[1]])), atol=1e-5)


def test_a_stamp_column_decides_which_images_are_read_again(ray_cluster, checkpoint, tmp_path):
    """embed.stamp_column: the table's version column is the stamp, the files' write times are not asked."""
    folder = tmp_path / "v"
    folder.mkdir()
    for p in photos("sunflower")[60:64]:
        shutil.copy(p, folder / p.name)
    names = [p.name for p in photos("sunflower")[60:64]]

    def write(versions: list[str]) -> None:
        lines = [f"s{i},v/{name},{v}" for i, (name, v) in enumerate(zip(names, versions, strict=True))]
        (tmp_path / "versioned.csv").write_text("item_id,image_uri,version\n" + "\n".join(lines) + "\n")

    write(["1", "1", "1", "1"])
    cfg = cfg_for(tmp_path, checkpoint, "embed.stamp_column=version")
    first = embed_catalogue(cfg, str(tmp_path / "versioned.csv"))
    assert (first.embedded, first.total) == (4, 4)
    (folder / names[0]).write_bytes((folder / names[0]).read_bytes())  # rewritten, same version: not read
    shutil.copy(photos("sunflower")[70], folder / names[2])  # another photo, old name, new version
    write(["1", "2", "2", "1"])  # s1: a new version of the same bytes
    second = embed_catalogue(cfg, str(tmp_path / "versioned.csv"))
    assert (second.read_to_compare, second.embedded, second.changed, second.restamped) == (2, 1, 1, 1)
    assert second.skipped_indexed == 3 and second.total == 4


# ----------------------------------------------------------------------------- filters on a real table

FILTER_CATEGORIES = ("boots", "sandals", "sneakers", "heels")


def shop_rows(photos_used: list[Path], rng: np.random.Generator) -> list[dict]:
    """Two rows per photo (variants sharing an image), each with CSV cells of every type: text (category,
    brand, a zip code with leading zeros), numbers (price: integers and decimals; stock) and booleans."""
    rows = []
    for n, p in enumerate(photos_used):
        for variant in range(2):
            price = int(rng.integers(5, 200)) if rng.random() < 0.5 else round(float(rng.uniform(5, 200)), 2)
            rows.append({"item_id": f"sku-{n:03d}-{variant}", "image_uri": str(p), "label": p.parent.name,
                         "category": FILTER_CATEGORIES[int(rng.integers(4))],
                         "brand": f"b{int(rng.integers(6))}",
                         "price": str(price), "in_stock": "true" if rng.random() < 0.6 else "false",
                         "stock": str(int(rng.integers(0, 30))), "zip": f"{int(rng.integers(0, 3000)):05d}"})
    return rows


def typed(row: dict) -> dict:
    """A row's metadata as the filter language types the CSV's text (what the reference scan compares)."""
    price = float(row["price"])
    return {"category": row["category"], "brand": row["brand"], "price": price,
            "in_stock": row["in_stock"] == "true", "stock": int(row["stock"]), "zip": row["zip"]}


def shop_filter(rng: np.random.Generator, depth: int = 0) -> dict:
    pick = int(rng.integers(0, 12 if depth < 2 else 9))
    if pick == 0:
        return {"category": FILTER_CATEGORIES[int(rng.integers(4))]}
    if pick == 1:
        chosen = rng.choice(6, int(rng.integers(1, 3)), replace=False)
        return {"brand": {"in": [f"b{int(i)}" for i in chosen]}}
    if pick == 2:
        low = round(float(rng.uniform(5, 180)), 1)
        return {"price": {"gte": low, "lt": round(low + float(rng.uniform(2, 60)), 1)}}
    if pick == 3:
        return {"in_stock": bool(rng.random() < 0.5)}
    if pick == 4:
        return {"stock": {str(rng.choice(["gt", "lte", "ne", "eq"])): int(rng.integers(0, 30))}}
    if pick == 5:
        return {"zip": {"in": [f"{int(z):05d}" for z in rng.integers(0, 3000, 40)]}}
    if pick == 6:
        return {"class_name": {"in": [str(c) for c in rng.choice(CLASSES, 2, replace=False)]}}
    if pick == 7:
        return {"label": int(rng.integers(4)), "in_stock": True}
    if pick == 8:
        return {"brand": f"b{int(rng.integers(6))}", "stock": {"lt": 4}}  # very selective
    if pick == 9:
        return {"and": [shop_filter(rng, depth + 1), shop_filter(rng, depth + 1)]}
    if pick == 10:
        return {"or": [shop_filter(rng, depth + 1), shop_filter(rng, depth + 1)]}
    return {"not": shop_filter(rng, depth + 1)}


# per index type: two job runs and 200 filters (14-16 s alone); CI saw 95 s at a load average of 16
@pytest.mark.budget(150)
@pytest.mark.parametrize("index_type", ["flat", "ivf_flat"])
def test_filters_on_a_real_photo_table_equal_a_scan_of_the_matching_rows(ray_cluster, checkpoint, tmp_path,
                                                                          index_type, monkeypatch):
    """A CSV table catalogue of real photos embedded by the job, then changed (rows removed, prices
    changed, rows added) and compacted: for 200 random filters of every operator, the service's index
    (one, and 3 partitions) and jobs/search.py return the exact top-k of the matching rows wherever the
    search is exact (Flat; IVF over every list, whether it scans the selected rows, here at most 40, or
    asks FAISS), and the one index and the partitions agree everywhere."""
    import asyncio

    from test_filtered_search import matches
    from test_serve_partitions import LocalFanOut

    from puma.index import filtered
    from puma.index.filters import parse_filter
    from puma.index.table import embedding_matrix
    from puma.inference.search import run_search
    from puma.serve.partitions import Partition

    rng = np.random.default_rng(21)
    rows = shop_rows([p for cls in CLASSES for p in photos(cls)[40:70]], rng)  # 240 rows, 120 photos
    table = tmp_path / "shop.csv"
    fields = ["item_id", "image_uri", "label", "category", "brand", "price", "in_stock", "stock", "zip"]

    def write(current: list[dict]) -> None:
        with table.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(current)

    write(rows)
    cfg = cfg_for(tmp_path, checkpoint, f"index.index_type={index_type}", "index.nlist=4",
                  "index.shard_size=60", "index.compact_fraction=0.1", "embed.commit_rows=60")
    assert len(rows) == 240 and embed_catalogue(cfg, str(table)).total == 240
    kept = [r for i, r in enumerate(rows) if i % 8 != 3]  # 30 removed
    for r in kept[::9]:
        r["price"] = str(int(r["price"].split(".")[0]) + 1)  # metadata changed
    added = shop_rows(photos("daisy")[70:80], rng)
    for r in added:
        r["item_id"] = r["item_id"].replace("sku-", "new-")
    write(kept + added)
    second = embed_catalogue(cfg, str(table))
    assert (second.added, second.removed, second.total) == (20, 30, 230)
    location = resolve(str(tmp_path / "index"))
    assert read_manifest(location).next_id > 260, "the compaction left gaps in the ids"

    index_cfg = IndexConfig(uri=location, use_gpu=False, nprobe=2)
    monkeypatch.setattr(filtered, "BRUTE_FORCE_VALUES", 40 * read_manifest(location).dim)
    dim, nlist = read_manifest(location).dim, read_manifest(location).nlist
    one = LiveIndex(index_cfg, None, dim)
    fan = LocalFanOut([LiveIndex(index_cfg, None, dim, partition=Partition(p, 3)) for p in range(3)])
    index = one.state.index
    stored = index.table(["item_id", "dataset", "label", "class_name", "catalogue", "embedding"])
    vectors, names = embedding_matrix(stored), stored["item_id"].to_pylist()
    meta = {r["item_id"]: typed(r) for r in kept + added}
    built_in = stored.select(["item_id", "dataset", "label", "class_name", "catalogue"]).to_pylist()
    reference = [{**meta.get(r["item_id"] or "", {}), **r} for r in built_in]
    filterable = one.stats()["filterable"]
    assert [filterable[c]["type"] for c in ("price", "stock", "in_stock", "zip", "category")] == \
        ["number", "number", "boolean", "string", "string"]
    q = rng.standard_normal((2, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    np.save(tmp_path / "q.npy", q)

    row_of = {names[r]: r for r in np.flatnonzero(index.live)}  # (a re-added item's old row keeps its id)

    def exact_top(ids: list[str], rows_in: np.ndarray, j: int, k: int) -> bool:
        """``ids`` are k distinct matching items whose scores are the best k among the matching rows,
        rank by rank (rows sharing a photo score the same: which of them wins a tie is not fixed)."""
        best = np.sort(vectors[rows_in] @ q[j])[::-1][:k]
        rows = [row_of.get(i, -1) for i in ids]
        return len(set(ids)) == len(ids) == len(best) and set(rows) <= set(rows_in.tolist()) and \
            np.allclose(vectors[rows] @ q[j], best, rtol=0, atol=1e-5)

    # each partition widens an IVF search by its own share of the matches: every partition scans every
    # list once the matches are a margin below the whole index's bound (as in test_filtered_search)
    partitions_scan_all = 0.7 * 2 * index.live_total / (filtered.FULL_SCAN_SHARE * max(nlist, 1))
    ways = set()
    for i in range(200):
        raw = shop_filter(rng)
        where, k = parse_filter(raw), int(rng.integers(1, 15))
        keep = np.array([live and matches(raw, r) for r, live in zip(reference, index.live, strict=True)])
        rows_in = np.flatnonzero(keep)
        scanned = filtered.brute_force(len(rows_in), dim)
        every_list = not nlist or filtered.filtered_nprobe(2, nlist, len(rows_in), index.live_total) == nlist
        ways.add("scan" if scanned else "every list" if every_list else "some lists")
        exact = every_list  # a scan too ranks only the selected rows of the lists a search would visit
        for j in range(2) if i < 40 else range(1):
            got = one.search_vector(q[j], k, where=where)
            parts = asyncio.run(fan.search_vector(q[j], k, (), (), where, ""))
            assert len(got) == len(parts) == min(k, len(rows_in)), (i, raw)
            if exact:
                assert exact_top([h["item_id"] for h in got], rows_in, j, k), (i, raw, got)
            if exact and (index_type == "flat" or len(rows_in) <= partitions_scan_all):
                assert exact_top([h["item_id"] for h in parts], rows_in, j, k), (i, raw, parts)
        if i < 40 and exact:  # jobs/search.py's run_search, both queries at once
            out = run_search(index_cfg, k, str(tmp_path / "q.npy"), out_uri=str(tmp_path / "r.parquet"),
                             where=where).results.to_pylist()
            for j in range(2):
                hits = [r["item_id"] for r in out if r["query"] == f"q{j}"]
                assert exact_top(hits, rows_in, j, k), (i, raw)
    assert ways == ({"scan", "every list"} if index_type == "flat" else {"scan", "every list", "some lists"})
