"""The search service's parts without Ray: request parsing (every refusal and its status), the served
index (filters, hits, thumbnails, new shards, another model refused) and the driver-side checks.

The service itself, over HTTP on a local Ray and in a real browser, is tests/test_serve_app.py.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import encode_image
from PIL import Image

from puma.config import IndexConfig, ServeConfig, load_config
from puma.data.images import ViewSpec
from puma.index import add_items, build_index, read_manifest
from puma.index.manifest import write_manifest
from puma.serve.errors import RequestError, ServiceSetupError, as_request_error
from puma.serve.live_index import LiveIndex
from puma.serve.plan import plan_service
from puma.serve.requests import Limits, image_view, parse_request

REPO = Path(__file__).resolve().parent.parent
LIMITS = Limits(default_k=5, max_k=20, max_upload_bytes=4096, max_image_pixels=10_000)
VIEW = ViewSpec(img_size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), train=False, min_size=16)
DIM = 8
JSON = "application/json"


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args)
    assert "\n" not in info.value.reason and info.value.reason
    return info.value


def multipart(fields: dict[str, bytes], boundary: str = "b0undary") -> tuple[str, bytes]:
    parts = []
    for name, value in fields.items():
        filename = '; filename="photo.jpg"' if name == "image" else ""
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{filename}\r\n'
                     f'Content-Type: application/octet-stream\r\n\r\n'.encode() + value + b"\r\n")
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


# ----------------------------------------------------------------------------- requests


def test_each_kind_of_query_parses_with_its_options():
    photo = encode_image(size=(48, 40))
    raw = parse_request("image/jpeg", photo, {"k": ["7"], "dataset": ["b", "a"]}, LIMITS)
    assert (raw.kind, raw.image, raw.k, raw.datasets, raw.catalogues) == ("image", photo, 7, ("a", "b"), ())
    ctype, body = multipart({"image": photo, "k": b"3", "catalogue": b"shoes"})
    form = parse_request(ctype, body, {}, LIMITS)
    assert (form.kind, form.image, form.k, form.catalogues) == ("image", photo, 3, ("shoes",))
    encoded = json.dumps({"image_base64": base64.b64encode(photo).decode()}).encode()
    b64 = parse_request(JSON, encoded, {}, LIMITS)
    assert (b64.kind, b64.image, b64.k) == ("image", photo, LIMITS.default_k)
    body = b'{"item_id": "cub/1.jpg", "k": 4, "include_self": true, "dataset": "cub"}'
    item = parse_request("application/json; charset=utf-8", body, {}, LIMITS)
    assert (item.kind, item.item_id, item.k, item.include_self, item.datasets) == ("item_id", "cub/1.jpg", 4,
                                                                                   True, ("cub",))
    vector = parse_request("application/json", b'{"vector": [1, 0.5, -2]}', {"k": ["9"]}, LIMITS)
    assert vector.kind == "vector" and vector.k == 9 and vector.vector.dtype == np.float32
    np.testing.assert_array_equal(vector.vector, [1, 0.5, -2])


BAD_REQUESTS = {
    # name: (content type, body, params, status, words the reason must contain)
    "malformed JSON": (JSON, b'{"item_id": ', {}, 400, "malformed JSON"),
    "JSON that is not an object": (JSON, b"[1, 2]", {}, 400, "must be an object"),
    "unknown JSON field": (JSON, b'{"item_id": "a", "kk": 3}', {}, 400, "unknown field(s) ['kk']"),
    "two queries at once": (JSON, b'{"item_id": "a", "vector": [1]}', {}, 400, "exactly one of"),
    "no query at all": (JSON, b'{"k": 3}', {}, 400, "exactly one of"),
    "k not an integer": (JSON, b'{"item_id": "a", "k": "many"}', {}, 400, "k must be an integer"),
    "k a boolean": (JSON, b'{"item_id": "a", "k": true}', {}, 400, "k must be an integer"),
    "k zero": (JSON, b'{"item_id": "a", "k": 0}', {}, 422, "k=0 is out of range"),
    "k above max_k": ("image/png", encode_image(fmt="PNG"), {"k": ["21"]}, 422, "valid: 1 <= k <= 20"),
    "empty item id": (JSON, b'{"item_id": ""}', {}, 400, "item_id must be a non-empty string"),
    "vector of strings": (JSON, b'{"vector": ["a"]}', {}, 400, "list of numbers"),
    "empty vector": (JSON, b'{"vector": []}', {}, 422, "vector is empty"),
    "vector with NaN": (JSON, b'{"vector": [1, NaN]}', {}, 422, "NaN or infinite"),
    "vector beyond float32": (JSON, b'{"vector": [1e39]}', {}, 422, "NaN or infinite"),
    "bad base64": (JSON, b'{"image_base64": "***"}', {}, 400, "not valid base64"),
    "dataset of numbers": (JSON, b'{"item_id": "a", "dataset": [1]}', {}, 400, "list of names"),
    "include_self not a flag": (JSON, b'{"item_id": "a", "include_self": "maybe"}', {}, 400,
                                "include_self must be true or false"),
    "unsupported content type": ("text/plain", b"hello", {}, 415, "unsupported Content-Type 'text/plain'"),
    "raw image above the byte limit": ("image/jpeg", b"x" * 4097, {}, 413, "the limit is 4096"),
    "base64 image above the byte limit": ("application/json",
                                          json.dumps({"image_base64": base64.b64encode(b"x" * 5000).decode()}
                                                     ).encode(), {}, 413, "the limit is 4096"),
    "form without an image": (*multipart({"k": b"3"}), {}, 400, "exactly one file field 'image'"),
    "form with an unknown field": (*multipart({"image": b"x", "colour": b"red"}), {}, 400,
                                   "unknown form field(s) ['colour']"),
    "form without parts": ("multipart/form-data; boundary=zz", b"nothing here", {}, 400,
                           "malformed multipart"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_every_bad_request_gets_its_status_and_a_one_line_reason(case):
    content_type, body, params, status, words = BAD_REQUESTS[case]
    error = refused(parse_request, content_type, body, params, LIMITS)
    assert (error.status, words in error.reason) == (status, True), error.reason
    assert error.to_dict() == {"error": error.reason, "status": status}


def test_image_views_and_every_bad_image():
    view = image_view(encode_image(size=(64, 48)), VIEW, LIMITS.max_image_pixels)
    assert view.shape == (3, 32, 32) and view.dtype == np.float32
    photo = encode_image(size=(120, 90))  # 10,800 pixels > 10,000
    truncated = encode_image(size=(90, 100))
    cases = {b"GIF89a not really": (415, "not an image"), b"": (400, "empty"),
             photo: (413, "120x90 = 10800 pixels; the limit is 10000"),
             encode_image(size=(12, 40), fmt="PNG"): (422, "too small"),
             truncated[:len(truncated) * 2 // 3]: (415, "not a usable image (truncated")}
    for data, (status, words) in cases.items():
        error = refused(image_view, data, VIEW, LIMITS.max_image_pixels)
        assert error.status == status and words in error.reason, error.reason


def test_request_errors_survive_pickling_and_ray_style_wrapping():
    import pickle

    error = pickle.loads(pickle.dumps(RequestError(404, "unknown item id 'x'")))
    assert (error.status, error.reason) == (404, "unknown item id 'x'")

    class Wrapped(RequestError):  # what Ray raises: an instance of the cause's class, the cause inside
        def __init__(self, cause):
            Exception.__init__(self, "traceback text\nover lines")
            self.cause = cause

    unwrapped = as_request_error(Wrapped(RequestError(422, "k=0 is out of range")))
    assert (unwrapped.status, unwrapped.reason) == (422, "k=0 is out of range")
    assert as_request_error(ValueError("no")) is None


# ----------------------------------------------------------------------------- the served index


def vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def items_table(root: Path, prefix: str, x: np.ndarray, catalogue: str, images: bool = True) -> pa.Table:
    """An embeddings table with the embed job's columns; real image files when ``images``."""
    ids = [f"{prefix}/{i:03d}.png" for i in range(len(x))]
    uris = []
    for i, item in enumerate(ids):
        path = root / "images" / item
        if images:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode_image(size=(300, 200), fmt="PNG", seed=i))
        uris.append(str(path))
    return pa.table({"item_id": ids, "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
                     "dataset": [prefix] * len(x), "label": np.arange(len(x)) % 3,
                     "catalogue": [catalogue] * len(x), "image_uri": uris, "image_row": [-1] * len(x)})


@pytest.fixture
def served(tmp_path):
    """A flat index of two datasets (cub, cars) in two catalogues, model m1, and its LiveIndex."""
    uri = str(tmp_path / "index")
    x_cub, x_cars = vectors(30, 1), vectors(20, 2)
    build_index(uri, items_table(tmp_path, "cub", x_cub, "s3://b/cat/birds"), IndexConfig(index_type="flat"),
                model_id="m1")
    add_items(uri, items_table(tmp_path, "cars", x_cars, "s3://b/cat/autos"), model_id="m1")
    live = LiveIndex(IndexConfig(uri=uri, use_gpu=False), "m1", DIM)
    return {"live": live, "uri": uri, "x": np.concatenate([x_cub, x_cars]), "root": tmp_path,
            "ids": [f"cub/{i:03d}.png" for i in range(30)] + [f"cars/{i:03d}.png" for i in range(20)]}


def brute_force(x: np.ndarray, q: np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[int]:
    scores = x @ q  # (N,)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k] if np.isfinite(scores[i])]


def test_vector_and_item_queries_equal_brute_force_with_and_without_filters(served):
    live, x, ids = served["live"], served["x"], served["ids"]
    q = vectors(1, 7)[0]
    hits = live.search_vector(q, 6)
    assert [h["item_id"] for h in hits] == [ids[i] for i in brute_force(x, q, 6)]
    assert [h["rank"] for h in hits] == list(range(1, 7))
    np.testing.assert_allclose([h["score"] for h in hits], np.sort(x @ q)[::-1][:6], atol=1e-5)
    first = hits[0]
    assert set(first) == {"rank", "score", "item_id", "dataset", "label", "class_name", "catalogue",
                          "image_uri", "image_row", "metadata"}
    assert (first["class_name"], first["metadata"]) == ("", {})  # an index built without them
    cars = np.array([i.startswith("cars/") for i in ids])
    assert [h["item_id"] for h in live.search_vector(q, 6, datasets=("cars",))] == \
        [ids[i] for i in brute_force(x, q, 6, cars)]
    by_name = live.search_vector(q, 4, catalogues=("autos",))
    assert by_name == live.search_vector(q, 4, catalogues=("s3://b/cat/autos",))
    assert {h["catalogue"] for h in by_name} == {"s3://b/cat/autos"}
    assert len(live.search_vector(q, 40, datasets=("cars",))) == 20  # fewer than k: all there are
    assert len(live.search_vector(q, 500)) == 50  # k above the index size: every item
    item = live.search_item("cub/004.png", 5)
    assert "cub/004.png" not in [h["item_id"] for h in item]
    assert [h["item_id"] for h in item] == [ids[i] for i in brute_force(x, x[4], 6)[1:]]
    assert live.search_item("cub/004.png", 5, include_self=True)[0]["item_id"] == "cub/004.png"


def test_served_index_refusals(served):
    live = served["live"]
    cases = [(lambda: live.search_vector(np.ones(DIM + 1, np.float32), 3), 422, "the index holds 8-dim"),
             (lambda: live.search_item("cub/999.png", 3), 404, "unknown item id 'cub/999.png'"),
             (lambda: live.search_vector(vectors(1, 3)[0], 3, datasets=("dogs",)), 422,
              "unknown dataset(s) ['dogs']; this index has ['cars', 'cub']"),
             (lambda: live.search_vector(vectors(1, 3)[0], 3, catalogues=("shoes",)), 422,
              "unknown catalogue(s) ['shoes']"),
             (lambda: live.thumbnail("nope"), 404, "unknown item id")]
    for call, status, words in cases:
        error = refused(call)
        assert error.status == status and words in error.reason, error.reason


def test_thumbnails_are_small_jpegs_of_the_stored_image(served):
    data = served["live"].thumbnail("cars/002.png")
    img = Image.open(io.BytesIO(data))
    assert img.format == "JPEG" and max(img.size) == 256 and img.size == (256, 171)  # 300x200 scaled
    Path(served["root"] / "images" / "cars" / "002.png").unlink()
    assert refused(served["live"].thumbnail, "cars/002.png").status == 404


def test_new_shards_are_served_after_a_refresh_and_another_model_is_refused(served, tmp_path):
    live, uri = served["live"], served["uri"]
    before = live.state
    assert live.refresh() is False and live.state is before  # nothing new: nothing reloaded
    new = vectors(10, 5)
    add_items(uri, items_table(tmp_path, "dogs", new, "s3://b/cat/dogs", images=False), model_id="m1")
    assert live.search_vector(new[0], 1)[0]["item_id"] != "dogs/000.png"  # not yet
    assert live.refresh() is True
    assert live.state.index._shards[:2] == before.index._shards  # loaded shards kept
    assert live.search_vector(new[0], 1)[0]["item_id"] == "dogs/000.png"
    stats = live.stats()
    assert (stats["items"], stats["shards"]) == (60, 3)
    assert stats["datasets"] == {"cars": 20, "cub": 30, "dogs": 10}
    assert [c["name"] for c in stats["catalogues"]] == ["autos", "birds", "dogs"]
    assert live.search_vector(new[0], 3, datasets=("dogs",))[0]["item_id"] == "dogs/000.png"
    manifest = read_manifest(uri)  # the index rebuilt by another model at the same place
    manifest.model_id = "m2"
    write_manifest(uri, manifest)
    assert live.refresh() is False
    assert "model 'm2', not of the served model 'm1'" in live.stats()["refused_update"]
    assert live.search_vector(new[0], 1)[0]["item_id"] == "dogs/000.png"  # still serving m1's


def test_an_index_without_shards_answers_503_until_a_catalogue_arrives(tmp_path):
    from puma.index import create_index

    uri = str(tmp_path / "index")
    create_index(uri, IndexConfig(index_type="flat"), vectors(4, 0), model_id="m1")
    live = LiveIndex(IndexConfig(uri=uri, use_gpu=False), "m1", DIM)
    error = refused(live.search_vector, vectors(1, 1)[0], 3)
    assert error.status == 503 and "jobs/embed.py" in error.reason
    assert live.stats()["items"] == 0
    add_items(uri, items_table(tmp_path, "cub", vectors(5, 2), "c", images=False), model_id="m1")
    assert live.refresh() and len(live.search_vector(vectors(1, 1)[0], 3)) == 3


def test_the_served_index_on_s3_searches_refreshes_and_reads_thumbnails(s3_storage, tmp_path):
    """Everything the index deployment reads goes through puma.storage: the same on a real S3 server."""
    from puma import storage

    uri = f"{s3_storage}/index"
    table = items_table(tmp_path, "cub", vectors(12, 4), f"{s3_storage}/catalogues/birds")
    image_uris = [f"{s3_storage}/images/{i:03d}.png" for i in range(12)]
    for path, target in zip(table["image_uri"].to_pylist(), image_uris, strict=True):
        storage.write_bytes(target, Path(path).read_bytes())
    table = table.set_column(table.schema.get_field_index("image_uri"), "image_uri", pa.array(image_uris))
    build_index(uri, table, IndexConfig(index_type="flat"), model_id="m1")
    live = LiveIndex(IndexConfig(uri=uri, use_gpu=False), "m1", DIM)
    q = vectors(12, 4)[3]
    assert live.search_vector(q, 1)[0]["item_id"] == "cub/003.png"
    assert Image.open(io.BytesIO(live.thumbnail("cub/003.png"))).size == (256, 171)
    add_items(uri, items_table(tmp_path, "cars", vectors(5, 6), "c", images=False), model_id="m1")
    assert live.refresh() and live.stats()["items"] == 17
    assert live.search_vector(vectors(5, 6)[2], 1)[0]["item_id"] == "cars/002.png"
    assert sorted(c["name"] for c in live.stats()["catalogues"]) == ["birds", "c"]


# ----------------------------------------------------------------------------- driver-side checks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny import make_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return {"a": make_checkpoint(str(root / "a")), "b": make_checkpoint(str(root / "b"), seed=1)}


def index_of(root: Path, model_id: str, dim: int = 16) -> str:
    x = np.random.default_rng(0).standard_normal((6, dim)).astype(np.float32)
    uri = str(root / f"index-{len(model_id)}-{dim}")
    build_index(uri, pa.table({"item_id": [f"i{i}" for i in range(6)],
                               "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), dim)}),
                IndexConfig(index_type="flat"), model_id=model_id)
    return uri


def test_the_driver_refuses_what_cannot_be_served_before_ray_starts(checkpoints, tmp_path):
    from puma.checkpoint import checkpoint_id

    own = index_of(tmp_path, checkpoint_id(checkpoints["a"]))
    ok = plan_service(load_config(None, [f"index.uri={own}", f"embed.checkpoint={checkpoints['a']}"]))
    assert ok.model_id == checkpoint_id(checkpoints["a"]) and ok.view.img_size == 32
    copy = str(shutil.copytree(checkpoints["a"], tmp_path / "copy"))  # the same model elsewhere: fine
    plan = plan_service(load_config(None, [f"index.uri={own}", f"embed.checkpoint={copy}"]))
    assert plan.checkpoint == copy
    unrecorded = index_of(tmp_path, "")
    cases = {
        (f"index.uri={tmp_path / 'none'}", f"embed.checkpoint={checkpoints['a']}"): "no index at",
        (f"index.uri={own}", f"embed.checkpoint={checkpoints['b']}"): "refusing to serve: index",
        (f"index.uri={own}", f"embed.checkpoint={tmp_path / 'missing'}"): "image queries need the checkpoint",
        (f"index.uri={unrecorded}", f"embed.checkpoint={checkpoints['a']}"): "records no model id",
        (f"index.uri={index_of(tmp_path, 'x' * 7, dim=8)}", f"embed.checkpoint={checkpoints['a']}"):
            "embeds to 16 dims",
    }
    for overrides, words in cases.items():
        with pytest.raises(ServiceSetupError, match=words) as info:
            plan_service(load_config(None, list(overrides)))
        assert "\n" not in str(info.value)
    vectors_only = plan_service(load_config(None, [f"index.uri={unrecorded}", "serve.image_queries=false"]))
    assert (vectors_only.checkpoint, vectors_only.view) == ("", None)


def test_serve_job_check_and_one_line_errors(checkpoints, tmp_path, capsys):
    from puma.checkpoint import checkpoint_id
    from puma.cli import run_job

    sys.path.insert(0, str(REPO / "jobs"))
    import serve as serve_job

    own = index_of(tmp_path, checkpoint_id(checkpoints["a"]))
    assert serve_job.main(["--check", f"index.uri={own}", f"embed.checkpoint={checkpoints['a']}"]) == 0
    assert "[puma] ok: index" in capsys.readouterr().out
    argv = ["--check", f"index.uri={own}", f"embed.checkpoint={checkpoints['b']}"]
    assert run_job(serve_job.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: refusing to serve")
    try:  # a bad config value exits 2 in the shared command line (SystemExit or run_job's return)
        code = run_job(serve_job.main, ["--check", "serve.max_k=0"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and "serve.max_k=0 is out of range" in capsys.readouterr().err


def test_serve_config_validates():
    assert ServeConfig().default_k <= ServeConfig().max_k
    cases = {("serve.gpu=sometimes",): "serve.gpu", ("serve.port=0",): "serve.port",
             ("serve.index_min_replicas=3", "serve.index_max_replicas=2"): "need 1 <= min <= max",
             ("serve.default_k=30", "serve.max_k=20"): "serve.default_k=30 is out of range"}
    for overrides, words in cases.items():
        with pytest.raises(ValueError, match=words):
            load_config(None, list(overrides))


def test_the_app_builder_for_serve_run_resolves_config_and_refuses_unknown_keys(checkpoints, tmp_path):
    from ray.serve import Application

    from puma.checkpoint import checkpoint_id
    from puma.config import ConfigError
    from puma.serve.app import build

    own = index_of(tmp_path, checkpoint_id(checkpoints["a"]))
    app = build({"config": str(REPO / "configs" / "demo.yaml"), "index.uri": own,
                 "embed.checkpoint": checkpoints["a"], "serve.max_k": "50"})
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match="serve.max_kk"):
        build({"index.uri": own, "serve.max_kk": "5"})


def test_deployments_autoscale_and_take_gpus_only_when_wanted():
    from puma.serve.app import deployment_options, gpus_wanted
    from puma.serve.autoscale import partition_replicas

    cfg = load_config(None, ["serve.index_min_replicas=2", "serve.index_max_replicas=6",
                             "serve.target_ongoing_requests=3", "serve.model_num_gpus=0.5"])
    cpu, gpu = deployment_options(cfg, use_gpu=False), deployment_options(cfg, use_gpu=True)
    assert cpu["index"]["autoscaling_config"] == {  # the policy adds the partitions' channel load
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 3.0,
        "policy": {"policy_function": partition_replicas}}
    assert cpu["model"]["autoscaling_config"]["max_replicas"] == 2 and cpu["ingress"]["num_replicas"] == 1
    assert cpu["model"]["max_ongoing_requests"] >= cfg.serve.max_batch_size  # a replica can fill a batch
    assert cpu["model"]["autoscaling_config"]["target_ongoing_requests"] == cfg.serve.max_batch_size
    assert all("num_gpus" not in o["ray_actor_options"] for o in cpu.values())
    assert gpu["model"]["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert gpu["index"]["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert "num_gpus" not in gpu["ingress"]["ray_actor_options"]  # HTTP and decoding need no GPU
    assert gpus_wanted(load_config(None, ["serve.gpu=always"])) is True
    assert gpus_wanted(load_config(None, ["serve.gpu=never"])) is False
    assert gpus_wanted(load_config(None, ["serve.gpu=auto"])) is False  # no Ray here: no GPUs seen


@pytest.mark.gpu
def test_on_a_gpu_the_index_searches_with_faiss_gpu_and_answers_as_on_cpu(served):
    """What the index deployment holds when GPUs are used: the same answers as on CPU."""
    import faiss

    if faiss.get_num_gpus() == 0:
        pytest.skip("FAISS sees no GPU (needs faiss-gpu on a GPU machine)")
    live_gpu = LiveIndex(IndexConfig(uri=served["uri"], use_gpu=True), "m1", DIM)
    assert live_gpu.state.index.on_gpu and live_gpu.stats()["on_gpu"]
    q = vectors(1, 11)[0]
    assert [h["item_id"] for h in live_gpu.search_vector(q, 8)] == \
        [h["item_id"] for h in served["live"].search_vector(q, 8)]
    cars = ("cars",)  # a filter: ID selectors, which run on the CPU copies of the shards
    assert [h["item_id"] for h in live_gpu.search_vector(q, 5, datasets=cars)] == \
        [h["item_id"] for h in served["live"].search_vector(q, 5, datasets=cars)]


@pytest.mark.gpu
def test_on_a_gpu_the_model_deployment_embeds_on_cuda_as_on_cpu(checkpoints):
    """What the model deployment holds when GPUs are used: CUDA embeddings equal the CPU's."""
    import torch

    from puma import storage
    from puma.inference.embedder import Embedder

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    views = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    on_gpu = Embedder(checkpoints["a"], "", storage.current_config(), use_gpu=True, threads=1)
    on_cpu = Embedder(checkpoints["a"], "", storage.current_config(), use_gpu=False, threads=1)
    assert on_gpu.device.type == "cuda"
    np.testing.assert_allclose(on_gpu.forward(views), on_cpu.forward(views), atol=1e-3)


def _version(location: Path, name: str, model_id: str, names: list[str], seed: int) -> np.ndarray:
    from puma.index.build import commit_changes
    from puma.index.versions import version_uri

    x = np.random.default_rng(seed).standard_normal((len(names), 8)).astype(np.float32)
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)
    table = pa.table({"item_id": names, "embedding": embedding})
    uri = version_uri(str(location), name)
    build_index(uri, table, IndexConfig(index_type="flat", use_gpu=False), model_id=model_id)
    commit_changes(uri, update=lambda m: m.catalogues.update({"c": {}}))
    return x


def test_served_indexes_follow_the_alias_and_drop_the_old_version_once_no_request_holds_it(tmp_path):
    from puma.index.versions import promote, rollback
    from puma.serve.versions import ServedIndexes

    location = tmp_path / "loc"
    xa = _version(location, "m-a", "sha256:a", ["a/1", "a/2", "a/3"], seed=1)
    xb = _version(location, "m-b", "sha256:b", ["b/1", "b/2"], seed=2)
    promote(str(location), "m-a")
    served = ServedIndexes(IndexConfig(uri=str(location), use_gpu=False), 8, grace_s=0.0)
    assert served.live == "m-a" and served.loaded == ["m-a"] and not served.refresh()
    with served.use() as held:  # a request that started on A
        promote(str(location), "m-b")
        assert served.refresh() and served.live == "m-b" and served.loaded == ["m-a", "m-b"]
        assert held.version == "m-a" and held.search_vector(xa[0], 1)[0]["item_id"] == "a/1"
        served.refresh()
        assert served.loaded == ["m-a", "m-b"]  # still held: not dropped
    served.refresh()
    assert served.loaded == ["m-b"]  # released and past the grace period: dropped
    with served.use() as live:
        assert live.search_vector(xb[1], 1)[0]["item_id"] == "b/2" and live.stats()["version"] == "m-b"
    with served.use("m-a") as pinned:  # a request pinned to A (another replica was slower): loaded again
        assert pinned.search_vector(xa[2], 1)[0]["item_id"] == "a/3"
    rollback(str(location))
    assert served.refresh() and served.live == "m-a"
    with pytest.raises(RequestError, match="no longer exists") as err:
        served.get("m-gone")
    assert err.value.status == 409
