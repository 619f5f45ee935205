"""Listing a table catalogue: every distinct image stamped once, on S3 by listing the folders the table
points into (a LIST per page of keys) instead of a HEAD per row, with the stamps a HEAD gives; the
repeated columns dictionary-encoded; folder and prepared catalogues' references as before."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from s3proxy import S3Proxy

from puma import storage
from puma.config import RetryConfig, StorageConfig
from puma.data.tables import TableError
from puma.inference.catalogue import list_catalogue, plain

REPO = Path(__file__).resolve().parents[1]
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"


def _photos(n: int) -> list[bytes]:
    found = sorted((FLOWERS / "daisy").glob("*.jpg"))[:n]
    if len(found) < n:
        pytest.skip(f"the flowers sample ({FLOWERS}) is not here")
    return [p.read_bytes() for p in found]


@pytest.fixture
def proxy(s3_server, s3_storage):
    """A counting proxy in front of the test server; puma.storage talks to it."""
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    p = S3Proxy((host, int(port))).start()
    storage.configure(StorageConfig(endpoint_url=p.endpoint, region="us-east-1",
                                    retry=RetryConfig(max_attempts=3)))
    yield p
    p.stop()
    storage.configure(s3_server.storage_config)


def _head_stamp(uri: str) -> str:
    """The stamp one HEAD of the object gives (what the per-row stamping stored)."""
    fs, path = storage.resolve(uri)
    info = fs.get_file_info(path)
    return f"{info.size}:{info.mtime_ns}" if info.type == pafs.FileType.File else ""


def _requests(proxy: S3Proxy) -> tuple[int, int]:
    """(pages of a folder listed, HEADs of an image) the proxy has seen (a table's own reads left out)."""
    pages = sum(1 for r in proxy.log if r.method == "GET" and "start-after=" in r.path)
    return pages, sum(1 for r in proxy.log if r.method == "HEAD" and not r.path.endswith(".csv"))


def test_an_s3_table_is_stamped_by_listing_its_folders_with_the_stamps_a_head_gives(s3_storage, proxy,
                                                                                       monkeypatch):
    monkeypatch.setattr(storage, "LIST_PAGE", 10)  # pages of 10 keys: a few pages with a few objects
    photos = _photos(6)
    shop = storage.join(s3_storage, "shop")
    for i in range(24):  # shop/img: 24 photos, the table names 20 of them (rows share some)
        storage.write_bytes(storage.join(shop, "img", f"p{i:02d}.jpg"), photos[i % 6])
    storage.write_bytes(storage.join(shop, "img", "sub", "deeper.jpg"), photos[0])  # not listed: a subfolder
    storage.write_bytes(storage.join(shop, "one", "alone.jpg"), photos[1])  # a folder naming one photo
    rows = [f"sku-{i},img/p{i % 20:02d}.jpg,{i % 3}" for i in range(60)]
    rows += ["gone,img/p99.jpg,1", "alone,one/alone.jpg,2", "deep,img/sub/deeper.jpg,1"]
    storage.write_text(storage.join(shop, "items.csv"), "item_id,image_uri,price\n" + "\n".join(rows) + "\n")
    proxy.log.clear()
    refs = list_catalogue(storage.join(shop, "items.csv")).refs
    lists, heads = _requests(proxy)
    assert len(refs) == 63
    assert (lists, heads) == (2, 3)  # img/: 2 pages reach p19, then a HEAD for p99 (gone); one/, sub/: a HEAD
    stamps = dict(zip(refs["item_id"].to_pylist(), refs["stamp"].to_pylist(), strict=True))
    images = dict(zip(refs["item_id"].to_pylist(), refs["image_uri"].to_pylist(), strict=True))
    assert stamps["gone"] == "" and all(stamps[i] for i in stamps if i != "gone")
    assert {i: _head_stamp(images[i]) for i in stamps} == stamps
    assert refs.schema.field("catalogue").type.value_type == plain(refs).schema.field("catalogue").type


def test_a_listing_that_would_cost_more_than_heads_stops_and_heads_the_rest(s3_storage, proxy, monkeypatch):
    monkeypatch.setattr(storage, "LIST_PAGE", 5)
    photo = _photos(1)[0]
    for i in range(40):  # the table names the first and the last of 40 keys: 8 pages against 1 HEAD
        storage.write_bytes(storage.join(s3_storage, "img", f"k{i:02d}.jpg"), photo + bytes([i]))
    uris = [storage.join(s3_storage, "img", "k00.jpg"), storage.join(s3_storage, "img", "k39.jpg"),
            storage.join(s3_storage, "img", "k05x.jpg")]  # missing, between them: the listing passes it
    proxy.log.clear()
    stats = storage.stat_files(uris)
    assert _requests(proxy) == (2, 1)  # 2 pages reach k05x; then a HEAD for k39 costs less than 6 more pages
    assert [s.stamp if s else "" for s in stats] == [_head_stamp(u) for u in uris]
    assert [s.size if s else None for s in stats] == [len(photo) + 1, len(photo) + 1, None]


def test_local_table_stamps_are_each_files_size_and_write_time(tmp_path):
    photos = _photos(3)
    (tmp_path / "img").mkdir()
    for i, data in enumerate(photos):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(data)
    rows = [f"a{i},img/{i % 3}.jpg" for i in range(9)] + ["b,img/none.jpg"]
    (tmp_path / "shop.csv").write_text("item_id,image_uri\n" + "\n".join(rows) + "\n")
    refs = list_catalogue(str(tmp_path / "shop.csv")).refs
    expected = [f"{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" if os.path.exists(p) else ""
                for p in refs["image_uri"].to_pylist()]
    assert refs["stamp"].to_pylist() == expected and expected[-1] == ""
    assert refs["source_path"].to_pylist() == refs["image_uri"].to_pylist()
    assert set(refs["catalogue"].to_pylist()) == {str(tmp_path / "shop.csv")}


def test_a_stamp_column_stamps_rows_without_asking_the_store(s3_storage, proxy):
    photos = _photos(3)
    shop = storage.join(s3_storage, "shop")
    for i, data in enumerate(photos):
        storage.write_bytes(storage.join(shop, "img", f"{i}.jpg"), data)
    rows = ["a,img/0.jpg,v1", "b,img/1.jpg,\"e\"\"tag\"", "c,img/1.jpg,v1", "d,img/2.jpg,"]  # d: no version
    storage.write_text(storage.join(shop, "items.csv"), "item_id,image_uri,etag\n" + "\n".join(rows) + "\n")
    proxy.log.clear()
    refs = list_catalogue(storage.join(shop, "items.csv"), stamp_column="etag").refs
    assert _requests(proxy) == (0, 1)  # d's image alone is asked for
    assert refs["stamp"].to_pylist() == ["@etag=v1", "@etag=e\"tag", "@etag=v1",
                                         _head_stamp(storage.join(shop, "img", "2.jpg"))]
    assert refs["metadata"][1].as_py() == '{"etag": "e\\"tag"}'  # the column stays metadata too
    with pytest.raises(TableError, match="has no column 'version' \\(embed.stamp_column\\); it has"):
        list_catalogue(storage.join(shop, "items.csv"), stamp_column="version")
