"""The run folder has one owner: puma/run_folder.py names every part of <storage_path>/<run_name>,
tells Ray Train where the run is, and maps Ray's paths (scheme-less on S3) back into the run."""

from __future__ import annotations

import ast
from pathlib import Path

from puma import storage
from puma.config import load_config
from puma.run_folder import BEST, BEST_POINTER, RunFolder, checkpoint_name

REPO = Path(__file__).resolve().parent.parent
LAYOUT = {"current.json", "attempts", "tensorboard", "data_rejects.jsonl", "checkpoint_"}  # as literals
JOINED = {"best", "report"}  # common words: as path parts (a join argument) or constants (X = "best")


def test_a_config_names_its_run_folder_and_every_part_of_it(tmp_path):
    cfg = load_config(None, [f"train.storage_path={tmp_path / 'runs'}", "train.run_name=demo"])
    run = RunFolder.of(cfg)
    assert run.uri == str(tmp_path / "runs" / "demo") and run.name == "demo"
    assert run.best == f"{run.uri}/{BEST}"
    assert run.attempt_record(3) == f"{run.uri}/attempts/attempt_0003.json"
    assert run.checkpoint(2, 1) == f"{run.uri}/{checkpoint_name(2, 1)}"
    assert checkpoint_name(2, 1) == "checkpoint_epoch0002_attempt001"
    assert run.data_rejects == f"{run.uri}/data_rejects.jsonl" and run.report == f"{run.uri}/report"
    assert run.ray_storage() == (str(tmp_path / "runs"), "demo", None)
    assert BEST_POINTER == "current.json"


def test_ray_is_given_the_s3_run_as_path_and_name_and_its_paths_map_back():
    run = RunFolder("s3://bucket/team/runs/demo")
    path, name, filesystem = run.ray_storage()
    assert (path, name) == ("bucket/team/runs", "demo") and filesystem is not None
    ray_path = "bucket/team/runs/demo/checkpoint_epoch0001_attempt001"  # how Ray hands it back
    assert run.child(ray_path) == "s3://bucket/team/runs/demo/checkpoint_epoch0001_attempt001"


def test_each_run_stages_its_tensorboard_events_in_a_folder_of_its_own():
    a, b = RunFolder("s3://bucket/sweeps/s/trials/a"), RunFolder("s3://bucket/sweeps/s/trials/b")
    assert a.tensorboard_staging() != b.tensorboard_staging()
    assert a.tensorboard_staging() == RunFolder("s3://bucket/sweeps/s/trials/a").tensorboard_staging()


def test_attempts_and_checkpoint_folders_are_listed_from_the_run(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    for attempt in (1, 4):
        storage.write_text(run.attempt_record(attempt), "{}")
    storage.write_text(storage.join(run.checkpoint(1, 1), "meta.json"), "{}")
    storage.write_text(storage.join(run.best, BEST_POINTER), "{}")
    assert sorted(run.recorded_attempts()) == [1, 4]
    assert run.checkpoint_folders() == [run.checkpoint(1, 1)]


def _layout_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    joined = {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == "join" for a in n.args if isinstance(a, ast.Constant)}
    assigned = {n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Constant)}
    return (LAYOUT & literals) | (JOINED & (joined | assigned))


def test_no_other_module_names_the_run_folders_layout():
    """What grep would find: the layout's names as string literals only in puma/run_folder.py."""
    owners = {}
    for folder in ("puma", "jobs", "tune"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "run_folder.py":
                continue
            for name in _layout_names(path):
                owners.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert owners == {}, owners
