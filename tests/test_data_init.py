"""The data-driven start: PCA head, centroid proxies, the prompt pool's centre and keys, the same on
two workers as on one, and the methods that refuse it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from test_train_job import tiny_config as job_config
from test_train_job import tiny_data  # noqa: F401 (fixture)
from tiny import tiny_model_config

from puma.checkpoint import read_checkpoint
from puma.config import ConfigError, LossConfig
from puma.losses import build_loss
from puma.methods import build_model, load_config
from puma.models.head import EmbeddingHead, FeatureMoments
from puma.models.prompt_pool import PromptPool
from puma.models.puma_model import patch_query
from puma.models.trainable import count_trainable
from puma.train.data_init import init_from_data, init_pool_from_data, needs_data_init


def _features(n: int = 400, dim: int = 12, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=gen)
    return torch.randn(n, dim, generator=gen) @ mixing + 5.0  # anisotropic, far from the origin


def test_moments_of_two_halves_add_up_to_the_whole():
    x = _features()
    whole, a, b = FeatureMoments(12), FeatureMoments(12), FeatureMoments(12)
    whole.add(x)
    a.add(x[:150])
    b.add(x[150:])
    for ta, tb, tw in zip(a.tensors(), b.tensors(), whole.tensors(), strict=True):
        ta += tb  # what the all-reduce does
        torch.testing.assert_close(ta, tw)
    mean, cov = a.mean_cov()
    np.testing.assert_allclose(cov.numpy(), np.cov(x.double().numpy(), rowvar=False, bias=True), atol=1e-9)
    np.testing.assert_allclose(mean.numpy(), x.double().mean(0).numpy(), atol=1e-12)


def test_pca_head_projects_centred_features_onto_the_top_principal_directions():
    x = _features()
    moments = FeatureMoments(12)
    moments.add(x)
    head = EmbeddingHead(12, 4)
    head.init_from_features(*moments.mean_cov())
    with torch.no_grad():
        y = head.proj(x).double()  # (N, 4) before normalisation
    assert y.mean(0).abs().max() < 1e-4  # centred
    weight = head.proj.weight.detach().double()
    torch.testing.assert_close(weight @ weight.T, torch.eye(4, dtype=torch.float64), atol=1e-6, rtol=0)
    eigvals = np.linalg.eigvalsh(np.cov(x.double().numpy(), rowvar=False, bias=True))[::-1]
    np.testing.assert_allclose(y.var(0, unbiased=False).numpy(), eigvals[:4], rtol=1e-4)  # top 4, in order
    with pytest.raises(ValueError, match="feature statistics"):
        head.init_from_features(torch.zeros(5), torch.eye(5))


def test_centroid_proxies_point_at_class_means_and_absent_classes_keep_theirs():
    loss = build_loss(LossConfig(), num_classes=4, embed_dim=6)
    before = loss.loss.W.detach().clone()  # (E, C)
    centroids = torch.randn(4, 6)
    counts = torch.tensor([3.0, 0.0, 1.0, 2.0])
    assert loss.init_proxies(centroids, counts) == 3
    after = loss.loss.W.detach()
    cos = F.cosine_similarity(after.T, centroids, dim=1)
    torch.testing.assert_close(cos[[0, 2, 3]], torch.ones(3), atol=1e-6, rtol=0)
    assert torch.equal(after[:, 1], before[:, 1])
    torch.testing.assert_close(after.norm(dim=0)[[0, 2, 3]].mean(), before.norm(dim=0).mean(), atol=1e-5,
                               rtol=0)  # the proxies' scale (and so Adam's relative step) is kept


def test_init_from_data_starts_the_loss_at_the_class_centroids():
    torch.manual_seed(0)
    model = build_model(tiny_model_config())
    loss = build_loss(LossConfig(), num_classes=3, embed_dim=16)
    images, labels = torch.randn(24, 3, 32, 32), torch.arange(24) % 3
    batches = [{"image": images[i:i + 8].numpy(), "label": labels[i:i + 8].numpy()} for i in range(0, 24, 8)]
    random_start = loss(model(images), labels).item()
    done = init_from_data(model, loss, batches, torch.device("cpu"), lambda b: b["label"], head=True,
                          proxies=True)
    assert done == {"init/images": 24.0, "init/proxies": 3.0}
    model.eval()
    with torch.no_grad():
        emb = model(images)  # eval: the adapters are no-ops at init, as in the init pass
    for c in range(3):
        centroid = F.normalize(emb[labels == c].mean(0), dim=0)
        assert F.cosine_similarity(centroid, loss.loss.W[:, c].detach(), dim=0) > 0.999
    loss.eval()
    assert loss(emb, labels).item() < random_start


def _nearly_parallel_queries(n: int = 300, dim: int = 32, seed: int = 0) -> torch.Tensor:
    """Queries as the backbone's patch queries are: a large shared part plus small image-specific ones."""
    gen = torch.Generator().manual_seed(seed)
    return 10.0 * torch.randn(dim, generator=gen) + torch.randn(n, dim, generator=gen) @ torch.randn(dim, dim,
                                                                                                   generator=gen)


def test_centred_pool_from_the_queries_gives_each_image_its_own_weights():
    queries = _nearly_parallel_queries()
    torch.manual_seed(0)
    paper = PromptPool(32, pool_size=6, length=2)  # random keys, raw queries
    spread = paper.weights(queries).std(0).mean()  # over images: 0.08, nearly the same alpha for each
    torch.manual_seed(0)
    pool = PromptPool(32, pool_size=6, length=2, centred=True)
    assert torch.equal(pool.centre, torch.zeros(32))  # the paper's alpha until initialised
    torch.testing.assert_close(pool.weights(queries), paper.weights(queries))
    moments = FeatureMoments(32)
    moments.add(queries)
    pool.init_from_queries(*moments.mean_cov())
    torch.testing.assert_close(pool.centre.detach().double(), queries.double().mean(0), atol=1e-5, rtol=0)
    keys = pool.keys.detach().double()  # (6, 32): orthonormal, the top principal directions in order
    torch.testing.assert_close(keys @ keys.T, torch.eye(6, dtype=torch.float64), atol=1e-6, rtol=0)
    variance = ((queries.double() - queries.double().mean(0)) @ keys.T).var(0)
    eigvals = torch.linalg.eigvalsh(torch.cov(queries.double().T, correction=0)).flip(0)
    torch.testing.assert_close(variance, eigvals[:6], rtol=1e-2, atol=0)  # float32 keys
    assert pool.weights(queries).std(0).mean() > 3 * spread  # 0.28: alpha differs from image to image
    assert pool.ortho_loss().item() == pytest.approx(paper.ortho_loss().item(), abs=1e-5)  # still orthonormal
    with pytest.raises(ValueError, match="centred=True"):
        paper.init_from_queries(*moments.mean_cov())


def test_init_pool_from_data_centres_on_the_mean_patch_query_and_adds_one_vector():
    torch.manual_seed(0)
    paper = build_model(tiny_model_config())
    model = build_model(tiny_model_config(prompt_pool={"init": "data"}))
    assert count_trainable(model) == count_trainable(paper) + model.num_features  # the centre c
    images = torch.randn(24, 3, 32, 32)
    batches = [{"image": images[i:i + 8].numpy()} for i in range(0, 24, 8)]
    assert init_pool_from_data(model, batches, torch.device("cpu")) == {"init/pool_queries": 24.0}
    with torch.no_grad():
        mean_query = patch_query(model.backbone.patch_embed(images)).mean(0)
    torch.testing.assert_close(model.prompt_pool.centre.detach(), mean_query, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="centred prompt pool"):
        init_pool_from_data(paper, batches, torch.device("cpu"))
    cfg = load_config(None, ["model.prompt_pool.init=data"])
    assert needs_data_init(cfg)
    assert not needs_data_init(load_config(None, ["model.prompt_pool.init=data",
                                                  "model.prompt_pool.enabled=false"]))
    with pytest.raises(ConfigError, match="model.prompt_pool.init"):
        load_config(None, ["model.prompt_pool.init=pca"])


def test_loss_and_methods_that_cannot_take_a_data_start_refuse_it_at_load():
    with pytest.raises(ConfigError, match="one learned proxy per class"):
        LossConfig(name="softtriple", proxy_init="centroids")
    with pytest.raises(ConfigError, match="linear embedding head"):
        load_config(None, ["model.method=mlp3", "model.head.init=pca"])
    with pytest.raises(ConfigError, match="proxy_init"):
        load_config(None, ["model.method=vptsp_g", "loss.name=proxy_anchor", "loss.proxy_init=centroids"])
    with pytest.raises(ConfigError, match="head.init"):
        load_config(None, ["model.method=udml_ss", "model.head.init=pca"])


@pytest.mark.budget(120)  # two tiny fits (one and two workers) with their data init (33-57 s)
def test_two_worker_run_starts_from_the_same_head_and_proxies_as_one_process(ray_cluster, tiny_data,  # noqa: F811
                                                                            tmp_path):
    """run_training, 2 workers, no step: the checkpoint holds the prompt pool, head and proxies of the
    data init, equal to the single-process init over all training images (statistics summed over
    ranks)."""
    from puma.data.images import eval_view_spec, make_view
    from puma.data.manifest import load_manifest
    from puma.data.splits import global_label_map
    from puma.train.driver import run_training

    path = job_config(tmp_path / "tiny.yaml", tiny_data, str(tmp_path / "runs"), epochs=1)
    data = yaml.safe_load(path.read_text())
    data["model"]["head"]["init"] = "pca"
    data["model"].setdefault("prompt_pool", {})["init"] = "data"
    data["loss"] = {"proxy_init": "centroids"}
    data["train"].update(num_workers=2, cpus_per_worker=0.25, max_steps_per_epoch=0, eval_every=0)
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    ckpt = read_checkpoint(run_training(cfg).last_checkpoint)

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)  # the workers' model before the init, as built on every rank
    manifest = load_manifest(tiny_data)
    label_map = global_label_map(manifest)
    loss = build_loss(cfg.loss, len(label_map), cfg.model.head.embed_dim)
    rows = _train_rows(tiny_data, manifest, label_map)
    spec = eval_view_spec(cfg)
    batches = [{"image": np.stack([make_view(b, spec) for b in rows["image"]]), "label": rows["label"]}]
    init_pool_from_data(model, batches, torch.device("cpu"))
    init_from_data(model, loss, batches, torch.device("cpu"), lambda b: b["label"], head=True, proxies=True)
    for key in ("prompt_pool.centre", "prompt_pool.keys", "head.proj.weight", "head.proj.bias"):
        torch.testing.assert_close(ckpt.model[key], model.state_dict()[key], atol=1e-4, rtol=1e-4, msg=key)
    torch.testing.assert_close(ckpt.loss["loss.W"], loss.state_dict()["loss.W"], atol=1e-4, rtol=1e-4)


def _train_rows(uri: str, manifest, label_map) -> dict:
    """Image bytes and global labels of every training row of a prepared dataset."""
    import pyarrow.parquet as pq

    images, labels = [], []
    for shard in manifest.shard_uris("train"):
        for row in pq.read_table(shard, columns=["dataset", "label", "image"]).to_pylist():
            if (row["dataset"], row["label"]) in label_map:
                images.append(row["image"])
                labels.append(label_map[(row["dataset"], row["label"])])
    return {"image": images, "label": np.array(labels)}
