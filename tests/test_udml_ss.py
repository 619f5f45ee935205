"""UDML-SS (model.method=udml_ss): trainable set, rotations, k-means pseudo-labels on schedule, the
metric loss on un-rotated images only, the rotation loss falling on real photos, and an unlabeled
catalogue trained end to end through Ray Train (a supervised method refuses it)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import faiss
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from tiny import TINY_BACKBONE, tiny_config, tiny_images

from puma.config import Config, ConfigError, from_dict, load_config, to_dict
from puma.data import schema
from puma.data.images import ViewSpec, make_view
from puma.data.manifest import load_manifest
from puma.data.prepare import prepare
from puma.data.pseudo_labels import PseudoLabels, kmeans_pseudo_labels
from puma.data.sources import SourceSpec
from puma.data.splits import global_label_map, label_range, unlabeled_datasets
from puma.methods import build_method_training, build_model, needs_labels
from puma.methods.udml_ss import build_ms_loss
from puma.models import trainable_parameter_groups
from puma.models.rotation import NUM_ROTATIONS, draw_rotations, rotate_images
from puma.models.udml_ss import UdmlSsModel
from puma.optim import build_optimizer
from puma.train.step import train_step

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
E = 16  # tiny embedding size


def udml_config(**udml_ss) -> Config:
    """Tiny udml_ss Config (PUMA adapters and prompt pool, as tiny.py)."""
    cfg = tiny_config(method="udml_ss")
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, udml_ss=dataclasses.replace(cfg.model.udml_ss, **udml_ss)))


def flower_photos(species: int, per_species: int) -> list[Path]:
    """The first ``per_species`` photos of the first ``species`` Oxford-Flowers species."""
    folders = sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:species]
    return [photo for folder in folders for photo in sorted(folder.glob("*.jpg"))[:per_species]]


def flower_batch(species: int = 4, per_species: int = 4, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Real photos in the eval view (B, 3, size, size) and their species index (B,)."""
    spec = ViewSpec(img_size=size, mean=(0.5,) * 3, std=(0.5,) * 3, train=False)
    photos = flower_photos(species, per_species)
    images = np.stack([make_view(p.read_bytes(), spec) for p in photos])
    return torch.from_numpy(images), torch.arange(species).repeat_interleave(per_species)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run many times faster on one thread on this shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- model, trainable set


def test_config_validates_and_the_method_config_loads():
    with pytest.raises(ConfigError, match=r"model\.udml_ss\.num_clusters=1 must be >= 2"):
        load_config(overrides=["model.udml_ss.num_clusters=1"])
    with pytest.raises(ConfigError, match=r"model\.udml_ss\.recluster_every=0"):
        load_config(overrides=["model.udml_ss.recluster_every=0"])
    cfg = load_config(REPO / "configs" / "methods" / "udml_ss.yaml")
    u = cfg.model.udml_ss
    assert cfg.model.method == "udml_ss" and (u.num_clusters, u.eta) == (100, 0.1)
    assert (u.ms_alpha, u.ms_beta, u.ms_base, u.ms_epsilon) == (2.0, 50.0, 0.5, 0.1)  # the MS paper's
    demo = load_config(REPO / "configs" / "demo.yaml",
                       ["model.method=udml_ss", "model.udml_ss.num_clusters=50"])
    assert demo.model.udml_ss.num_clusters == 50 and not needs_labels(demo.model.method)


@pytest.mark.parametrize("adapt", [True, False])
def test_trainable_set_is_the_declared_parts_and_gradients_reach_only_them(adapt):
    torch.manual_seed(0)
    cfg = udml_config()
    cfg.model.adapter.enabled = cfg.model.prompt_pool.enabled = adapt
    model = build_model(cfg.model)
    assert isinstance(model, UdmlSsModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {n for n, _ in model.named_parameters()
                if n.startswith(("head.", "rotation_head.")) or (adapt and (
                    ".adapter_" in n or n.startswith("prompt_pool.")))}
    assert trainable == expected
    groups = trainable_parameter_groups(model)
    assert not groups["backbone"] and {id(p) for p in model.rotation_head.parameters()} <= {
        id(p) for p in groups["head"]}
    module = build_method_training(cfg, model, num_classes=0).module.train()
    optimizer = build_optimizer(groups, module.loss, cfg.optim)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    labels = torch.arange(4).repeat(4)
    for step in range(2):  # step 0: zero-init adapter up-projections give the down-projections no grad
        train_step(module, optimizer, tiny_images(16, seed=step), labels, clip_value=1.0)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (name in expected), name
        assert (p.grad is not None) == (name in expected), name


def test_rotate_images_turns_each_image_by_its_own_quarter_turns():
    x = tiny_images(8, size=6)
    turns = draw_rotations(8, torch.Generator().manual_seed(3))
    assert set(turns.tolist()) <= set(range(NUM_ROTATIONS))
    rotated = rotate_images(x, turns)
    for i, k in enumerate(turns.tolist()):
        assert torch.equal(rotated[i], torch.rot90(x[i], k, dims=(-2, -1)))
    back = rotate_images(rotated, (NUM_ROTATIONS - turns) % NUM_ROTATIONS)
    assert torch.equal(back, x)
    with pytest.raises(ValueError, match="square"):
        rotate_images(torch.zeros(2, 3, 4, 6), torch.zeros(2, dtype=torch.long))


def test_metric_loss_sees_only_the_unrotated_images():
    torch.manual_seed(0)
    cfg = udml_config(eta=0.5)
    model = build_model(cfg.model).eval()  # eval: adapters on, no Bernoulli masks, so forwards agree
    module = build_method_training(cfg, model, 0).module
    images, labels = tiny_images(12, seed=1), torch.arange(3).repeat(4)
    out = module(images, labels)
    ms = build_ms_loss(cfg.model.udml_ss, E)
    with torch.no_grad():
        expected_metric = ms(model(images), labels)
        turns = draw_rotations(12, torch.Generator().manual_seed(cfg.train.seed))  # the module's draw
        rotated = rotate_images(images, turns)
        expected_rotation = F.cross_entropy(model.rotation_logits(rotated), turns)
        metric_on_rotated = ms(model(rotated), labels)
    assert turns.unique().numel() > 1
    torch.testing.assert_close(out["metric_loss"], expected_metric, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["rotation_loss"], expected_rotation, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(out["metric_loss"], metric_on_rotated)
    torch.testing.assert_close(out["loss"], expected_metric + 0.5 * expected_rotation + out["aux_loss"],
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- pseudo-labels


def test_kmeans_pseudo_labels_are_faiss_kmeans_and_recomputed_exactly_on_schedule():
    rng = np.random.default_rng(0)
    centres = np.eye(3, 8, dtype=np.float32) * 10  # three well-separated blobs
    calls: list[int] = []

    def embed() -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(calls))
        x = np.repeat(centres, 10, axis=0) + rng.normal(size=(30, 8)).astype(np.float32) * 0.1
        return x, np.array([f"item{i}" for i in range(30)])

    labels = PseudoLabels(num_clusters=3, recluster_every=2, seed=7, niter=10, use_gpu=False)
    seen = []
    for epoch in range(5):
        stats = labels.refresh(epoch, embed)
        seen.append(dict(labels.labels))
        assert stats["pseudo_labels/reclustered"] == float(epoch % 2 == 0)
    assert labels.computed_at == [0, 2, 4] and len(calls) == 3
    assert seen[0] == seen[1] and seen[2] == seen[3]  # kept between re-clusterings
    # the same embeddings -> FAISS k-means with the same seed gives the same assignment
    x, ids = embed()
    kmeans = faiss.Kmeans(8, 3, niter=10, seed=7 + 4, gpu=False)
    kmeans.train(x)
    direct = kmeans.index.search(x, 1)[1][:, 0]
    np.testing.assert_array_equal(kmeans_pseudo_labels(x, 3, seed=11, niter=10, use_gpu=False), direct)
    assert len(np.unique(direct)) == 3
    assert all(len(np.unique(direct[i * 10:(i + 1) * 10])) == 1 for i in range(3))  # one cluster per blob
    expected = [seen[4][i] for i in ("item0", "item15", "item29")]
    np.testing.assert_array_equal(labels.lookup(ids[[0, 15, 29]]), expected)
    with pytest.raises(ValueError, match="'nope' has no pseudo-label"):
        labels.lookup(["nope"])
    with pytest.raises(ValueError, match="num_clusters=50 needs at least 50"):
        kmeans_pseudo_labels(x, 50, seed=0)


def blobs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """30 points in three separated blobs (order shuffled by ``seed``) and their item ids."""
    rng = np.random.default_rng(seed)
    x = np.repeat(np.eye(3, 8, dtype=np.float32) * 10, 10, axis=0)
    x += rng.normal(size=(30, 8)).astype(np.float32)
    return x[rng.permutation(30)], np.array([f"item{i}" for i in range(30)])


def _refresh_on_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One gloo rank: re-cluster with rank-specific embeddings; record calls and labels."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls: list[int] = []

    def embed():
        calls.append(rank)
        return blobs(seed=rank)  # every rank would cluster different data: only rank 0's may count

    labels = PseudoLabels(num_clusters=3, recluster_every=1, seed=0, niter=10, use_gpu=False)
    labels.refresh(0, embed)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"calls": calls, "labels": labels.labels}))
    dist.destroy_process_group()


def test_ranks_train_on_rank_0s_pseudo_labels(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_refresh_on_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [r["calls"] for r in ranks] == [[0], []]  # only rank 0 embeds and clusters
    x, ids = blobs(seed=0)
    clusters = kmeans_pseudo_labels(x, 3, seed=0, niter=10, use_gpu=False)
    expected = dict(zip(ids.tolist(), clusters.tolist(), strict=True))
    assert ranks[0]["labels"] == ranks[1]["labels"] == expected


def test_training_hook_clusters_the_current_model_on_schedule():
    """Epoch 0 clusters backbone features (the paper's start), later epochs the embeddings."""
    torch.manual_seed(0)
    cfg = udml_config(num_clusters=4, recluster_every=2, kmeans_niter=10, kmeans_gpu=False)
    model = build_model(cfg.model)
    training = build_method_training(cfg, model, 0)
    images, _ = flower_batch()
    ids = np.array([f"flowers/{i}" for i in range(len(images))])
    batches = [{"image": images[i:i + 8].numpy(), "item_id": ids[i:i + 8]} for i in (0, 8)]
    requested: list[int] = []

    def train_eval_batches():
        requested.append(1)
        return iter(batches)

    stats = [training.on_epoch_start(e, model, torch.device("cpu"), train_eval_batches) for e in range(5)]
    assert len(requested) == 3 and training.pseudo_labels.computed_at == [0, 2, 4]
    assert [s["pseudo_labels/reclustered"] for s in stats] == [1, 0, 1, 0, 1]
    assert model.training  # back in training mode after embedding
    model.eval()
    with torch.no_grad():
        embeddings = model(images).numpy()
    expected = kmeans_pseudo_labels(embeddings, 4, seed=cfg.train.seed + 4, niter=10, use_gpu=False)
    np.testing.assert_array_equal(training.batch_labels({"item_id": ids}), expected)


# ----------------------------------------------------------------------------- rotation loss on real photos


def rotation_loss_all_turns(model: UdmlSsModel, images: torch.Tensor) -> float:
    """Mean rotation cross-entropy over all four turns of every image (eval mode)."""
    model.eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model.rotation_logits(torch.rot90(images, k, dims=(-2, -1))),
                                    torch.full((len(images),), k)) for k in range(NUM_ROTATIONS))
    model.train()
    return float(total) / NUM_ROTATIONS


def test_rotation_loss_falls_on_real_flower_photos():
    torch.manual_seed(0)
    cfg = udml_config(eta=1.0)
    cfg.model.adapter.keep_prob = 1.0  # static adapters: the few steps are not spent on dropout noise
    cfg.optim.lr = 3e-4
    model = build_model(cfg.model)
    module = build_method_training(cfg, model, 0).module.train()
    optimizer = build_optimizer(trainable_parameter_groups(model), module.loss, cfg.optim)
    photos, species = flower_batch(species=4, per_species=4)  # 16 real photos, pseudo-labels = species
    images, labels = photos.repeat(4, 1, 1, 1), species.repeat(4)  # each photo drawn 4 times a step
    before = rotation_loss_all_turns(model, photos)
    steps = [train_step(module, optimizer, images, labels, clip_value=1.0)["rotation_loss"]
             for _ in range(60)]
    after = rotation_loss_all_turns(model, photos)
    print(f"rotation loss (all 4 turns): {before:.3f} -> {after:.3f}; per-step first 5 "
          f"{np.mean(steps[:5]):.3f}, last 5 {np.mean(steps[-5:]):.3f}")
    assert before > 1.3  # ~ln 4 at the start
    assert after < 0.8 * before and np.mean(steps[-5:]) < 0.85 * np.mean(steps[:5])


# ----------------------------------------------------------------------------- unlabeled catalogue


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> str:
    """24 real flower photos in one folder (no class folders, no labels), prepared at class depth 0."""
    root = tmp_path_factory.mktemp("catalogue")
    for photo in flower_photos(species=3, per_species=8):
        shutil.copy(photo, root / f"{photo.parent.name}-{photo.name}")
    out = str(tmp_path_factory.mktemp("prepared-catalogue"))
    prepare([SourceSpec("folder", "catalogue", str(root), class_depth=0)], out, log=lambda _: None)
    return out


def test_unlabeled_catalogue_is_prepared_without_labels(catalogue):
    manifest = load_manifest(catalogue)
    info = manifest.datasets["catalogue"]
    assert not schema.is_labeled(info) and info["num_classes"] == 0 and info["classes"] == []
    assert info["counts"]["train"] == {"images": 24, "classes": 0}
    assert manifest.shard_uris("test") == []
    labels = pq.read_table(manifest.shard_uris("train")[0]).column(schema.LABEL).to_pylist()
    assert labels == [schema.UNLABELED] * 24
    assert label_range(manifest, "catalogue", "train") == range(-1, 0)
    assert not label_range(manifest, "catalogue", "test")
    assert not label_range(manifest, "catalogue", "val", 0.5)
    assert global_label_map(manifest) == {} and unlabeled_datasets(manifest) == ["catalogue"]


def run_config(data_uri: str, storage_path: str, method: str) -> Config:
    model = {"method": method, "backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
             "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": E},
             "udml_ss": {"num_clusters": 3, "recluster_every": 1, "kmeans_niter": 10}}
    data = to_dict(Config())
    data.update(model=model)
    data["data"].update(uri=data_uri, preset="", decode_batch_size=8)
    data["train"].update(epochs=2, batch_size=8, max_steps_per_epoch=2, cpus_per_worker=0.5,
                         storage_path=storage_path, run_name=method, eval_every=1)
    return from_dict(data)


def test_unlabeled_catalogue_trains_with_udml_ss_and_a_supervised_method_refuses_it(
        ray_cluster, catalogue, tmp_path, capsys):
    from puma.train.driver import run_training

    with pytest.raises(ConfigError, match=r"model.method='puma' trains on labels, but dataset\(s\) "
                                          r"\['catalogue'\].*have none"):
        run_training(run_config(catalogue, str(tmp_path / "runs"), "puma"))
    outcome = run_training(run_config(catalogue, str(tmp_path / "runs"), "udml_ss"))
    assert "training-time evaluation skipped: no labeled test classes" in capsys.readouterr().out
    meta = json.loads((Path(outcome.last_checkpoint) / "meta.json").read_text())
    history = meta["run_state"]["history"]
    assert [h["epoch"] for h in history] == [1, 2]
    assert [h["pseudo_labels/reclustered"] for h in history] == [1.0, 1.0]  # epochs 0 and 1 (every 1)
    assert all(h["pseudo_labels/items"] == 24 and 1 <= h["pseudo_labels/clusters"] <= 3 for h in history)
    assert all(h["train/steps"] == 2 and np.isfinite(h["train/rotation_loss"]) for h in history)
    assert outcome.best_checkpoint == outcome.last_checkpoint  # nothing evaluated: the last one is kept
    assert [k for k in meta["metrics"] if k.endswith("r@1")] == ["best/harmonic/r@1"]  # no evaluation
    from puma.checkpoint import load_model

    model, _ = load_model(outcome.last_checkpoint)
    assert isinstance(model, UdmlSsModel)


@pytest.mark.gpu
def test_udml_ss_step_on_cuda_with_bf16_autocast_and_gpu_kmeans():
    """The GPU path: rotations and losses on the device under autocast, FAISS k-means on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    cfg = udml_config()
    device = torch.device("cuda")
    model = build_model(cfg.model).to(device)
    module = build_method_training(cfg, model, 0).module.train()
    optimizer = build_optimizer(trainable_parameter_groups(model), module.loss, cfg.optim)
    images, labels = tiny_images(16).to(device), torch.arange(4).repeat(4).to(device)
    out = train_step(module, optimizer, images, labels, clip_value=1.0, precision="bf16")
    assert all(np.isfinite(v) for v in out.values())
    x = np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32)
    if faiss.get_num_gpus() > 0:
        assert len(np.unique(kmeans_pseudo_labels(x, 10, seed=0, use_gpu=True))) == 10
