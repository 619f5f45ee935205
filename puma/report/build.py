"""Build a run's report: gather the numbers and embeddings, draw the figures, write the page.

    <out>/index.html          the page (relative links to the PNGs beside it)
    <out>/report.json         the numbers on the page: metrics (= jobs/evaluate.py's), zero-shot, ...
    <out>/evaluation.json     run_evaluation's record of the index evaluation
    <out>/*.png               bars, curves, grids, maps, prompt-pool heatmap, sweep and few-shot curves
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from puma import console, storage
from puma.checkpoint import load_model, read_checkpoint
from puma.config import Config, dump_yaml, for_this_process
from puma.inference.grid import retrieval_grid, write_grid
from puma.report import data, embeddings, figures
from puma.report.page import THIS_RUN, ZERO_SHOT, PageContent, Picture, Section, render
from puma.run_folder import RunFolder, folder_name

PAGE_FILE, RECORD_FILE = "index.html", "report.json"


@dataclass
class ReportOutcome:
    """Where the report went and the numbers it shows."""

    out: str
    page: str
    record: str
    metrics: dict[str, float]
    evaluation: data.Evaluation
    files: list[str] = field(default_factory=list)  # every file written, page last


class Writer:
    """Writes the report's files under one folder and remembers them."""

    def __init__(self, out: str) -> None:
        self.out, self.files = out, []

    def png(self, name: str, png: bytes, caption: str) -> Picture:
        """Write a PNG beside the page; the Picture that shows it."""
        self.write(name, png)
        return Picture(name, caption)

    def grid(self, name: str, grid, caption: str) -> Picture:
        """Write a retrieval grid image (puma.inference.grid) beside the page."""
        self.files.append(write_grid(storage.join(self.out, name), grid))
        return Picture(name, caption)

    def write(self, name: str, payload: bytes | str) -> str:
        uri = storage.join(self.out, name)
        if isinstance(payload, str):
            storage.write_text(uri, payload)
        else:
            storage.write_bytes(uri, payload)
        self.files.append(uri)
        return uri


@dataclass
class Inputs:
    """Where the report reads and writes, and the files it was given, all checked before any work."""

    run: str
    checkpoint: str  # the version folder (best/ followed)
    index: str
    out: str
    compare: dict[str, dict[str, float]]
    sweep: data.SweepCurve | None
    fewshot: list[dict] | None


def resolve_inputs(cfg: Config, options: data.ReportOptions) -> Inputs:
    """The run, checkpoint, index and out folder; other runs, sweep and few-shot files read (a missing
    run or an unreadable file fails here, before anything is embedded)."""
    run = RunFolder.of(cfg)
    return Inputs(run=run.uri, checkpoint=data.find_checkpoint(cfg, options.checkpoint, run.uri),
                  index=storage.absolute(options.index or cfg.index.uri),
                  out=storage.absolute(options.out) if options.out else run.report,
                  compare=data.compare_runs([storage.absolute(r) for r in options.compare]),
                  sweep=data.read_sweep(options.sweep) if options.sweep else None,
                  fewshot=data.read_fewshot(options.fewshot))


def build_report(cfg: Config, options: data.ReportOptions) -> ReportOutcome:
    """Evaluate the run's checkpoint through the index and write the page, its PNGs and report.json."""
    cfg = for_this_process(cfg)
    inputs = resolve_inputs(cfg, options)
    console.say(f"report on {inputs.checkpoint}")
    state = read_checkpoint(inputs.checkpoint)
    evaluation = data.evaluate_run(cfg, inputs.index, inputs.checkpoint, inputs.out)
    before, history = data.recorded_run(inputs.run, state.meta)
    model, model_cfg = load_model(inputs.checkpoint, backbone_weights=cfg.embed.backbone_weights or None)
    items = embeddings.index_items(inputs.index)
    writer = Writer(inputs.out)
    sections = [bars_section(writer, evaluation.metrics, before, inputs.compare),
                curves_section(writer, history, before),
                grids_section(writer, items, options.queries, options.k),
                maps_section(writer, items, options.tsne_points),
                prompt_section(writer, model, model_cfg, items, cfg.data.min_image_size, inputs.sweep),
                fewshot_section(writer, inputs.fewshot, options.fewshot)]
    facts = header(inputs, state.meta, model, evaluation, state.config.model.method)
    record = report_record(facts, evaluation, before, inputs.compare, history, sections)
    record_uri = writer.write(RECORD_FILE, json.dumps(record, indent=2, sort_keys=True))
    configs = [("training config (config.yaml of the checkpoint)", dump_yaml(state.config)),
               ("report config (this job's resolved config)", dump_yaml(cfg))]
    content = PageContent(f"PUMA report: {folder_name(inputs.run)}", facts_rows(facts), facts["versions"],
                          configs, evaluation.metrics, before, inputs.compare, sections)
    page = writer.write(PAGE_FILE, render(content))
    return ReportOutcome(inputs.out, page, record_uri, evaluation.metrics, evaluation, writer.files)


# ----------------------------------------------------------------------------- the header


def header(inputs: Inputs, meta: dict[str, Any], model, evaluation: data.Evaluation,
           method: str) -> dict[str, Any]:
    """The facts the page's header and report.json state."""
    from puma.models.trainable import count_trainable

    return {"run": inputs.run, "checkpoint": inputs.checkpoint, "epoch": meta.get("epoch"), "method": method,
            "model_id": evaluation.model_id, "index": evaluation.index, "items": evaluation.items,
            "evaluation": evaluation.record_uri, "trainable_parameters": count_trainable(model),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data.header_facts(meta)}


def facts_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """The header's rows, in reading order."""
    labels = (("run folder", "run"), ("checkpoint", "checkpoint"), ("epoch", "epoch"), ("method", "method"),
              ("model id", "model_id"), ("index", "index"), ("items in the index", "items"),
              ("evaluation record", "evaluation"), ("commit", "commit"),
              ("created (UTC)", "created"))
    rows = [(label, str(facts[key]) if facts[key] not in (None, "") else "unknown") for label, key in labels]
    rows.insert(4, ("trainable parameters", f"{facts['trainable_parameters']:,}"))
    return rows


def report_record(facts: dict[str, Any], evaluation: data.Evaluation, before: dict[str, float],
                  compare: dict[str, dict[str, float]], history: list[dict[str, float]],
                  sections: list[Section]) -> dict[str, Any]:
    """report.json: the page's numbers and facts (metrics exactly as the index evaluation returned them)."""
    return {**facts, "metrics": evaluation.metrics, "zero_shot": before, "compare": compare,
            "history": history, "embedded": evaluation.embedded,
            "figures": [p.file for s in sections for p in s.pictures],
            "notes": {s.anchor: s.notes for s in sections if s.notes}}


# ----------------------------------------------------------------------------- the sections


def bars_section(writer: Writer, metrics: dict[str, float], before: dict[str, float],
                 compare: dict[str, dict[str, float]]) -> Section:
    """Per-dataset, unified and harmonic R@1 and MAP@R: zero-shot, this run, other runs."""
    section = Section("Zero-shot, this run and other runs", "bars")
    sources = {**({ZERO_SHOT: before} if before else {}), THIS_RUN: metrics, **compare}
    if not before:
        section.notes.append("no zero-shot metrics: the run recorded none (train.eval_before off?)")
    for metric, name in (("r@1", "bars_r1.png"), ("map@r", "bars_map_r.png")):
        section.pictures.append(writer.png(name, figures.metric_bars(sources, metric, metric.upper()),
                                           f"{metric.upper()} per dataset, unified and harmonic"))
    return section


def curves_section(writer: Writer, history: list[dict[str, float]], before: dict[str, float]) -> Section:
    """Loss and per-dataset R@1 per epoch from the run's history."""
    section = Section("Training curves", "curves")
    if not history:
        section.notes.append("no training history: the checkpoint's run state records no epochs")
        return section
    section.pictures.append(writer.png("curves.png", figures.training_curves(history, before),
                                       f"{len(history)} epoch(s): loss, and R@1 where evaluated"))
    return section


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def grids_section(writer: Writer, items: embeddings.IndexItems, queries: int, k: int) -> Section:
    """One retrieval grid per dataset (green: same class, red: another)."""
    section = Section("Retrieval grids", "grids")
    names = items.dataset_names()
    with console.progress("retrieval grids", len(names), "datasets") as bar:
        for name in names:
            rows, results = embeddings.dataset_neighbours(items, name, queries, k)
            if rows and any(results):
                caption = f"{name}: {len(rows)} queries and their top-{k} (green: same class, red: another)"
                section.pictures.append(writer.grid(f"grid_{_file_name(name)}.png",
                                                    retrieval_grid(rows, results), caption))
            else:
                section.notes.append(f"{name}: no query with a result in its gallery")
            bar.update(1)
    return section


def maps_section(writer: Writer, items: embeddings.IndexItems, points: int) -> Section:
    """t-SNE maps: the unified embeddings by dataset, and one dataset's by class (the fewest classes)."""
    section = Section("Embedding maps (t-SNE)", "maps")
    chosen = embeddings.class_map_dataset(items)
    in_chosen = np.flatnonzero(items.datasets == chosen)
    with console.progress("t-SNE maps", 2, "maps") as bar:
        rows = embeddings.sample_rows(len(items), points)
        _map(writer, section, items.vectors[rows], items.datasets[rows], "map_datasets.png",
             f"{len(rows)} of {len(items)} embeddings in the index, coloured by dataset")
        bar.update(1)
        rows = in_chosen[embeddings.sample_rows(len(in_chosen), points)]
        _map(writer, section, items.vectors[rows], items.labels[rows],
             f"map_classes_{_file_name(chosen)}.png",
             f"{len(rows)} {chosen} embeddings, coloured by class")
        bar.update(1)
    return section


def _map(writer: Writer, section: Section, vectors: np.ndarray, groups: np.ndarray, name: str,
         title: str) -> None:
    xy = embeddings.tsne(vectors)
    if xy is None:
        section.notes.append(f"{title}: too few points for a map")
        return
    section.pictures.append(writer.png(name, figures.embedding_map(xy, groups, title), title))


def prompt_section(writer: Writer, model, model_cfg: Config, items: embeddings.IndexItems, min_size: int,
                   curve: data.SweepCurve | None) -> Section:
    """The prompt pool's mean weights per dataset, and the sweep's keep-probability curve."""
    section = Section("Prompt pool and keep probability", "prompts")
    weights = embeddings.prompt_weights(model, model_cfg, items, min_size)
    if weights is None:
        section.notes.append(f"no prompt-pool heatmap: model.method={model_cfg.model.method} has no prompt "
                             "pool (or no readable test image)")
    else:
        names, alpha = weights
        section.pictures.append(writer.png("prompt_pool.png", figures.prompt_heatmap(names, alpha),
                                           f"mean alpha over up to 64 images per dataset in the index x "
                                           f"{alpha.shape[1]} prompts"))
    if curve is None:
        section.notes.append("no keep-probability curve: no --sweep results folder given")
        return section
    png = figures.keep_prob_curve(curve.keep_prob, curve.values, curve.completed, curve.objective)
    section.pictures.append(writer.png("keep_prob.png", png, f"{len(curve.values)} trials of {curve.source}"))
    return section


def fewshot_section(writer: Writer, rows: list[dict] | None, source: str) -> Section:
    """Harmonic R@1 against shots per class, when a few-shot results file exists."""
    section = Section("Few-shot", "fewshot")
    if rows is None:
        section.notes.append(f"no few-shot results: {source or 'no file given'} does not exist")
        return section
    section.pictures.append(writer.png("fewshot.png", figures.fewshot_curve(rows),
                                       f"harmonic R@1 (mean +- std) per shots per class: {source}"))
    return section
