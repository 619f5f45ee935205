"""jobs/report.py on a tiny real run: real photos prepared, a tiny checkpoint published as the run's best/,
the test split embedded on the test Ray cluster, the page opened in headless chromium.

The report's metrics equal jobs/evaluate.py's on the same index; every picture the page shows exists,
loads in the browser and is not blank; the numbers in the page's table are report.json's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from browser import headless_chromium
from conftest import write_cub_tree
from PIL import Image
from tiny import make_checkpoint

import jobs.evaluate
import jobs.report
from puma.checkpoint import CheckpointState, publish_best, read_checkpoint, save_checkpoint
from puma.config import IndexConfig
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec
from puma.index import build_index
from puma.report import data
from puma.report.build import Writer, fewshot_section

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")
SWEEP = REPO / "tune" / "results" / "recipe"  # a real sweep's results folder (trials.csv)
BEFORE = {"cub/r@1": 0.25, "flowers/r@1": 0.5, "unified/r@1": 0.375, "harmonic/r@1": 1 / 3,
          "cub/map@r": 0.2, "flowers/map@r": 0.3, "unified/map@r": 0.25, "harmonic/map@r": 0.24}


def flower_folder(root: Path, classes: int = 4, per_class: int = 4) -> Path:
    """A class-per-folder tree of real Oxford-Flowers photos: the first ``classes`` species."""
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:classes]:
        (root / species.name).mkdir(parents=True)
        for photo in sorted(species.glob("*.jpg"))[:per_class]:
            shutil.copyfile(photo, root / species.name / photo.name)
    return root


def run_state(before: dict[str, float], history: list[dict[str, float]]) -> dict:
    """A run state as the training loop records it (puma.train.loop.RunState)."""
    from puma.train.loop import RunState

    return dataclasses.asdict(RunState(epoch=len(history), step=4 * len(history), best_value=0.5,
                                       best_epoch=len(history), before=before, history=history))


def publish_run(run: Path, seed: int, meta: dict) -> str:
    """A tiny checkpoint (seeded weights) with ``meta`` published as the run's best/; its version folder."""
    state = read_checkpoint(make_checkpoint(str(run.parent / f"staging-{run.name}"), seed=seed))
    state = CheckpointState(config=state.config, model=state.model, loss=state.loss,
                            meta={**state.meta, **meta})
    return publish_best(str(run / "best"), state, f"epoch{meta.get('epoch', 2):04d}_attempt001")


def history() -> list[dict[str, float]]:
    """Two epochs, the second evaluated."""
    return [{"epoch": 1.0, "step": 4.0, "train/loss": 3.2, "attempt": 1.0},
            {"epoch": 2.0, "step": 8.0, "train/loss": 2.6, "cub/r@1": 0.5, "flowers/r@1": 0.75,
             "unified/r@1": 0.625, "harmonic/r@1": 0.6, "attempt": 1.0}]


def write_fewshot(path: Path) -> Path:
    rows = [{"method": m, "shots": s, "harmonic_r1_mean": base + 0.1 * i, "harmonic_r1_std": 0.02}
            for m, base in (("puma", 0.4), ("linear", 0.3)) for i, s in enumerate((1, 2, 4))]
    path.write_text(json.dumps({"rows": rows}))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """A prepared dataset of two datasets: test split 2 x 8 real images (cub-layout and flower photos)."""
    root = tmp_path_factory.mktemp("report_data")
    write_cub_tree(root / "raw_cub", num_classes=4, per_class=4)
    specs = [SourceSpec("cub", "cub", str(root / "raw_cub")),
             SourceSpec("folder", "flowers", str(flower_folder(root / "raw_flowers")))]
    prepare(specs, str(root / "prepared"), shard_rows=5, log=lambda _: None)
    return str(root / "prepared")


# ----------------------------------------------------------------------------- end to end


def open_in_browser(page: Path, shot: Path, profile: Path) -> dict:
    """Open the page in headless chromium: screenshot, every <img>'s natural width, the table's cells."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver = headless_chromium(profile)
    try:
        driver.get(page.as_uri())
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return [...document.images].every(i => i.complete)"))
        found = driver.execute_script(
            "return {images: [...document.images].map(i => [i.getAttribute('src'), i.naturalWidth]),"
            " cells: [...document.querySelectorAll('td[data-metric]')].map(c => [c.dataset.source,"
            " c.dataset.metric, c.dataset.value, c.textContent])}")
        assert driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    return found


def test_report_of_a_tiny_run_equals_evaluate_and_renders(ray_cluster, prepared, tmp_path, capsys):
    run, other = tmp_path / "runs" / "tiny", tmp_path / "runs" / "other"
    publish_run(run, seed=0, meta={"epoch": 2, "run_state": run_state(BEFORE, history()),
                                   "metrics": {"harmonic/r@1": 0.6}})
    publish_run(other, seed=1, meta={"epoch": 3, "metrics": {"cub/r@1": 0.4, "flowers/r@1": 0.7,
                                                             "unified/r@1": 0.55, "harmonic/r@1": 0.51,
                                                             "cub/map@r": 0.3, "train/loss": 2.0}})
    index = str(tmp_path / "index")
    common = [f"data.uri={prepared}", "eval.ks=[1,2,4]"]
    argv = ["--index", index, "--compare", str(other), "--sweep", str(SWEEP),
            "--fewshot", str(write_fewshot(tmp_path / "fewshot.json")), *common,
            f"train.storage_path={tmp_path / 'runs'}", "train.run_name=tiny", "embed.commit_rows=16",
            "embed.batch_size=8", "data.decode_batch_size=8", "embed.num_cpus=1"]
    assert jobs.report.main(argv) == 0
    out = capsys.readouterr().out
    page = run / "report" / "index.html"
    assert f"[puma] report: {page}" in out and "embedded 16 test images" in out

    assert jobs.evaluate.main(["--index", index, *common]) == 0
    want = json.loads(Path(index, "evaluation.json").read_text())["metrics"]
    record = json.loads((run / "report" / "report.json").read_text())
    assert set(record["metrics"]) == set(want) and {"cub/r@4", "flowers/map@r", "harmonic/rp"} <= set(want)
    for key, value in want.items():
        assert record["metrics"][key] == pytest.approx(value, abs=1e-9), key
    assert record["zero_shot"] == BEFORE and len(record["history"]) == 2
    assert record["compare"] == {"other": {"cub/r@1": 0.4, "flowers/r@1": 0.7, "unified/r@1": 0.55,
                                           "harmonic/r@1": 0.51, "cub/map@r": 0.3}}
    assert record["trainable_parameters"] > 0 and record["versions"]["torch"]
    assert record["commit"] == "" or len(record["commit"]) == 40
    assert {"bars_r1.png", "bars_map_r.png", "curves.png", "grid_cub.png", "grid_flowers.png",
            "map_datasets.png", "map_classes_cub.png", "prompt_pool.png", "keep_prob.png",
            "fewshot.png"} == set(record["figures"])

    found = open_in_browser(page, tmp_path / "report.png", tmp_path / "chromium-profile")
    shot = np.asarray(Image.open(tmp_path / "report.png").convert("RGB"))
    assert shot.shape[1] == 1280 and shot.std() > 20  # a page with figures, not a blank one
    assert sorted(src for src, _ in found["images"]) == sorted(record["figures"])
    assert all(width > 0 for _, width in found["images"]), found["images"]
    shown = {(source, metric): (float(value), text) for source, metric, value, text in found["cells"]}
    run_cells = {metric: v for (source, metric), v in shown.items() if source == "this run"}
    assert set(run_cells) == {f"{n}/{m}" for n in ("cub", "flowers", "unified", "harmonic")
                              for m in ("r@1", "map@r", "rp")}
    for metric, (value, text) in run_cells.items():
        assert value == record["metrics"][metric] and text == f"{value:.4f}", metric
    assert shown[("zero-shot", "harmonic/r@1")][0] == BEFORE["harmonic/r@1"]
    assert shown[("other", "unified/r@1")][0] == 0.55

    for name in record["figures"]:  # every PNG the page shows: there, and not blank
        pixels = np.asarray(Image.open(run / "report" / name).convert("RGB"))
        colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
        assert pixels.std() > 5 and colours > 8, (name, pixels.std(), colours)


# ----------------------------------------------------------------------------- without Ray


def test_user_errors_are_one_line(tmp_path, capsys):
    job = jobs.report
    runs = [f"train.storage_path={tmp_path / 'runs'}", "train.run_name=none", f"index.uri={tmp_path / 'ix'}"]
    assert job.main(runs) == 2
    assert f"error: no trained run at {tmp_path / 'runs' / 'none'}" in capsys.readouterr().err

    publish_run(tmp_path / "runs" / "tiny", seed=0, meta={"epoch": 1})
    tiny = [f"train.storage_path={tmp_path / 'runs'}", "train.run_name=tiny", f"index.uri={tmp_path / 'ix'}"]
    (tmp_path / "sweep").mkdir()
    assert job.main(["--sweep", str(tmp_path / "sweep"), *tiny]) == 2
    assert f"no {tmp_path / 'sweep' / 'trials.csv'}" in capsys.readouterr().err
    (tmp_path / "sweep" / "trials.csv").write_text("trial_id,status,epochs,harmonic/r@1,optim.lr\n")
    assert job.main(["--sweep", str(tmp_path / "sweep"), *tiny]) == 2
    assert "no column model.adapter.keep_prob" in capsys.readouterr().err
    assert job.main(["--compare", str(tmp_path / "runs" / "nothing"), *tiny]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "no best checkpoint" in err and len(err.strip().splitlines()) == 1
    assert job.main(["--checkpoint", str(tmp_path / "nowhere"), *tiny]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert job.main(["--queries", "0", *tiny]) == 2
    assert "--queries must be at least 1" in capsys.readouterr().err
    vectors = np.eye(4, dtype=np.float32)  # an index of another model: its numbers are not this checkpoint's
    build_index(str(tmp_path / "ix"), pa.table({"item_id": list("abcd"), "embedding": list(vectors)}),
                IndexConfig(index_type="flat"), model_id="sha256:another")
    assert job.main(tiny) == 2
    assert f"index {tmp_path / 'ix'} holds embeddings of model sha256:another" in capsys.readouterr().err


def test_zero_shot_from_the_newest_complete_checkpoint_and_the_sweep_curve(tmp_path):
    run = tmp_path / "run"
    version = publish_run(run, seed=0, meta={"epoch": 1, "run_state": run_state({}, history()[:1])})
    state = read_checkpoint(version)
    save_checkpoint(str(run / "checkpoint_epoch0002_attempt001"), CheckpointState(
        config=state.config, model=state.model, loss=state.loss,
        meta={**state.meta, "epoch": 2, "run_state": run_state(BEFORE, history())}))
    before, found = data.recorded_run(str(run), read_checkpoint(version).meta)
    assert before == BEFORE and found == history()  # the longer history of the newer checkpoint

    curve = data.read_sweep(str(SWEEP))
    assert curve.objective == "harmonic/r@1" and len(curve.values) == len(curve.keep_prob) >= 2
    assert all(0 < p <= 1 for p in curve.keep_prob)
    absent = str(tmp_path / "no.json")
    section = fewshot_section(Writer(str(tmp_path / "out")), data.read_fewshot(absent), absent)
    assert not section.pictures and section.notes == [f"no few-shot results: {absent} does not exist"]
