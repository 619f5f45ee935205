"""Retrieval metrics and exact kNN: hand-computed examples, pytorch-metric-learning parity, protocols."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import FaissKNN

from puma.eval import (
    RetrievalInputError,
    evaluate_embeddings,
    harmonic_mean,
    iter_knn,
    knn_search,
    retrieval_metrics,
)

KS = (1, 2, 4)


def on_circle(degrees: list[float]) -> np.ndarray:
    """Unit 2-D vectors at the given angles: inner product ranks by angular distance."""
    rad = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(rad), np.sin(rad)], axis=1).astype(np.float32)  # (N, 2)


def random_set(n: int, dim: int, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((n, dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    labels = rng.integers(0, num_classes, n).astype(np.int64)  # uneven class sizes, some lone
    return emb, labels


def brute_force_metrics(q, ql, g, gl, self_index, ks) -> dict[str, float]:
    """Reference: full similarity matrix, full sort, per-query Python loop over the definitions."""
    sim = q.astype(np.float64) @ g.astype(np.float64).T  # (Q, G)
    per_query: dict[str, list[float]] = {f"r@{k}": [] for k in ks} | {"map@r": [], "rp": []}
    for i in range(len(q)):
        order = [j for j in np.argsort(-sim[i], kind="stable") if j != self_index[i]]
        rel = [gl[j] == ql[i] for j in order]
        r = sum(rel)
        if r == 0:
            continue
        for k in ks:
            per_query[f"r@{k}"].append(float(any(rel[:k])))
        per_query["rp"].append(sum(rel[:r]) / r)
        hits = np.cumsum(rel[:r])
        per_query["map@r"].append(sum(hits[i] / (i + 1) for i in range(r) if rel[i]) / r)
    return {key: float(np.mean(values)) for key, values in per_query.items()}


def section(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {key.split("/", 1)[1]: value for key, value in metrics.items() if key.startswith(prefix + "/")}


def pml_metrics(q, ql, g=None, gl=None) -> dict[str, float]:
    calc = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r", "r_precision"),
        k="max_bin_count",
        device=torch.device("cpu"),
        knn_func=FaissKNN(index_init_fn=faiss.IndexFlatIP),
    )
    acc = calc.get_accuracy(q, ql) if g is None else calc.get_accuracy(q, ql, g, gl, ref_includes_query=False)
    names = {"r@1": "precision_at_1", "map@r": "mean_average_precision_at_r", "rp": "r_precision"}
    return {ours: acc[theirs] for ours, theirs in names.items()}


# ----------------------------------------------------------------------------- hand-computed examples


def test_query_gallery_hand_computed():
    # Gallery at 10..50 degrees, labels [1, 0, 1, 0, 0].
    #   A (label 0, at 0 deg):  ranked labels 1,0,1,0,0  R=3  R@1=0 R@2=1  RP=1/3  MAP@R=(1/2)/3=1/6
    #   B (label 1, at 0 deg):  ranked labels 1,0,1,0,0  R=2  R@1=1        RP=1/2  MAP@R=(1/1)/2=1/2
    #   C (label 2): R=0, no relevant item -> left out of every metric
    #   D (label 0, at 55 deg): ranked labels 0,0,1,0,1  R=3  R@1=1        RP=2/3  MAP@R=(1+1)/3=2/3
    gallery, gallery_labels = on_circle([10, 20, 30, 40, 50]), np.array([1, 0, 1, 0, 0])
    query, query_labels = on_circle([0, 0, 0, 55]), np.array([0, 1, 2, 0])
    got = retrieval_metrics(query, query_labels, gallery, gallery_labels, ks=KS)
    want = {"r@1": 2 / 3, "r@2": 1.0, "r@4": 1.0, "rp": (1 / 3 + 1 / 2 + 2 / 3) / 3, "map@r": 4 / 9}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_self_excluded_hand_computed():
    # Items at 0, 10, 30, 65, 110 degrees, labels [0, 0, 1, 1, 0]; each queries the other four.
    #   item 0: ranked labels 0,1,1,0  R=2  R@1=1 R@2=1 R@4=1  RP=1/2  MAP@R=1/2
    #   item 1: ranked labels 0,1,1,0  R=2  R@1=1 R@2=1 R@4=1  RP=1/2  MAP@R=1/2
    #   item 2: ranked labels 0,0,1,0  R=1  R@1=0 R@2=0 R@4=1  RP=0    MAP@R=0
    #   item 3: ranked labels 1,0,0,0  R=1  R@1=1 R@2=1 R@4=1  RP=1    MAP@R=1
    #   item 4: ranked labels 1,1,0,0  R=2  R@1=0 R@2=0 R@4=1  RP=0    MAP@R=0
    emb, labels = on_circle([0, 10, 30, 65, 110]), np.array([0, 0, 1, 1, 0])
    got = retrieval_metrics(emb, labels, emb, labels, ks=KS, exclude_self=True)
    want = {"r@1": 3 / 5, "r@2": 3 / 5, "r@4": 1.0, "rp": 2 / 5, "map@r": 2 / 5}
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_recall_at_k_beyond_gallery_size():
    # 3 items, k=8 > 2 others: R@8 is "any relevant item anywhere" = 1 for every non-lone query.
    emb, labels = on_circle([0, 10, 90]), np.array([0, 1, 0])
    got = retrieval_metrics(emb, labels, emb, labels, ks=(1, 8), exclude_self=True)
    assert got["r@1"] == 0.0 and got["r@8"] == 1.0  # items 0 and 2 (item 1 is lone)


# ----------------------------------------------------------------------------- pytorch-metric-learning parity


def test_equals_pml_self_excluded():
    emb, labels = random_set(400, 16, 60, seed=0)
    ours = retrieval_metrics(emb, labels, emb, labels, ks=(1,), exclude_self=True, chunk=64)
    theirs = pml_metrics(emb, labels)
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-9), key
    assert 0.0 < ours["map@r"] < ours["rp"] < 1.0  # not a degenerate case


def test_equals_pml_query_gallery():
    query, query_labels = random_set(150, 16, 40, seed=1)  # some query labels absent from the gallery
    gallery, gallery_labels = random_set(500, 16, 35, seed=2)
    ours = retrieval_metrics(query, query_labels, gallery, gallery_labels, ks=(1,), chunk=32)
    theirs = pml_metrics(query, query_labels, gallery, gallery_labels)
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-9), key


def test_recall_at_k_equals_brute_force():
    emb, labels = random_set(300, 8, 30, seed=3)
    ours = retrieval_metrics(emb, labels, emb, labels, ks=(1, 2, 4, 8, 16), exclude_self=True, chunk=50)
    ref = brute_force_metrics(emb, labels, emb, labels, np.arange(len(emb)), (1, 2, 4, 8, 16))
    for key in ref:
        assert ours[key] == pytest.approx(ref[key], abs=1e-9), key
    assert ours["r@1"] < ours["r@4"] < ours["r@16"]


# ----------------------------------------------------------------------------- kNN


def test_knn_is_exact_and_chunking_changes_nothing():
    query, _ = random_set(257, 12, 5, seed=4)
    gallery, _ = random_set(300, 12, 5, seed=5)
    scores, indices = knn_search(query, gallery, 10, chunk=10_000)
    assert scores.shape == indices.shape == (257, 10)
    assert scores.dtype == np.float32 and indices.dtype == np.int64
    want = np.argsort(-(query.astype(np.float64) @ gallery.astype(np.float64).T), axis=1)[:, :10]
    np.testing.assert_array_equal(indices, want)
    for chunk in (1, 7, 256):
        chunked_scores, chunked_indices = knn_search(query, gallery, 10, chunk=chunk)
        np.testing.assert_array_equal(chunked_indices, indices)
        np.testing.assert_array_equal(chunked_scores, scores)


def test_iter_knn_yields_bounded_chunks():
    emb, _ = random_set(100, 4, 3, seed=6)
    sizes = [(start, len(idx)) for start, _, idx in iter_knn(emb, emb, 3, chunk=32)]
    assert sizes == [(0, 32), (32, 32), (64, 32), (96, 4)]


def test_chunked_metrics_equal_unchunked():
    emb, labels = random_set(333, 8, 25, seed=7)
    whole = retrieval_metrics(emb, labels, emb, labels, exclude_self=True, chunk=4096)
    for chunk in (1, 10, 100):
        chunked = retrieval_metrics(emb, labels, emb, labels, exclude_self=True, chunk=chunk)
        assert chunked == pytest.approx(whole, abs=1e-12)


def test_self_exclusion_by_index_with_duplicates():
    # Items 0 and 1 are identical: each must find the other, never itself.
    emb = on_circle([0, 0, 90])
    _, indices = knn_search(emb, emb, 1, exclude_self=True)
    np.testing.assert_array_equal(indices[:2, 0], [1, 0])  # item 2 ties between 0 and 1
    # Ten identical rows: ties may push the query itself out of its k+1; it is still never returned.
    same = np.tile(on_circle([30]), (10, 1))
    scores, indices = knn_search(same, same, 2, exclude_self=True, chunk=3)
    assert (indices != np.arange(10)[:, None]).all()
    assert (indices[:, 0] != indices[:, 1]).all()
    np.testing.assert_allclose(scores, 1.0, atol=1e-6)


# ----------------------------------------------------------------------------- evaluate_embeddings


def test_unified_never_matches_same_number_from_another_dataset():
    # Dataset b is dataset a rotated by 5 degrees with the same label numbers: in the pool each
    # image's nearest neighbour is its twin from the other dataset, same number, different class.
    emb = on_circle([0, 40, 90, 130, 5, 45, 95, 135])
    labels = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    datasets = np.array(["a"] * 4 + ["b"] * 4)
    got = evaluate_embeddings(emb, labels, datasets, np.array(["gallery"] * 8), ks=(1,))
    assert got["a/r@1"] == 1.0 and got["b/r@1"] == 1.0
    assert got["unified/r@1"] == 0.0 and got["unified/map@r"] == 0.0
    colliding = retrieval_metrics(emb, labels, emb, labels, ks=(1,), exclude_self=True)
    assert colliding["r@1"] == 1.0  # what raw label numbers (the released code's bug) would report


def test_evaluate_embeddings_protocols_and_harmonic():
    cub, cub_labels = random_set(120, 8, 12, seed=8)
    shop, shop_labels = random_set(160, 8, 20, seed=9)
    shop_roles = np.where(np.arange(160) < 60, "query", "gallery")
    emb = np.concatenate([cub, shop])
    labels = np.concatenate([cub_labels, shop_labels])
    datasets = np.array(["cub"] * 120 + ["inshop"] * 160)
    roles = np.concatenate([np.full(120, "gallery"), shop_roles])
    got = evaluate_embeddings(emb, labels, datasets, roles, ks=(1, 2), chunk=25)

    cub_ref = retrieval_metrics(cub, cub_labels, cub, cub_labels, ks=(1, 2), exclude_self=True)
    q, g = shop_roles == "query", shop_roles == "gallery"
    shop_ref = retrieval_metrics(shop[q], shop_labels[q], shop[g], shop_labels[g], ks=(1, 2))
    assert section(got, "cub") == pytest.approx(cub_ref, abs=1e-12)
    assert section(got, "inshop") == pytest.approx(shop_ref, abs=1e-12)

    # Unified: queries = all CUB + In-Shop queries; gallery = all CUB + In-Shop gallery; keyed labels.
    keyed = np.concatenate([cub_labels, shop_labels + 1000])
    is_q = np.concatenate([np.ones(120, bool), q])
    is_g = np.concatenate([np.ones(120, bool), g])
    self_index = np.concatenate([np.arange(120), np.full(60, -1)])
    unified_ref = brute_force_metrics(emb[is_q], keyed[is_q], emb[is_g], keyed[is_g], self_index, (1, 2))
    for key in unified_ref:
        assert got[f"unified/{key}"] == pytest.approx(unified_ref[key], abs=1e-9), key

    r1 = [cub_ref["r@1"], shop_ref["r@1"]]
    assert cub_ref["r@1"] != shop_ref["r@1"]
    assert got["harmonic/r@1"] == pytest.approx(2 / (1 / r1[0] + 1 / r1[1]))


def test_harmonic_mean():
    assert harmonic_mean([0.5, 1.0]) == pytest.approx(2 / 3)
    assert harmonic_mean([0.25, 0.25, 0.25]) == pytest.approx(0.25)
    assert harmonic_mean([0.9, 0.0]) == 0.0
    with pytest.raises(RetrievalInputError):
        harmonic_mean([])


# ----------------------------------------------------------------------------- input errors


def test_clear_errors():
    emb, labels = random_set(20, 4, 3, seed=10)
    with pytest.raises(RetrievalInputError, match=r"shape \(20,\)"):
        retrieval_metrics(emb, labels[:-1], emb, labels)
    with pytest.raises(RetrievalInputError, match="non-empty"):
        retrieval_metrics(emb[:0], labels[:0], emb, labels)
    bad = emb.copy()
    bad[3, 1] = np.nan
    with pytest.raises(RetrievalInputError, match="1 row"):
        retrieval_metrics(bad, labels, emb, labels)
    with pytest.raises(RetrievalInputError, match="integers"):
        retrieval_metrics(emb, labels.astype(np.float32), emb, labels)
    with pytest.raises(RetrievalInputError, match="query dim"):
        retrieval_metrics(emb, labels, emb[:, :3], labels)
    with pytest.raises(RetrievalInputError, match="ks"):
        retrieval_metrics(emb, labels, emb, labels, ks=(0,))
    with pytest.raises(RetrievalInputError, match="same set"):
        retrieval_metrics(emb, labels, emb[::-1], labels[::-1], exclude_self=True)
    with pytest.raises(RetrievalInputError, match="none of the 20 queries"):
        retrieval_metrics(emb, labels, emb, labels + 10)
    with pytest.raises(RetrievalInputError, match="chunk"):
        retrieval_metrics(emb, labels, emb, labels, chunk=0)
    with pytest.raises(RetrievalInputError, match="k must be"):
        knn_search(emb, emb, 20, exclude_self=True)


def test_evaluate_embeddings_errors():
    emb, labels = random_set(6, 4, 3, seed=11)
    names = np.array(["a"] * 6)
    with pytest.raises(RetrievalInputError, match="unknown roles"):
        evaluate_embeddings(emb, labels, names, np.array(["test"] * 6))
    with pytest.raises(RetrievalInputError, match="reserved"):
        evaluate_embeddings(emb, labels, np.array(["unified"] * 6), np.array(["gallery"] * 6))
    with pytest.raises(RetrievalInputError, match="mixes role 'train'"):
        evaluate_embeddings(emb, labels, names, np.array(["query", "gallery", "train"] * 2))
    with pytest.raises(RetrievalInputError, match="dataset 'a'"):
        evaluate_embeddings(emb, np.arange(6), names, np.array(["gallery"] * 6))
    with pytest.raises(RetrievalInputError, match=r"datasets must have shape \(6,\)"):
        evaluate_embeddings(emb, labels, names[:5], np.array(["gallery"] * 6))
