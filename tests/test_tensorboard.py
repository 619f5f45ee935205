"""TensorBoard scalars of a run: written per epoch under <run>/tensorboard; an S3 run stages its event
files locally in a folder of its own, so runs on one node (sweep trials) keep their events apart."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from puma import storage
from puma.run_folder import RunFolder
from puma.train import loop


def _scalars(run_uri: str, into: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's event files as stored (downloaded from S3 first): tag -> [(step, value)]."""
    files = storage.list_files(RunFolder(run_uri).tensorboard)
    assert files, f"no event files under {run_uri}/tensorboard"
    into.mkdir(parents=True)
    for i, uri in enumerate(files):
        (into / f"{i}.{Path(uri).name}").write_bytes(storage.read_bytes(uri))
    events = EventAccumulator(str(into))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_two_s3_runs_in_one_process_keep_their_tensorboard_events_apart(s3_storage, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "_writers", {})
    runs = {"a": storage.join(s3_storage, "trials", "a"), "b": storage.join(s3_storage, "trials", "b")}
    stale = Path(RunFolder(runs["a"]).tensorboard_staging())  # left by an earlier process
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "events.out.tfevents.0.stale").write_bytes(b"not this run's")
    for epoch in (1, 2):
        for offset, (name, uri) in enumerate(runs.items()):
            loop._write_tensorboard({"run_uri": uri}, {"loss": 10.0 * offset + epoch, f"only/{name}": 1.0,
                                                       "note": "not a scalar"}, epoch)
    for offset, (name, uri) in enumerate(runs.items()):
        files = storage.list_files(RunFolder(uri).tensorboard)
        assert len(files) == 1 and files[0].rsplit("/", 1)[-1].startswith("events.out.tfevents."), files
        assert not files[0].endswith(".stale")
        scalars = _scalars(uri, tmp_path / name)
        assert sorted(scalars) == ["loss", f"only/{name}"]
        assert scalars["loss"] == [(1, 10.0 * offset + 1), (2, 10.0 * offset + 2)]


def test_a_local_run_writes_its_events_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "_writers", {})
    run = str(tmp_path / "runs" / "local")
    loop._write_tensorboard({"run_uri": run}, {"loss": 3.0}, 1)
    assert _scalars(run, tmp_path / "read") == {"loss": [(1, 3.0)]}
