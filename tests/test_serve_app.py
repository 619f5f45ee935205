"""The search service end to end: `python jobs/serve.py` on its own local Ray, over HTTP and in a real
headless browser (Debian's chromium + selenium).

Two catalogues are embedded first through the embed job's code path (a folder of real flower photos
and a prepared CUB-layout dataset, on the session's Ray); the service starts with a bearer token;
queries by image (raw, form, base64), item id and vector are checked against brute force over the
stored embeddings; every bad input gets its 4xx and a one-line reason; concurrent image queries
share forwards; a third catalogue added by jobs/embed.py is found without a restart.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
from browser import headless_chromium
from conftest import encode_image, write_cub_tree
from monitoring import metric_names_used
from PIL import Image
from tiny import make_checkpoint

from puma.checkpoint import checkpoint_id
from puma.config import load_config
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec
from puma.index.manifest import read_manifest
from puma.index.table import read_table
from puma.index.versions import read_alias, resolve, rollback, version_name
from puma.inference import embed_catalogue
from puma.inference.job import embed_catalogues
from puma.serve.metrics import unix_time

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")
TOKEN = "test-token-7b1e"
MAX_K, MAX_BYTES, MAX_PIXELS = 20, 300_000, 1_000_000
START_TIMEOUT_S = 300
CLIENTS = 8


def photo_folder(root: Path, name: str, start: int, n_photos: int, n_generated: int) -> Path:
    """A catalogue folder of real flower photos (by species) plus generated PNGs."""
    folder = root / name
    for photo in sorted(FLOWERS.glob("*/*.jpg"))[start:start + n_photos]:
        (folder / photo.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(photo, folder / photo.parent.name / photo.name)
    (folder / "gen").mkdir(parents=True, exist_ok=True)
    for i in range(n_generated):
        seed = zlib.crc32(name.encode()) + i
        (folder / "gen" / f"{i:02d}.png").write_bytes(encode_image(fmt="PNG", size=(48, 40), seed=seed))
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stored(index_uri: str) -> tuple[list[str], np.ndarray, list[dict]]:
    """Item ids, embeddings (N, E) and the other columns of every committed item."""
    table = read_table(str(Path(resolve(index_uri)) / "shards"))
    x = np.stack(table["embedding"].to_numpy(zero_copy_only=False)).astype(np.float32)
    return table["item_id"].to_pylist(), x, table.drop_columns(["embedding"]).to_pylist()


def brute_force(ids: list[str], x: np.ndarray, q: np.ndarray, k: int, keep=None) -> list[str]:
    order = [i for i in np.argsort(-(x @ q), kind="stable") if keep is None or keep(i)]
    return [ids[i] for i in order[:k]]


# ----------------------------------------------------------------------------- the service


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    checkpoint = make_checkpoint(str(root / "run" / "best"))
    shop_a = photo_folder(root, "shop_a", 0, 10, 6)
    write_cub_tree(root / "raw_cub", num_classes=3, per_class=4)
    prepare([SourceSpec("cub", "cub", str(root / "raw_cub"))], str(root / "cub"), shard_rows=8,
            log=lambda _: None)
    index = str(root / "index")
    common = [f"index.uri={index}", f"embed.checkpoint={checkpoint}", "embed.num_cpus=1",
              "embed.batch_size=8"]
    cfg = load_config(None, common)
    for catalogue in (shop_a, root / "cub"):
        assert embed_catalogue(cfg, str(catalogue)).error == ""
    port, log_path = free_port(), root / "serve.log"
    ray_tmp = tempfile.mkdtemp(prefix="rays", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PUMA_SERVE_TOKEN": TOKEN, "PUMA_RAY_TMP": ray_tmp, "PYTHONUNBUFFERED": "1"})
    argv = [sys.executable, str(REPO / "jobs" / "serve.py"), *common, f"serve.port={port}",
            "serve.watch_interval_s=0.5", "serve.model_num_cpus=0.5", "serve.index_num_cpus=0.25",
            "serve.ingress_num_cpus=0.25", "serve.model_max_replicas=1", "serve.index_max_replicas=1",
            "serve.max_batch_size=8", "serve.batch_wait_timeout_s=0.25", f"serve.max_k={MAX_K}",
            "serve.runtime=onnx",  # the query model in ONNX Runtime: answers as the torch-built index
            f"serve.max_upload_bytes={MAX_BYTES}", f"serve.max_image_pixels={MAX_PIXELS}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_serving(proc, log_path)
        yield {"url": f"http://127.0.0.1:{port}/", "proc": proc, "log": log_path, "root": root,
               "index": index, "checkpoint": checkpoint, "common": common, "shop_a": shop_a}
    finally:
        _stop(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _wait_until_serving(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "Ctrl-C stops it" in text:
            return
        if proc.poll() is not None:
            pytest.fail(f"jobs/serve.py exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(1)
    pytest.fail(f"jobs/serve.py did not serve within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def call(service: dict, method: str, path: str, body: bytes | None = None, content_type: str = "",
         token: str | None = TOKEN) -> tuple[int, dict, object]:
    """(status, headers, JSON or bytes) of one HTTP request to the service."""
    headers = {"Content-Type": content_type} if content_type else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = service["url"] + path.lstrip("/")
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, head, data = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        status, head, data = error.code, dict(error.headers), error.read()
    if head.get("content-type", "").startswith("application/json"):
        return status, head, json.loads(data)
    return status, head, data


def search_json(service: dict, payload: dict, path: str = "search") -> tuple[int, dict]:
    status, _, body = call(service, "POST", path, json.dumps(payload).encode(), "application/json")
    return status, body


def photos(service: dict) -> list[Path]:
    return sorted(service["shop_a"].glob("*/*.jpg"))


def item_id_of(service: dict, photo: Path) -> str:
    return f"{service['shop_a'].name}/{photo.relative_to(service['shop_a']).as_posix()}"


# ----------------------------------------------------------------------------- tests


def metrics_target(service: dict) -> str:
    """host:port of the metrics jobs/serve.py printed it exports (Ray's metrics port of its node)."""
    found = re.search(r"^\[puma\] metrics for Prometheus: http://([\d.]+:\d+)/metrics ",
                      service["log"].read_text(), re.M)
    assert found, service["log"].read_text()[-3000:]
    return found.group(1)


# the module's first (no request reached the service before it): the service's start-up is its set-up
# (50-68 s), then the metrics reach Prometheus through Ray's export (every few seconds)
@pytest.mark.budget(180)
def test_prometheus_counts_every_request_by_route_kind_and_status(service, tmp_path):
    """A real Prometheus scrapes the metrics port jobs/serve.py prints; known numbers of image, item and
    vector queries and of refused ones (no token, a bad filter) are sent. Through Prometheus's HTTP API:
    the request counters equal what was sent, by route, kind and status; the latency histogram holds each
    kind's requests in its buckets (cumulative, ending at the count) and the exact time counter their
    summed time; the live version's gauge is 1; the stage histograms, batch sizes, filter columns and the
    index's gauges hold what was done and served; and every service metric the dashboard and the alert
    rules (infra/monitoring) use is in the scrape."""
    from prometheus import Prometheus

    sent = {"image": 3, "item_id": 4, "vector": 5}
    ids, x, _ = stored(service["index"])
    photo, started = photos(service)[1], time.monotonic()
    for _ in range(sent["image"]):
        assert call(service, "POST", "search?k=3", photo.read_bytes(), "image/jpeg")[0] == 200
    for i in range(sent["item_id"]):
        assert search_json(service, {"item_id": ids[i], "k": 3})[0] == 200
    for i in range(sent["vector"]):  # the first one filtered
        where = {"filter": {"dataset": "cub"}} if i == 0 else {}
        assert search_json(service, {"vector": x[i].tolist(), "k": 3, **where})[0] == 200
    for token in (None, "wrong-token"):
        assert call(service, "POST", "search", b"{}", "application/json", token=token)[0] == 401
    assert search_json(service, {"vector": x[0].tolist(), "filter": {"no_such_column": 1}})[0] == 422
    spent = time.monotonic() - started
    prometheus = Prometheus([metrics_target(service)], tmp_path / "prometheus")
    try:
        def total(selector: str) -> float | None:
            return prometheus.value(f"sum(ray_puma_requests_total{{{selector}}})")

        for kind, n in sent.items():
            prometheus.wait_for(f'sum(ray_puma_requests_total{{route="/search",kind="{kind}",status="200"}})',
                                lambda v, n=n: v == n)
        prometheus.wait_for('sum(ray_puma_requests_total{route="/search",status="422"})', lambda v: v == 1)
        assert total('route="/search",status="401"') == 2
        assert total('route="/search"') == sum(sent.values()) + 3
        timed = dict(sent, vector=sent["vector"] + 1)  # the bad filter is refused after its query was read
        assert total('route="/search",kind="vector",status="422"') == 1
        for kind, n in timed.items():
            selector = f'route="/search",kind="{kind}"'
            assert prometheus.value(f"sum(ray_puma_request_seconds_count{{{selector}}})") == n
            buckets = {float(r["metric"]["le"]): float(r["value"][1]) for r in prometheus.query(
                f"sum by (le) (ray_puma_request_seconds_bucket{{{selector}}})")}
            counts = [buckets[le] for le in sorted(buckets)]
            assert counts == sorted(counts) and counts[-1] == n and 0.001 in buckets, buckets
            assert 0 < prometheus.value(f"sum(ray_puma_request_time_seconds_total{{{selector}}})") < spent
        # gauges: Ray's agent drops a gauge whose replica's export is more than two intervals late (a loaded
        # machine) until the next one, and Prometheus marks it stale meanwhile: each is waited for
        version = read_alias(service["index"]).live
        prometheus.wait_for(f'max(ray_puma_version_live{{version="{version}"}})', lambda v: v == 1)
        # the stages: a model forward per image query, an index search per answered query
        assert prometheus.value('sum(ray_puma_stage_seconds_count{stage="model"})') == sent["image"]
        assert prometheus.value('sum(ray_puma_stage_seconds_count{stage="index"})') == sum(sent.values())
        # recorded by the model's replica: exported on its own schedule, so waited for
        prometheus.wait_for("sum(ray_puma_model_batch_size_count)", lambda v: v == sent["image"])  # 1 a batch
        assert prometheus.value('sum(ray_puma_model_batch_size_bucket{le="1.0"})') == sent["image"]
        assert prometheus.value('sum(ray_puma_filter_columns_total{column="dataset"})') == 1
        assert prometheus.value("sum(ray_puma_filter_columns_total)") == 1  # not the refused filter's
        # what the index replica serves, and how fresh (serve.watch_interval_s=0.5)
        manifest = read_manifest(resolve(service["index"]))
        prometheus.wait_for(f'sum(ray_puma_index_items{{version="{version}"}})', lambda v: v == 28)
        prometheus.wait_for(f'sum(ray_puma_index_shards{{version="{version}"}})',
                            lambda v: v == len(manifest.shards))
        prometheus.wait_for("time() - max(ray_puma_index_refreshed_timestamp_seconds)",
                            lambda v: v is not None and v < 30)
        prometheus.wait_for(f'max(ray_puma_manifest_written_timestamp_seconds{{version="{version}"}})',
                            lambda v: v == unix_time(manifest.updated))
        assert prometheus.value('sum(ray_puma_refused_total{cause="backpressure"})') == 0  # 0 from the start
        # every service metric the dashboard and the alert rules use is in this scrape
        scraped = prometheus.names()
        used = {n for names in metric_names_used().values() for n in names if n.startswith("ray_")}
        assert used and used <= scraped, sorted(used - scraped)
    finally:
        prometheus.stop()


@pytest.mark.budget(120)  # the service's start-up is its set-up when run alone (50-68 s)
def test_health_is_open_and_everything_else_needs_the_token(service):
    status, _, health = call(service, "GET", "healthz", token=None)
    version, model_id = read_alias(service["index"]).live, read_manifest(resolve(service["index"])).model_id
    assert status == 200 and health == {"status": "ok", "items": 28, "auth": True, "image_queries": True,
                                        "version": version, "model_id": model_id}
    for token in (None, "wrong-token"):
        status, head, body = call(service, "GET", "stats", token=token)
        assert status == 401 and head.get("www-authenticate") == "Bearer"
        assert body["status"] == 401 and "bearer token" in body["error"] and "\n" not in body["error"]
        assert TOKEN not in body["error"]
    status, _, stats = call(service, "GET", "stats")
    index = stats["index"]
    assert status == 200 and index["items"] == 28 and index["shards"] >= 2
    assert index["model_id"] == checkpoint_id(service["checkpoint"])
    assert index["datasets"] == {"cub": 12, "shop_a": 16}
    assert sorted(c["name"] for c in index["catalogues"]) == ["cub", "shop_a"]
    assert stats["limits"]["max_k"] == MAX_K and stats["model"]["device"] == "cpu"
    assert stats["model"]["runtime"] == "onnx"


def test_image_queries_find_the_photo_and_rank_like_brute_force(service):
    ids, x, _ = stored(service["index"])
    photo = photos(service)[3]
    own = item_id_of(service, photo)
    data = photo.read_bytes()
    status, _, raw = call(service, "POST", "search?k=6", data, "image/jpeg")
    assert status == 200 and raw["query"] == {"kind": "image", "bytes": len(data), "k": 6, "dataset": [],
                                              "catalogue": [], "filter": None}
    hits = raw["hits"]
    assert [h["item_id"] for h in hits] == brute_force(ids, x, x[ids.index(own)], 6)
    assert hits[0]["item_id"] == own and hits[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert [h["rank"] for h in hits] == list(range(1, 7)) and raw["model_id"].startswith("sha256:")
    assert hits[0]["dataset"] == "shop_a" and hits[0]["label"] == -1 and hits[0]["image_uri"] == str(photo)
    assert hits[0]["catalogue"] == str(service["shop_a"])
    boundary = "----puma-test"
    disposition = "Content-Disposition: form-data; name="
    head = f'--{boundary}\r\n{disposition}"image"; filename="q.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'
    tail = f'\r\n--{boundary}\r\n{disposition}"k"\r\n\r\n6\r\n--{boundary}--\r\n'
    form = head.encode() + data + tail.encode()
    status, _, by_form = call(service, "POST", "search", form, f"multipart/form-data; boundary={boundary}")
    assert status == 200 and by_form["hits"] == hits
    status, by_b64 = search_json(service, {"image_base64": base64.b64encode(data).decode(), "k": 6})
    assert status == 200 and by_b64["hits"] == hits


def test_item_id_and_vector_queries_with_filters(service):
    ids, x, rows = stored(service["index"])
    own = item_id_of(service, photos(service)[0])
    q = x[ids.index(own)]
    status, by_item = search_json(service, {"item_id": own, "k": 5})
    assert status == 200 and [h["item_id"] for h in by_item["hits"]] == brute_force(ids, x, q, 6)[1:]
    status, with_self = search_json(service, {"item_id": own, "k": 5, "include_self": True})
    assert [h["item_id"] for h in with_self["hits"]] == brute_force(ids, x, q, 5)
    status, by_vector = search_json(service, {"vector": q.tolist(), "k": 5})
    assert status == 200 and by_vector["hits"] == with_self["hits"]
    cub = [i for i, r in enumerate(rows) if r["dataset"] == "cub"]
    status, filtered = search_json(service, {"vector": q.tolist(), "k": 4, "dataset": "cub"})
    assert [h["item_id"] for h in filtered["hits"]] == brute_force(ids, x, q, 4, keep=lambda i: i in cub)
    assert {h["dataset"] for h in filtered["hits"]} == {"cub"}
    assert all(h["label"] >= 0 for h in filtered["hits"])
    status, _, by_catalogue = call(service, "POST", "search?k=3&catalogue=cub",
                                   photos(service)[0].read_bytes(), "image/jpeg")
    assert status == 200 and {h["dataset"] for h in by_catalogue["hits"]} == {"cub"}


def solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(buf, format="PNG")
    return buf.getvalue()


BAD_INPUTS = {
    # name: (method, path, body, content type, token, status, words in the one-line reason)
    "not an image": ("POST", "search", b"plain text, not a JPEG", "image/jpeg", TOKEN, 415, "not an image"),
    "too many bytes": ("POST", "search", b"\xff" * (MAX_BYTES + 1), "image/jpeg", TOKEN, 413,
                       f"the limit is {MAX_BYTES}"),
    "too many pixels": ("POST", "search", solid_png(1100, 1000), "image/png", TOKEN, 413,
                        f"1100x1000 = 1100000 pixels; the limit is {MAX_PIXELS}"),
    "too few pixels": ("POST", "search", solid_png(10, 300), "image/png", TOKEN, 422, "too small"),
    "unknown item id": ("POST", "search", b'{"item_id": "shop_a/nope.jpg"}', "application/json", TOKEN, 404,
                        "unknown item id 'shop_a/nope.jpg'"),
    "k zero": ("POST", "search", b'{"item_id": "x", "k": 0}', "application/json", TOKEN, 422, "k=0 is out"),
    "k above max_k": ("POST", f"search?k={MAX_K + 1}", solid_png(64, 64), "image/png", TOKEN, 422,
                      f"valid: 1 <= k <= {MAX_K}"),
    "malformed JSON": ("POST", "search", b'{"item_id": "x",', "application/json", TOKEN, 400,
                       "malformed JSON"),
    "unsupported content type": ("POST", "search", b"x", "text/csv", TOKEN, 415, "unsupported Content-Type"),
    "vector of the wrong length": ("POST", "search", b'{"vector": [0.5, 0.5]}', "application/json", TOKEN,
                                   422, "vector has 2 values; the index holds 16-dim"),
    "unknown dataset": ("POST", "search", b'{"vector": [0.25], "dataset": "dogs"}', "application/json", TOKEN,
                        422, ""),
    "no token": ("POST", "search", b'{"item_id": "x"}', "application/json", None, 401, "bearer token"),
    "thumbnail of an unknown item": ("GET", "image?item_id=nope", None, "", TOKEN, 404, "unknown item id"),
    "thumbnail without an item": ("GET", "image", None, "", TOKEN, 400, "GET /image?item_id="),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_every_bad_input_gets_a_4xx_with_a_one_line_reason(service, case):
    method, path, body, content_type, token, status, words = BAD_INPUTS[case]
    got, _, answer = call(service, method, path, body, content_type, token)
    assert got == status and answer["status"] == status, answer
    assert words in answer["error"] and "\n" not in answer["error"] and len(answer["error"]) < 400
    if case == "unknown dataset":  # the vector is checked first, so send a right-sized one
        q = [0.25] * 16
        got, answer = search_json(service, {"vector": q, "dataset": "dogs"})
        assert got == 422
        assert "unknown dataset(s) ['dogs']; this index has ['cub', 'shop_a']" in answer["error"]


def test_concurrent_image_queries_share_forwards(service):
    before = call(service, "GET", "stats")[2]["model"]
    chosen = photos(service)[:8]
    barrier, answers = threading.Barrier(len(chosen)), {}

    def query(photo: Path) -> None:
        barrier.wait()
        answers[photo] = call(service, "POST", "search?k=1", photo.read_bytes(), "image/jpeg")

    threads = [threading.Thread(target=query, args=(p,)) for p in chosen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for photo, (status, _, answer) in answers.items():
        assert status == 200 and answer["hits"][0]["item_id"] == item_id_of(service, photo)
    after = call(service, "GET", "stats")[2]["model"]
    assert after["images"] - before["images"] == 8
    assert after["batches"] - before["batches"] < 8 and after["largest_batch"] > 1, (before, after)


def test_the_page_and_thumbnails_are_served(service):
    status, head, page = call(service, "GET", "", token=None)
    assert status == 200 and head["content-type"].startswith("text/html")
    assert b'id="grid"' in page and b'id="file"' in page and b"PUMA search" in page
    photo = photos(service)[1]
    path = "image?item_id=" + urllib.parse.quote(item_id_of(service, photo))
    status, head, data = call(service, "GET", path)
    img = Image.open(io.BytesIO(data))
    assert status == 200 and head["content-type"] == "image/jpeg" and img.format == "JPEG"
    assert max(img.size) <= 256 and img.size[0] / img.size[1] == pytest.approx(
        Image.open(photo).size[0] / Image.open(photo).size[1], rel=0.02)
    cub_item = next(r for r in stored(service["index"])[2] if r["dataset"] == "cub")  # bytes in a Parquet row
    status, _, data = call(service, "GET", "image?item_id=" + urllib.parse.quote(cub_item["item_id"]))
    assert status == 200 and Image.open(io.BytesIO(data)).format == "JPEG" and cub_item["image_row"] >= 0


def test_the_page_in_a_real_browser_uploads_a_photo_and_shows_the_grid(service, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        wait = WebDriverWait(driver, 60)
        driver.get(service["url"])
        wait.until(lambda d: d.find_element(By.ID, "auth").is_displayed())  # stats said 401: asks for it
        assert "bearer token" in driver.find_element(By.ID, "status").text
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "save-token").click()
        wait.until(lambda d: "28 items" in d.find_element(By.ID, "stats").text)
        photo = photos(service)[5]
        driver.find_element(By.ID, "file").send_keys(str(photo))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .hit")) == 8)
        loaded = "return [...document.querySelectorAll('#grid .hit img')].every(i => i.naturalWidth > 0)"
        wait.until(lambda d: d.execute_script(loaded))
        hits = driver.find_elements(By.CSS_SELECTOR, "#grid .hit")
        assert hits[0].get_attribute("data-item-id") == item_id_of(service, photo)
        first = hits[0].text.splitlines()
        assert first[0] == "#1 · 1.000" and first[1] == "shop_a" and first[2] == item_id_of(service, photo)
        scores = [float(h.text.splitlines()[0].split("· ")[1]) for h in hits]
        assert scores == sorted(scores, reverse=True)
        assert "8 results for the image" in driver.find_element(By.ID, "status").text
        shot = tmp_path / "serve_page.png"
        assert driver.save_screenshot(str(shot))
        check_the_filter_box(driver, wait, service, photo)
    finally:
        driver.quit()
    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[1] == 1280 and img.std() > 20  # a page with photos, not a blank one
    print(f"screenshot: {shot}")


def check_the_filter_box(driver, wait, service: dict, photo: Path) -> None:
    """The page's filter box narrows the grid as the API narrows the same query; a hit's attribute,
    clicked, joins the filter."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    def grid() -> list[str]:  # read in one script: the grid may be redrawn between finding and reading
        return driver.execute_script(
            "return [...document.querySelectorAll('#grid .hit')].map(h => h.getAttribute('data-item-id'))")

    def api(where: dict) -> list[str]:
        query = urllib.parse.urlencode({"k": 8, "filter": json.dumps(where)})
        status, _, body = call(service, "POST", f"search?{query}", photo.read_bytes(), "image/jpeg")
        assert status == 200, body
        return [h["item_id"] for h in body["hits"]]

    assert "class_name (string" in driver.find_element(By.ID, "filter-columns").text
    box = driver.find_element(By.ID, "filter")
    box.send_keys('{"dataset": "cub"}' + Keys.ENTER)  # the same photo searched again, filtered
    want = api({"dataset": "cub"})
    assert want and all(i.startswith("cub/") for i in want)
    wait.until(lambda d: grid() == want)
    label = driver.find_elements(By.CSS_SELECTOR, '#grid .hit .attr[data-column="label"]')[0]
    value = int(label.text.split()[-1])
    label.click()
    joined = {"and": [{"dataset": "cub"}, {"label": value}]}
    wait.until(lambda d: json.loads(d.find_element(By.ID, "filter").get_attribute("value")) == joined)
    want = api(joined)
    assert 0 < len(want) < 8  # 4 photos per class: the filter left fewer than k
    wait.until(lambda d: grid() == want)
    box.clear()
    box.send_keys('{"price": {"lt": 5}}' + Keys.ENTER)  # no such column: the API's 422 shown
    wait.until(lambda d: "price" in d.find_element(By.ID, "status").text)
    assert "error" in driver.find_element(By.ID, "status").get_attribute("class")


def test_a_catalogue_embedded_by_the_embed_job_is_found_without_a_restart(service, capsys):
    sys.path.insert(0, str(REPO / "jobs"))
    import embed as embed_job

    before = call(service, "GET", "stats")[2]["index"]
    shop_b = photo_folder(service["root"], "shop_b", 40, 6, 2)
    assert embed_job.main(["--catalogue", str(shop_b), *service["common"]]) == 0
    assert "shop_b: embedded 8" in capsys.readouterr().out
    new_photo = sorted(shop_b.glob("*/*.jpg"))[2]
    new_item = f"shop_b/{new_photo.relative_to(shop_b).as_posix()}"
    deadline = time.monotonic() + 60
    status = 404
    while status == 404 and time.monotonic() < deadline:
        status = search_json(service, {"item_id": new_item, "k": 3})[0]
        time.sleep(0 if status != 404 else 0.5)
    assert status == 200
    status, _, by_image = call(service, "POST", "search?k=3&catalogue=shop_b", new_photo.read_bytes(),
                               "image/jpeg")
    assert status == 200 and by_image["hits"][0]["item_id"] == new_item
    after = call(service, "GET", "stats")[2]["index"]
    assert after["items"] == before["items"] + 8 and after["shards"] > before["shards"]
    assert "shop_b" in after["datasets"] and after["refused_update"] == ""
    assert after["replica"] == before["replica"]  # the same index replica picked it up: no restart
    assert after["replica_started_at"] == before["replica_started_at"]
    assert service["proc"].poll() is None  # the same service process, never restarted


def test_another_models_checkpoint_is_refused_in_one_line_before_ray_starts(service, tmp_path):
    other = make_checkpoint(str(tmp_path / "other"), seed=3)
    env = {**os.environ, "PUMA_RAY_TMP": str(tmp_path / "ray")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "serve.py"), f"index.uri={service['index']}",
                           f"embed.checkpoint={other}", f"serve.port={free_port()}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: refusing to serve: index") and other in lines[0]
    assert not (tmp_path / "ray").exists()  # no Ray was started


class RolloutClients:
    """CLIENTS threads, each querying its own photos in a loop; every answer recorded with its time."""

    def __init__(self, url: str, photos: list[Path], name_of, token: str) -> None:
        self.url, self.photos, self.name_of, self.token = url, photos, name_of, token
        self.stop = threading.Event()
        self.answers: list[list[tuple]] = [[] for _ in range(CLIENTS)]  # (t_sent, t_got, status, body)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> RolloutClients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=150)

    def _run(self, client: int) -> None:
        n = 0
        while not self.stop.is_set():
            photo = self.photos[(client + n) % len(self.photos)]
            n += 1
            request = urllib.request.Request(self.url, data=photo.read_bytes(), method="POST",
                                             headers={"Content-Type": "image/jpeg",
                                                      "Authorization": f"Bearer {self.token}"})
            sent = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    status, body = response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                status, body = error.code, {"error": error.read().decode(errors="replace")}
            except OSError as error:  # a connection refused or reset counts as a failed request
                status, body = 0, {"error": str(error)}
            self.answers[client].append((sent, time.monotonic(), status, body, self.name_of(photo)))

    def latest_versions(self) -> set[str]:
        return {a[-1][3].get("version", "") for a in self.answers if a}

    def wait_for(self, version: str, timeout: float) -> float:
        """Seconds until every client's latest answer comes from ``version``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.latest_versions() == {version}:
                return time.monotonic() - start
            time.sleep(0.05)
        pytest.fail(f"clients still answered by {self.latest_versions()} after {timeout} s")


def test_a_new_model_goes_live_under_load_without_a_failed_or_mixed_response_and_rolls_back(service):
    """8 clients send image queries (embedded by the model, searched in the index) while model B's version
    is built and promoted, then rolled back. The query photo is indexed, so the model and the index agree
    (top hit the photo itself, score 1.0) only when both are of one version; each client's versions move
    A -> B after the promotion and B -> A after the rollback, never back; no request fails."""
    model_b = make_checkpoint(str(service["root"] / "model_b" / "best"), seed=11)
    a, b = version_name(checkpoint_id(service["checkpoint"])), version_name(checkpoint_id(model_b))
    url = service["url"] + "search?k=3"
    with RolloutClients(url, photos(service), lambda p: item_id_of(service, p), TOKEN) as clients:
        clients.wait_for(a, 60)
        time.sleep(2)
        cfg = load_config(None, [*service["common"], f"embed.checkpoint={model_b}"])
        live_catalogues = read_manifest(resolve(service["index"])).catalogues
        building = time.monotonic()
        reports = embed_catalogues(cfg, [])  # a new model: its version of every live catalogue, promoted
        promoted = time.monotonic()
        assert reports[-1].promoted == b and read_alias(service["index"]).live == b
        assert sorted(r.catalogue for r in reports) == sorted(live_catalogues)
        switch_b = clients.wait_for(b, 60)
        time.sleep(2)
        rollback(service["index"])
        rolled = time.monotonic()
        switch_a = clients.wait_for(a, 60)
        time.sleep(1)
    answers = [x for client in clients.answers for x in client]
    failed = [x for x in answers if x[2] != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed, e.g. {failed[:3]}"
    for _sent, _got, _status, body, item in answers:  # one version answered each request, whole
        assert body["version"] == version_name(body["model_id"]) and body["version"] in (a, b)
        top = body["hits"][0]
        assert top["item_id"] == item and top["score"] > 0.999, (body["version"], top)
    for client in clients.answers:  # A, then B once promoted, then A once rolled back: never back
        versions = [x[3]["version"] for x in sorted(client)]
        changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        assert changes == [a, b, a], changes
        assert all(x[3]["version"] == a for x in client if x[1] < building)  # no B before it was built
        assert not [x for x in client if x[3]["version"] == a and promoted + switch_b < x[0] < rolled]
    print(f"rollout: {len(answers)} requests, switch to B {switch_b:.2f} s after promote, back to A "
          f"{switch_a:.2f} s after rollback (watch interval 0.5 s)")
