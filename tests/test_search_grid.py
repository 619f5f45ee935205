"""Search by image (a real tiny checkpoint, real flower photos) and the retrieval grid PNG."""

from __future__ import annotations

import io
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tiny import tiny_config

from puma.checkpoint import CheckpointState, load_model, probe_embeddings, save_checkpoint
from puma.config import IndexConfig
from puma.index import ShardedIndex, build_index
from puma.inference.grid import BORDER, CELL_H, CELL_W, FRAMES, PLACEHOLDER, TILE
from puma.inference.query import QueryImageError, embed_images
from puma.inference.search import run_search
from puma.methods import build_model
from puma.models.trainable import trainable_state_dict

FLOWERS = Path(__file__).resolve().parents[2] / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")
SPECIES = ("bluebell", "buttercup", "daisy")
PER_SPECIES = 4
K = 4


def flower_paths() -> list[tuple[str, int, Path]]:
    """(species, label, path) for PER_SPECIES photos of each species in SPECIES."""
    out = []
    for label, species in enumerate(SPECIES):
        photos = sorted((FLOWERS / species).glob("*.jpg"))[:PER_SPECIES]
        out += [(species, label, p) for p in photos]
    return out


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> dict:
    """A tiny checkpoint, and an index of flower photos embedded with it (half stored in Parquet rows)."""
    if not all((FLOWERS / s).is_dir() for s in SPECIES):
        pytest.skip(f"sample data not found at {FLOWERS}")
    root = tmp_path_factory.mktemp("search")
    cfg = tiny_config()
    torch.manual_seed(0)  # the head's random init: the same neighbours on every run
    model = build_model(cfg.model)
    ckpt = str(root / "ckpt")
    probe = probe_embeddings(model, cfg.model.backbone.img_size)
    state = CheckpointState(config=cfg, model=trainable_state_dict(model), meta={"probe": probe})
    save_checkpoint(ckpt, state)
    loaded, loaded_cfg = load_model(ckpt)
    items = flower_paths()
    names, x = embed_images(loaded, loaded_cfg, [str(p) for _, _, p in items])  # (12, 16)
    images = root / "images.parquet"  # the first species' bytes as Parquet rows (image_row >= 0)
    pq.write_table(pa.table({"image": [p.read_bytes() for s, _, p in items if s == SPECIES[0]]}), images)
    n = len(items)
    uris = [str(images) if s == SPECIES[0] else str(p) for s, _, p in items]
    rows = [i if s == SPECIES[0] else -1 for i, (s, _, _) in enumerate(items)]
    uris[-1] = str(root / "deleted.jpg")  # an image gone from storage: the grid shows a placeholder
    table = pa.table({"item_id": [f"flowers/{s}/{p.name}" for s, _, p in items],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1]),
                      "dataset": ["flowers"] * n, "label": [label for _, label, _ in items],
                      "role": ["query"] * n, "catalogue": ["flowers12"] * n,
                      "image_uri": uris, "image_row": pa.array(rows, pa.int64())})
    table = table.set_column(3, "label", pa.array([label if i != 1 else -1 for i, (_, label, _) in
                                                   enumerate(items)], pa.int64()))  # item 1: unlabelled
    index_cfg = IndexConfig(uri=str(root / "index"), index_type="flat", shard_size=5, use_gpu=False)
    build_index(index_cfg.uri, table, index_cfg)
    return {"root": root, "ckpt": ckpt, "cfg": index_cfg, "items": items, "x": x, "names": names,
            "item_ids": table["item_id"].to_pylist(), "labels": table["label"].to_pylist()}


def test_search_by_image_equals_search_by_stored_vector(catalogue: dict) -> None:
    queries = [str(catalogue["items"][i][2]) for i in (0, 6)]
    out = run_search(catalogue["cfg"], K, image_uris=queries, checkpoint=catalogue["ckpt"],
                     out_uri=str(catalogue["root"] / "by_image.parquet"))
    index = ShardedIndex.open(catalogue["cfg"].uri, use_gpu=False)
    stored = index.embeddings([catalogue["item_ids"][i] for i in (0, 6)])
    scores, ids = index.search(stored, K)
    got = out.results.to_pydict()
    assert got["query"] == [q for q in queries for _ in range(K)]
    assert got["item_id"] == list(ids.ravel())
    np.testing.assert_allclose(got["score"], scores.ravel(), atol=1e-5)
    assert ids[0, 0] == catalogue["item_ids"][0] and ids[1, 0] == catalogue["item_ids"][6]  # itself first


def test_bad_query_images_and_wrong_checkpoint_are_refused(catalogue: dict, capsys) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    import search as search_job

    bad = catalogue["root"] / "not-an-image.jpg"
    bad.write_bytes(b"plain text, not a JPEG")
    model, cfg = load_model(catalogue["ckpt"])
    with pytest.raises(QueryImageError, match="not-an-image.jpg"):
        embed_images(model, cfg, [str(catalogue["items"][0][2]), str(bad)])
    missing = str(catalogue["root"] / "nowhere.jpg")
    argv = ["--image", missing, "--checkpoint", catalogue["ckpt"], f"index.uri={catalogue['cfg'].uri}",
            "index.use_gpu=false"]
    assert search_job.main(argv) == 2
    assert "nowhere.jpg" in capsys.readouterr().err
    x = np.eye(8, dtype=np.float32)  # an index of 8-dim vectors: another model's
    other = str(catalogue["root"] / "other-index")
    build_index(other, pa.table({"item_id": [f"o{i}" for i in range(8)],
                                 "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)}),
                IndexConfig(index_type="flat"))
    argv = ["--image", str(catalogue["items"][0][2]), "--checkpoint", catalogue["ckpt"], f"index.uri={other}",
            "index.use_gpu=false"]
    assert search_job.main(argv) == 2
    assert "embeds to 16 dims" in capsys.readouterr().err


def test_image_queries_warn_only_when_the_checkpoint_is_not_the_indexs_model(catalogue: dict, tmp_path,
                                                                             caplog) -> None:
    """An index records its model id as the embed job computes it (puma.checkpoint.checkpoint_id, a
    sha256): the index's own checkpoint, or a copy of it, searches without a warning; another model's
    checkpoint gets one warning naming both models (a warning, not a refusal: the vectors have the
    same size, the scores are just not comparable)."""
    from tiny import make_checkpoint

    from puma.checkpoint import checkpoint_id

    x, ckpt = catalogue["x"], catalogue["ckpt"]
    uri = str(tmp_path / "index")
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])
    build_index(uri, pa.table({"item_id": [f"f{i}" for i in range(len(x))], "embedding": vectors}),
                IndexConfig(index_type="flat", use_gpu=False), model_id=checkpoint_id(ckpt))
    cfg, query = IndexConfig(uri=uri, use_gpu=False), [str(catalogue["items"][0][2])]
    copy = str(shutil.copytree(ckpt, tmp_path / "copy"))
    other = make_checkpoint(str(tmp_path / "other"), seed=1)
    caplog.set_level(logging.WARNING, logger="puma.inference.search")
    for checkpoint in (ckpt, copy):
        out = run_search(cfg, 2, image_uris=query, checkpoint=checkpoint, out_uri=str(tmp_path / "r.parquet"))
        assert out.results["item_id"][0].as_py() == "f0"  # itself first: the same model
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    run_search(cfg, 2, image_uris=query, checkpoint=other, out_uri=str(tmp_path / "r.parquet"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and checkpoint_id(ckpt) in warnings[0] and checkpoint_id(other) in warnings[0]


def frame_colour(grid: Image.Image, row: int, col: int) -> tuple[int, int, int]:
    return grid.getpixel((col * CELL_W + BORDER // 2, row * CELL_H + BORDER // 2))


def tile_pixels(grid: Image.Image, row: int, col: int) -> np.ndarray:
    left, top = col * CELL_W + BORDER, row * CELL_H + BORDER
    return np.asarray(grid.crop((left, top, left + TILE, top + TILE)))  # (TILE, TILE, 3)


def test_grid_by_item_id_frames_matches_and_shows_placeholders(catalogue: dict) -> None:
    ids, labels = catalogue["item_ids"], catalogue["labels"]
    queries = [ids[0], ids[5], ids[-1], ids[1]]  # Parquet-row image, file image, deleted image, unlabelled
    grid_uri = str(catalogue["root"] / "grid.png")
    out = run_search(catalogue["cfg"], K, item_ids=queries, out_uri=str(catalogue["root"] / "r.parquet"),
                     grid_uri=grid_uri)
    grid = Image.open(io.BytesIO(Path(grid_uri).read_bytes())).convert("RGB")
    assert grid.size == ((K + 1) * CELL_W, len(queries) * CELL_H)
    results = np.array(out.results["item_id"].to_pylist()).reshape(len(queries), K)
    label_of = dict(zip(ids, labels, strict=True))
    seen = set()
    for row, query in enumerate(queries):
        assert frame_colour(grid, row, 0) == FRAMES["query"]
        for rank, item in enumerate(results[row], start=1):
            a, b = label_of[query], label_of[item]
            want = "unknown" if -1 in (a, b) else "match" if a == b else "mismatch"
            assert frame_colour(grid, row, rank) == FRAMES[want], (query, item)
            seen.add(want)
    assert {"match", "mismatch", "unknown"} <= seen  # every frame kind was drawn and checked
    placeholder = tile_pixels(grid, 2, 0)  # the deleted query image
    assert (placeholder.reshape(-1, 3) == PLACEHOLDER).all(axis=1).mean() > 0.8
    for row in (0, 1):  # real photos (from a Parquet row and from a file): not placeholders
        photo = tile_pixels(grid, row, 0)
        assert (photo.reshape(-1, 3) == PLACEHOLDER).all(axis=1).mean() < 0.1 and photo.std() > 10


def test_grid_by_image_has_unknown_frames(catalogue: dict) -> None:
    grid_uri = str(catalogue["root"] / "grid-image.png")
    run_search(catalogue["cfg"], 3, image_uris=[str(catalogue["items"][9][2])], checkpoint=catalogue["ckpt"],
               out_uri=str(catalogue["root"] / "r2.parquet"), grid_uri=grid_uri)
    grid = Image.open(grid_uri).convert("RGB")
    assert grid.size == (4 * CELL_W, CELL_H)
    assert [frame_colour(grid, 0, c) for c in range(4)] == [FRAMES["query"]] + [FRAMES["unknown"]] * 3
    assert tile_pixels(grid, 0, 0).std() > 10  # the query photo itself is drawn


def test_grid_of_vector_queries_has_placeholder_query_tiles(catalogue: dict) -> None:
    root = catalogue["root"]
    np.save(root / "q.npy", catalogue["x"][[2, 7]])
    out = run_search(catalogue["cfg"], 2, queries_uri=str(root / "q.npy"), out_uri=str(root / "r3.parquet"),
                     grid_uri=str(root / "grid-vectors.png"))
    firsts = out.results["item_id"].to_pylist()[::2]  # each vector finds its own item first
    assert out.grid_uri and firsts == [catalogue["item_ids"][i] for i in (2, 7)]
    grid = Image.open(out.grid_uri).convert("RGB")
    assert grid.size == (3 * CELL_W, 2 * CELL_H)
    for row in (0, 1):
        assert (tile_pixels(grid, row, 0).reshape(-1, 3) == PLACEHOLDER).all(axis=1).mean() > 0.8
        assert tile_pixels(grid, row, 1).std() > 10  # the result photo
