"""Where a run continues from, what happens to the folders it does not, and a best/ nothing destroys.

No Ray: run folders are made of real tiny checkpoints on local disk and on a real S3 server
(SeaweedFS); ``load`` is ``puma.checkpoint.load_model``, which checks every file against its sha256
and the probe embeddings, as the worker loop does. The kills in the training job itself are in
tests/test_train_job.py (and 20x in bench/stress_recovery.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_config

from puma import storage
from puma.checkpoint import (
    CheckpointError,
    CheckpointState,
    IncompleteCheckpointError,
    best_record,
    load_model,
    newest_complete,
    probe_embeddings,
    publish_best,
    read_checkpoint,
    save_checkpoint,
)
from puma.methods import build_model
from puma.models.trainable import trainable_state_dict
from puma.run_folder import BEST, BEST_POINTER, checkpoint_name, folder_name, version_label
from puma.train import recovery

METRIC = "harmonic/r@1"


def tiny_state(epoch: int, attempt: int = 1, value: float = 0.5, seed: int | None = None,
               best_epoch: int = 0) -> CheckpointState:
    """A real tiny checkpoint state after ``epoch`` (weights differ per seed, default the epoch)."""
    cfg = tiny_config()
    torch.manual_seed(0)  # the same random backbone for all
    model = build_model(cfg.model)
    gen = torch.Generator().manual_seed(epoch if seed is None else seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run_state = {"epoch": epoch, "attempt": attempt, "best_value": value, "best_epoch": best_epoch or epoch}
    meta = {"epoch": epoch, "metrics": {METRIC: value}, "run_state": run_state, "backbone_weights": "none",
            "probe": probe_embeddings(model, cfg.model.backbone.img_size)}
    return CheckpointState(config=cfg, model=trainable_state_dict(model), meta=meta)


def write(run: str, epoch: int, attempt: int = 1, **kwargs) -> str:
    """A complete checkpoint folder named as the worker loop names it."""
    return save_checkpoint(storage.join(run, checkpoint_name(epoch, attempt)),
                           tiny_state(epoch, attempt, **kwargs))


@pytest.fixture(params=["local", "s3"])
def run_uri(request, tmp_path):
    """An empty run folder on local disk or on the S3 server."""
    if request.param == "local":
        yield str(tmp_path / "run")
        return
    yield f"{request.getfixturevalue('s3_storage')}/run"


def names(uris: list[str]) -> list[str]:
    return [folder_name(u) for u in uris]


# ----------------------------------------------------------------------------- complete or not


def test_a_checkpoint_is_complete_only_when_every_file_matches_its_checksum(tmp_path):
    uri = write(str(tmp_path), epoch=1)
    assert set(read_checkpoint(uri).meta["files"]) == {"model.safetensors", "loss.safetensors", "config.yaml"}
    model = Path(uri) / "model.safetensors"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])  # an interrupted copy
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors .* does not match the sha256"):
        read_checkpoint(uri)
    model.write_bytes(data)
    (Path(uri) / "loss.safetensors").unlink()
    with pytest.raises(IncompleteCheckpointError, match="loss.safetensors is missing"):
        load_model(uri)
    (Path(uri) / "meta.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="meta.json is missing"):
        read_checkpoint(uri)


# ----------------------------------------------------------------------------- which checkpoint


def test_the_newest_complete_checkpoint_wins_over_rays_and_incomplete_ones_are_removed(run_uri):
    """Ray registered epoch 1 only; epochs 2 and 3 are complete on storage (the lag after a kill),
    epoch 4 was cut off mid-write. The run continues after epoch 3."""
    for epoch in (1, 2, 3, 4):
        write(run_uri, epoch)
    cut = storage.join(run_uri, checkpoint_name(4, 1))
    storage.delete(storage.join(cut, "meta.json"))
    registered = {checkpoint_name(1, 1)}

    plan, state = recovery.plan_resume(run_uri, checkpoint_name(1, 1), registered, load_model)

    assert plan.source.name == checkpoint_name(3, 1) and plan.epoch == 3
    assert state[0] is not None and plan.ray_epoch == 1 and plan.attempt == 2
    assert plan.incomplete == [checkpoint_name(4, 1)]
    assert names(plan.orphans) == [checkpoint_name(2, 1)]  # Ray's epoch 1 is Ray's to remove
    assert plan.recomputed == 0
    lines = recovery.plan_summary(plan)
    assert lines[0] == f"resumed from {plan.source.uri} after epoch 3 (attempt 2)"
    assert "Ray Train's registered checkpoint: after epoch 1" in lines[1]
    assert recovery.remove_incomplete(plan, registered) == [checkpoint_name(4, 1)]
    assert not storage.exists(cut)
    record = json.loads(storage.read_text(recovery.record_attempt(plan)))
    assert (record["attempt"], record["resumed_from"], record["after_epoch"]) == (2, plan.source.name, 3)


def test_a_checkpoint_that_does_not_reproduce_its_probe_is_skipped_and_counted(run_uri):
    for epoch in (1, 2):
        write(run_uri, epoch)
    bad = tiny_state(3)
    bad.meta["probe"] = [[v + 0.5 for v in row] for row in bad.meta["probe"]]  # another backbone's
    save_checkpoint(storage.join(run_uri, checkpoint_name(3, 1)), bad)

    plan, _ = recovery.plan_resume(run_uri, None, set(), load_model)

    assert plan.epoch == 2 and plan.recomputed == 1
    assert [name for name, _ in plan.skipped] == [checkpoint_name(3, 1)]
    assert "does not reproduce its embeddings" in plan.skipped[0][1]
    assert storage.exists(storage.join(run_uri, checkpoint_name(3, 1)))  # kept: not debris


def test_complete_checkpoints_that_fit_no_model_stop_the_run_instead_of_a_fresh_start(tmp_path):
    run = str(tmp_path / "run")
    bad = tiny_state(1)
    bad.meta["probe"] = [[v + 0.5 for v in row] for row in bad.meta["probe"]]
    save_checkpoint(storage.join(run, checkpoint_name(1, 1)), bad)
    with pytest.raises(CheckpointError, match="none fits this model, so the run cannot continue and will not "
                                              "start over"):
        recovery.plan_resume(run, None, set(), load_model)


def test_a_fresh_run_and_one_with_only_debris_start_at_epoch_one(tmp_path):
    run = str(tmp_path / "run")
    plan, state = recovery.plan_resume(run, None, set(), load_model)
    assert (plan.source, state, plan.attempt, plan.epoch) == (None, None, 1, 0)
    recovery.record_attempt(plan)
    (Path(run) / "checkpoint_epoch0001_attempt001").mkdir(parents=True)  # killed before any file landed
    plan, _ = recovery.plan_resume(run, None, set(), load_model)
    assert (plan.attempt, plan.source, plan.incomplete) == (2, None, ["checkpoint_epoch0001_attempt001"])
    assert recovery.plan_summary(plan)[0].startswith("starting at epoch 1 (attempt 2)")


def test_the_newest_complete_checkpoint_of_a_run_skips_damaged_ones(tmp_path):
    run = str(tmp_path / "run")
    assert newest_complete(run) is None
    for epoch in (1, 2, 3):
        write(run, epoch)
    model = Path(run) / checkpoint_name(3, 1) / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    assert newest_complete(run).epoch == 2


def test_attempts_are_numbered_past_every_record_and_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    write(run, 1, attempt=4)  # an attempt that left a checkpoint but no record
    plan, _ = recovery.plan_resume(run, None, set(), load_model)
    assert plan.attempt == 5
    recovery.record_attempt(plan)
    assert recovery.plan_resume(run, None, set(), load_model)[0].attempt == 6


# ----------------------------------------------------------------------------- retention


def test_retention_removes_unregistered_folders_once_outranked_and_never_a_registered_one(run_uri):
    """Ray registered epochs 1 and 5 (5 cut off mid-write); 2, 3 and the source 4 it never registered:
    ours to remove as soon as they fall out of the newest two (keep=2), the source included."""
    for epoch in (1, 2, 3, 4):
        write(run_uri, epoch)
    incomplete = storage.join(run_uri, checkpoint_name(5, 1))
    storage.write_text(storage.join(incomplete, "model.safetensors"), "partial")
    registered = {checkpoint_name(1, 1), checkpoint_name(5, 1)}
    plan, _ = recovery.plan_resume(run_uri, checkpoint_name(1, 1), registered, load_model)
    assert plan.epoch == 4 and names(plan.orphans) == [checkpoint_name(e, 1) for e in (3, 2)]
    assert [f.epoch for f in plan.behind] == [4, 3, 2, 1]
    assert recovery.remove_incomplete(plan, registered) == []  # Ray's snapshot names it: Ray's to remove

    retention = recovery.Retention(keep=2, behind=plan.behind)
    # one new checkpoint: the newest two are it and the source 4; 3 and 2 are outranked
    assert names(retention.after_checkpoint()) == [checkpoint_name(e, 1) for e in (3, 2)]
    # two new ones: the source is outranked too (Ray never registered it, so Ray would never remove it)
    assert names(retention.after_checkpoint()) == [checkpoint_name(4, 1)]
    assert retention.after_checkpoint() == []
    left = sorted(names(storage.list_dirs(run_uri)))
    assert left == [checkpoint_name(e, 1) for e in (1, 5)]  # registered: Ray's retention


def test_retention_keeps_a_registered_source_and_removes_an_outranked_orphan_at_once(run_uri):
    """The stress run's case: resumed from a registered 4 with an unregistered 3 behind it, the
    attempt writes only epoch 5; 3 must go after that one checkpoint, not wait for two."""
    for epoch in (2, 3, 4):
        write(run_uri, epoch)
    registered = {checkpoint_name(e, 1) for e in (2, 4)}
    plan, _ = recovery.plan_resume(run_uri, checkpoint_name(4, 1), registered, load_model)
    retention = recovery.Retention(keep=2, behind=plan.behind)
    assert names(retention.after_checkpoint()) == [checkpoint_name(3, 1)]
    assert sorted(names(storage.list_dirs(run_uri))) == [checkpoint_name(e, 1) for e in (2, 4)]


# ----------------------------------------------------------------------------- best/


def test_best_is_replaced_through_a_pointer_and_reads_like_a_checkpoint(run_uri):
    best = storage.join(run_uri, BEST)
    assert best_record(best, METRIC) is None
    first = publish_best(best, tiny_state(1, value=0.4), version_label(1, 1))
    second = publish_best(best, tiny_state(2, value=0.6), version_label(2, 1))
    third = publish_best(best, tiny_state(3, value=0.7), version_label(3, 1))
    assert best_record(best, METRIC)["epoch"] == 3 and best_record(best, METRIC)["value"] == 0.7
    assert read_checkpoint(best).meta["epoch"] == 3 and read_checkpoint(best).optimizer is None
    load_model(best)  # probe reproduced
    left = sorted(names(storage.list_dirs(best)))
    assert left == sorted(names([second, third]))  # the previous one stays for readers in flight
    assert not storage.exists(first)


def test_best_of_the_old_layout_is_read_and_replaced(tmp_path):
    best = str(tmp_path / "run" / BEST)
    save_checkpoint(best, tiny_state(2, value=0.5))  # best/ as a plain checkpoint folder
    assert best_record(best, METRIC)["epoch"] == 2
    publish_best(best, tiny_state(3, value=0.6), version_label(3, 1))
    assert read_checkpoint(best).meta["epoch"] == 3
    assert sorted(p.name for p in Path(best).iterdir() if p.is_file()) == [BEST_POINTER]


class Fault(Exception):
    """Injected: the process dies before this storage operation."""


def test_a_crash_before_any_write_of_a_best_publish_leaves_the_old_or_the_new_best(run_uri, monkeypatch):
    """Fail every storage write or delete of ``publish_best`` in turn, as a kill before it would."""
    best = storage.join(run_uri, BEST)
    publish_best(best, tiny_state(1, value=0.4), "old")
    real = {name: getattr(storage, name) for name in ("write_bytes", "delete")}
    calls = {"n": 0, "fail_at": -1}

    def failing(name):
        def call(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise Fault(name)
            return real[name](*args, **kwargs)
        return call

    for name in real:
        monkeypatch.setattr(storage, name, failing(name))
    outcomes, fail_at = [], 1
    while True:
        calls.update(n=0, fail_at=fail_at)
        try:
            publish_best(best, tiny_state(2, value=0.6), "new")
        except Fault:
            epoch = read_checkpoint(best).meta["epoch"]
            load_model(best)  # complete, probe reproduced
            outcomes.append(epoch)
            publish_best_restore(best, real)
            fail_at += 1
            continue
        break
    assert fail_at > 5, "publish_best made fewer storage operations than expected"
    assert set(outcomes) <= {1, 2} and outcomes[0] == 1 and outcomes[-1] == 2  # old until the switch


def publish_best_restore(best: str, real: dict) -> None:
    """Put best/ back to the old model (epoch 1) with the real storage functions."""
    if read_checkpoint(best).meta["epoch"] == 1:
        return
    saved = {name: getattr(storage, name) for name in real}
    for name, fn in real.items():
        setattr(storage, name, fn)
    try:
        publish_best(best, tiny_state(1, value=0.4), "old")
    finally:
        for name, fn in saved.items():
            setattr(storage, name, fn)


def _publish_forever(best: str, states: list[CheckpointState], ready) -> None:
    """Child process: publish the given states in turn until killed."""
    ready.set()
    i = 0
    while True:
        publish_best(best, states[i % len(states)], f"v{i}")
        i += 1


def test_best_survives_sigkill_at_random_moments_of_its_writes(tmp_path):
    """20 real SIGKILLs of a process that keeps replacing best/: it always reads as one of the two."""
    best = str(tmp_path / "run" / BEST)
    states = [tiny_state(1, value=0.4), tiny_state(2, value=0.6)]
    probes = {s.meta["epoch"]: torch.tensor(s.meta["probe"]) for s in states}
    publish_best(best, states[0], "first")
    context = multiprocessing.get_context("fork")  # the states are built once, here
    rng, seen = random.Random(0), set()
    for _ in range(20):
        ready = context.Event()
        child = context.Process(target=_publish_forever, args=(best, states, ready), daemon=True)
        child.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        model, _ = load_model(best)  # every file against its sha256, probe reproduced
        epoch = read_checkpoint(best).meta["epoch"]
        probe = torch.tensor(probe_embeddings(model, 32))
        torch.testing.assert_close(probe, probes[epoch], rtol=0, atol=1e-5)
        seen.add(epoch)
    assert seen == {1, 2}
    publish_best(best, states[1], "last")  # the next publish clears what the kills left behind
    assert len([p for p in Path(best).iterdir() if p.is_dir()]) == 2
    assert sorted(p.name for p in Path(best).iterdir() if p.is_file()) == [BEST_POINTER]


def test_a_resume_finishes_a_best_write_that_a_crash_cut_off(tmp_path):
    """Epoch 3 improved: its checkpoint is complete, best/ still holds epoch 2 (the crash fell between)."""
    best = str(tmp_path / "run" / BEST)
    publish_best(best, tiny_state(2, value=0.5), "e2")
    resumed = tiny_state(3, value=0.6)  # its run state names itself the best
    got = recovery.reconcile_best(best, METRIC, 0.6, 3, resumed, version_label(3, 2))
    assert (got.value, got.epoch, got.published) == (0.6, 3, True)
    assert best_record(best, METRIC)["epoch"] == 3
    # a later resume from epoch 4 (not an improvement) carries on with what best/ holds
    later = tiny_state(4, value=0.55, best_epoch=3)
    got = recovery.reconcile_best(best, METRIC, 0.6, 3, later, version_label(4, 3))
    assert (got.value, got.epoch, got.published) == (0.6, 3, False)
    # best/ holds more than the checkpoint knows (it is older than best/): best/ is the bar
    older = tiny_state(1, value=0.3)
    got = recovery.reconcile_best(best, METRIC, 0.3, 1, older, version_label(1, 4))
    assert (got.value, got.epoch, got.published) == (0.6, 3, False)
    # best/ whose version folder was removed by hand: reported, and the next evaluated epoch replaces it
    storage.delete(best_record(best, METRIC)["checkpoint"])
    got = recovery.reconcile_best(best, METRIC, 0.6, 3, later, version_label(4, 5))
    assert (got.value, got.epoch) == (float("-inf"), 0) and "meta.json is missing" in got.unreadable


def test_each_worker_group_gets_the_training_stream_at_the_epoch_it_resumes_from(ray_cluster, run_uri):
    """Ray Train's controller calls the driver's ResumedStream for every worker group it starts (the
    first, and each after a lost worker): the stream's next execution draws the shuffle and crops of the
    epoch after the run's newest complete checkpoint, not epoch 1's again."""
    import ray.data

    from puma.train.recovery import ResumedStream

    stream = ResumedStream(ray.data.range(4), run_uri, storage.current_config())
    assert stream().context._execution_idx == 0  # a fresh run starts at epoch 1
    write(run_uri, 1)
    write(run_uri, 2)
    assert stream().context._execution_idx == 2  # a group started after epoch 2's checkpoint: epoch 3


def test_a_fault_hold_waits_while_its_file_exists_and_reaches_the_jobs_ray_workers(tmp_path, monkeypatch):
    """The kill tests' hold (puma/faults.py): ``fault_hold`` returns at once for another point or without
    the file, waits while the file exists, and the driver hands PUMA_FAULT_* to its Ray workers."""
    import threading

    from puma.faults import fault_hold
    from puma.runtime import worker_env

    gate = tmp_path / "hold"
    monkeypatch.setenv("PUMA_FAULT_HOLD", f"train.checkpoint:{gate}")
    fault_hold("train.checkpoint")  # no file: no wait
    gate.touch()
    fault_hold("embed.block")  # another point: no wait
    threading.Timer(0.5, gate.unlink).start()
    started = time.monotonic()
    fault_hold("train.checkpoint")
    assert 0.4 < time.monotonic() - started < 5
    assert worker_env()["PUMA_FAULT_HOLD"] == f"train.checkpoint:{gate}"
    monkeypatch.delenv("PUMA_FAULT_HOLD")
    assert not any(k.startswith("PUMA_FAULT_") for k in worker_env())
