"""ONNX export: every method's eval-mode model in ONNX Runtime gives PyTorch's embeddings of real photos
(cosine >= 0.9999 per image), the file carries the model id and view, and the standalone example in
docs/examples/onnx_embed.py (onnxruntime, numpy and Pillow only) embeds like the project does."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from tiny import make_checkpoint, reference_embeddings

import jobs.export
from puma.checkpoint import checkpoint_id
from puma.export import ExportError, embed, export_onnx, metadata, quantize_int8, session
from puma.methods import METHODS

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
EXAMPLE = REPO / "docs" / "examples" / "onnx_embed.py"
SMALL_VPTSP_G = {"prompt_length": 3, "class_prompt_layers": 2, "class_prompt_length": 2}
METHOD_OPTIONS = {"vptsp_g": {"vptsp_g": SMALL_VPTSP_G}}


def photos(n: int = 6) -> list[Path]:
    return sorted(FLOWERS.glob("*/*.jpg"))[::97][:n]


def refs(paths: list[Path]) -> pa.Table:
    return pa.table({"image_uri": [str(p) for p in paths], "image_row": [-1] * len(paths)})


def views(checkpoint: str, paths: list[Path]) -> np.ndarray:
    """The project's eval views of the photos (what the embed job feeds its model)."""
    from puma.checkpoint import load_model
    from puma.data.images import eval_view_spec, make_view

    _, cfg = load_model(checkpoint)
    spec = eval_view_spec(cfg)
    return np.stack([make_view(p.read_bytes(), spec) for p in paths])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_exports_with_parity_on_real_photos(tmp_path, method):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), seed=1, method=method, **METHOD_OPTIONS.get(method, {}))
    out = tmp_path / "model.onnx"
    report = export_onnx(ckpt, str(out))
    assert report.parity_min_cosine >= 0.9999 and report.method == method
    assert out.stat().st_size == report.bytes
    sess = session(out.read_bytes())
    paths = photos()
    got = embed(sess, views(ckpt, paths))  # (N, E): ONNX Runtime on the project's eval views
    want = reference_embeddings(ckpt, refs(paths))  # (N, E): PyTorch
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, (method, cos)
    assert embed(sess, views(ckpt, paths[:1])).shape == (1, want.shape[1])  # any batch size
    meta = metadata(sess)
    assert meta["puma.model_id"] == checkpoint_id(ckpt) and meta["puma.method"] == method
    assert int(meta["puma.embed_dim"]) == want.shape[1] and int(meta["puma.img_size"]) == 32


def test_the_standalone_example_needs_only_onnxruntime_numpy_pillow_and_embeds_like_the_project(tmp_path):
    imports = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.Import):
            imports |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imports.add(node.module.split(".")[0])
    assert imports <= {"json", "sys", "numpy", "onnxruntime", "PIL"}, imports
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), seed=2)
    export_onnx(ckpt, str(tmp_path / "model.onnx"))
    paths = photos(5)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}  # no PYTHONPATH: not the project's
    argv = [sys.executable, "-I", str(EXAMPLE), str(tmp_path / "model.onnx"), *map(str, paths)]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.load(tmp_path / "embeddings.npy")
    want = reference_embeddings(ckpt, refs(paths))
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert got.shape == want.shape and cos.min() >= 0.9999, cos
    assert f"5 embeddings of size {want.shape[1]}" in proc.stdout


def test_the_int8_copy_keeps_the_metadata_is_smaller_and_embeds_real_photos_like_fp32(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), seed=1)
    export_onnx(ckpt, str(tmp_path / "model.onnx"))
    fp32 = (tmp_path / "model.onnx").read_bytes()
    int8 = quantize_int8(fp32)
    sess8, sess32 = session(int8), session(fp32)
    meta8, meta32 = metadata(sess8), metadata(sess32)
    assert meta32["puma.precision"] == "fp32" and meta8["puma.precision"] == "int8"
    assert {k: v for k, v in meta8.items() if k.startswith("puma.") and k != "puma.precision"} == \
        {k: v for k, v in meta32.items() if k.startswith("puma.") and k != "puma.precision"}
    assert len(int8) < 0.6 * len(fp32)  # measured 149 kB vs 318 kB for the tiny model
    v = views(ckpt, photos(12))
    got, want = embed(sess8, v), embed(sess32, v)  # (12, E) each
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.995, cos  # 0.9991-0.9996, seeds 0-3, AVX2-only EPYC (8-bit: 0.89)
    assert cos.max() < 1 - 1e-7, cos  # the weights really changed


def test_the_export_job_writes_and_refuses_without_out(tmp_path, capsys):
    job = jobs.export
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    assert job.main(["--checkpoint", ckpt]) == 2 and "--out" in capsys.readouterr().err
    assert job.main(["--checkpoint", ckpt, "--out", str(tmp_path / "m.onnx")]) == 0
    assert "min cosine" in capsys.readouterr().out and (tmp_path / "m.onnx").exists()
    assert job.main(["--checkpoint", ckpt, "--out", str(tmp_path / "q.onnx"), "--int8"]) == 0
    assert "min cosine to fp32" in capsys.readouterr().out and (tmp_path / "q.int8.onnx").exists()


def test_an_export_onnx_runtime_disagrees_with_is_refused(tmp_path, monkeypatch):
    import puma.export as export

    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.setattr(export, "parity", lambda *a: 0.5)  # failure injection: a broken conversion
    with pytest.raises(ExportError, match="cosine 0.500000 to PyTorch"):
        export_onnx(ckpt, str(tmp_path / "bad.onnx"))
    assert not (tmp_path / "bad.onnx").exists()


def test_the_embed_job_with_onnx_runtime_builds_the_same_index_as_with_torch(ray_cluster, tmp_path):
    """embed.runtime=onnx (through the actors, and in process for a small change): the same vectors
    within cosine 0.9999, the same model id and version, so either runtime can extend an index."""
    import shutil

    from puma.config import load_config
    from puma.index.build import live_table
    from puma.index.versions import read_alias, resolve
    from puma.inference.job import embed_catalogue

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), seed=4)
    shop = tmp_path / "shop"
    shop.mkdir()
    every = sorted(FLOWERS.glob("*/*.jpg"))[::61][:15]
    for p in every[:12]:
        shutil.copy(p, shop / p.name)

    def run(location: str, runtime: str, *extra: str):
        cfg = load_config(None, [f"index.uri={location}", f"embed.checkpoint={ckpt}", "embed.num_cpus=1",
                                 "embed.batch_size=8", f"embed.runtime={runtime}", *extra])
        return embed_catalogue(cfg, str(shop))

    a, b = str(tmp_path / "torch"), str(tmp_path / "onnx")
    assert run(a, "torch").embedded == 12
    assert run(b, "onnx", "embed.local_max_items=0").embedded == 12  # the actors run ONNX Runtime
    assert read_alias(a).live == read_alias(b).live  # one model id, one version name

    def vectors(location: str) -> dict[str, np.ndarray]:
        table = live_table(resolve(location))
        return dict(zip(table["item_id"].to_pylist(), table["embedding"].to_numpy(zero_copy_only=False),
                        strict=True))

    va, vb = vectors(a), vectors(b)
    assert set(va) == set(vb) and min(float(np.dot(va[k], vb[k])) for k in va) >= 0.9999
    for p in every[12:]:
        shutil.copy(p, shop / p.name)
    more = run(a, "onnx")  # three new photos, embedded in process by ONNX Runtime into torch's index
    assert (more.added, more.total) == (3, 15) and read_alias(a).live == read_alias(b).live


def test_an_onnx_actor_given_the_drivers_export_builds_no_torch_model_and_checks_its_session(tmp_path):
    """The embed job's actors get the driver's export and its probe embeddings: they start without a
    PyTorch model, embed like the driver's, and refuse bytes that do not reproduce the probe."""
    from puma import storage
    from puma.inference.embedder import Embedder

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), seed=2)
    driver = Embedder(ckpt, "", storage.current_config(), use_gpu=False, threads=1, runtime="onnx")
    assert driver.model is not None and driver.onnx_probe.shape == (4, driver.dim)
    actor = Embedder(ckpt, "", storage.current_config(), use_gpu=False, threads=1, runtime="onnx",
                     onnx_model=driver.onnx_model, onnx_probe=driver.onnx_probe)
    assert actor.model is None and actor.dim == driver.dim
    v = views(ckpt, photos(4))
    np.testing.assert_array_equal(actor.forward(v), driver.forward(v))
    other = Embedder(make_checkpoint(str(tmp_path / "other"), seed=3), "", storage.current_config(),
                     use_gpu=False, threads=1, runtime="onnx")
    with pytest.raises(ExportError, match="probe images at cosine"):
        Embedder(ckpt, "", storage.current_config(), use_gpu=False, threads=1, runtime="onnx",
                 onnx_model=other.onnx_model, onnx_probe=driver.onnx_probe)
