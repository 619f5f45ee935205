"""A catalogue no run ever read: the demo checkpoint against the frozen backbone (issue 13, item 5).

    .venv/bin/python bench/unseen_catalogue.py                        # artifacts/runs/demo/best
    .venv/bin/python bench/unseen_catalogue.py --checkpoint PATH --per-class 24

The catalogue is assembled from the sample data the demo preset reads from, keeping only what the
demo never touches: the demo's *test* classes of each dataset (class-disjoint from every training
class), and of those only images beyond the demo's per-class cap (so no evaluation read them
either). Fashion-MNIST's images come from its t10k files, which the demo (150 per class, taken from
the train files first) never opens. The demo's own manifest (``source_path`` of every item it
prepared) is checked against the catalogue: one shared image is an error, not a footnote.

The catalogue is written as class folders (``<dataset>/<class>/<image>``, the layout
``jobs/prepare_data.py --preset folder`` and ``jobs/embed.py --catalogue`` take) and embedded twice
in-process with the eval view: the frozen backbone's CLS feature (zero-shot: what a user has
without training) and the checkpoint's model. Both are scored with the evaluation protocol of
``puma.eval.metrics`` (every image a query against the rest of its dataset). Results:
bench/results/unseen_catalogue.{json,md}.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import record  # noqa: E402

DATASETS = ("cub", "flowers", "omniglot", "fashion_mnist")
T10K = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def demo_read(data_uri: str) -> tuple[dict, set[str]]:
    """The demo manifest's datasets and the source path of every image the demo prepared (any split)."""
    import pyarrow.parquet as pq

    from puma.data.manifest import load_manifest

    manifest = load_manifest(data_uri)
    shards = sorted(Path(data_uri).glob("*/*.parquet"))
    if not shards:
        raise SystemExit(f"no prepared demo data under {data_uri}: run `python jobs/train.py` first")
    paths = [p for shard in shards
             for p in pq.read_table(shard, columns=["source_path"])["source_path"].to_pylist()]
    return manifest.datasets, {p if "#" in p else str(Path(p).resolve()) for p in paths}


def test_classes(info: dict) -> list[str]:
    """The dataset's class names that no training run uses (the second, test part)."""
    return list(info["classes"])[int(info["num_train_classes"]):]


def folder_images(root: Path, classes: list[str], read: set[str], per_class: int) -> dict[str, list[Path]]:
    """Per class: the first ``per_class`` images (sorted) under root/<class> the demo did not read."""
    out = {}
    for name in classes:
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        unread = [p for p in files if str(p.resolve()) not in read][:per_class]
        if unread:
            out[name] = unread
    return out


def assemble(out: Path, source_root: Path, fashion_dir: Path, datasets: dict, read: set[str],
             per_class: int) -> dict[str, int]:
    """Write the class-folder catalogue under ``out``; returns images per dataset."""
    from puma.data.demo import encode_png, read_idx

    shutil.rmtree(out, ignore_errors=True)
    roots = {"cub": source_root / "cub200-subset" / "CUB_200_2011" / "images",
             "flowers": source_root / "flowers12-subset", "omniglot": source_root / "omniglot-subset"}
    counts = {}
    for name, root in roots.items():
        picked = folder_images(root, test_classes(datasets[name]), read, per_class)
        for cls, files in picked.items():
            target = out / name / cls.replace("/", "__")
            target.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copyfile(f, target / f.name)
        counts[name] = sum(len(v) for v in picked.values())
    info = datasets["fashion_mnist"]
    images, labels = (read_idx(str(fashion_dir / f)) for f in T10K)
    test = set(range(int(info["num_train_classes"]), len(info["classes"])))
    taken = {c: 0 for c in test}
    for i, label in enumerate(labels.tolist()):
        if label in test and taken[label] < per_class:
            assert f"{fashion_dir / T10K[0]}#{i}" not in read  # the demo reads the train files first
            target = out / "fashion_mnist" / info["classes"][label].replace("/", "_")
            target.mkdir(parents=True, exist_ok=True)
            (target / f"t10k_{i:05d}.png").write_bytes(encode_png(images[i]))
            taken[label] += 1
    counts["fashion_mnist"] = sum(taken.values())
    return counts


def check_disjoint(catalogue: Path, read: set[str], source_root: Path) -> None:
    """No catalogue image is one the demo prepared (compared by source file)."""
    copied = {p.name for p in catalogue.rglob("*") if p.is_file()}
    shared = [p for p in read if "#" not in p and Path(p).name in copied
              and str(source_root.resolve()) in p]
    if shared:
        raise SystemExit(f"the catalogue shares {len(shared)} image(s) with the demo, e.g. {shared[:3]}")


def listing(catalogue: Path) -> tuple[list[Path], np.ndarray, np.ndarray]:
    """Files, labels (class index within the dataset) and dataset names of the catalogue."""
    files, labels, names = [], [], []
    for dataset in DATASETS:
        for label, cls in enumerate(sorted(p for p in (catalogue / dataset).iterdir() if p.is_dir())):
            for f in sorted(cls.iterdir()):
                files.append(f)
                labels.append(label)
                names.append(dataset)
    return files, np.array(labels, dtype=np.int64), np.array(names)


def embed(forward, files: list[Path], cfg, batch: int = 64) -> np.ndarray:
    """Eval-view embeddings (N, E) of ``files`` through ``forward``, L2-normalised."""
    import torch

    from puma.data.images import ViewSpec, backbone_normalisation, make_view

    mean, std = backbone_normalisation(cfg)
    spec = ViewSpec(img_size=cfg.model.backbone.img_size, mean=mean, std=std, train=False)
    out = []
    with torch.no_grad():
        for i in range(0, len(files), batch):
            views = np.stack([make_view(f.read_bytes(), spec) for f in files[i:i + batch]])
            out.append(torch.nn.functional.normalize(forward(torch.from_numpy(views)).float(), dim=1).numpy())
    return np.concatenate(out)


def evaluate(files, labels, names, forward, cfg) -> tuple[dict[str, float], float]:
    from puma.data.schema import QUERY
    from puma.eval.metrics import evaluate_embeddings

    start = time.perf_counter()
    emb = embed(forward, files, cfg)
    seconds = time.perf_counter() - start
    roles = np.full(len(files), QUERY)
    return evaluate_embeddings(emb, labels, names, roles, ks=(1, 2, 4, 8)), seconds


def table(results: dict[str, dict[str, float]], counts: dict[str, int]) -> str:
    rows = [f"{d} ({counts[d]} images)" for d in DATASETS] + ["unified", "harmonic"]
    keys = [*DATASETS, "unified", "harmonic"]
    lines = ["| catalogue | " + " | ".join(f"{m} r@1 | {m} map@r" for m in results) + " |",
             "|---|" + "---|---|" * len(results)]
    for row, key in zip(rows, keys, strict=True):
        cells = [f"{results[m][f'{key}/r@1']:.4f} | {results[m][f'{key}/map@r']:.4f}" for m in results]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "artifacts" / "runs" / "demo" / "best"))
    parser.add_argument("--data", default=str(ROOT / "artifacts" / "data" / "demo"),
                        help="the demo's prepared data (its manifest says what the demo read)")
    parser.add_argument("--source-root", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--fashion-mnist", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--per-class", type=int, default=24)
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "data" / "unseen_catalogue"))
    args = parser.parse_args(argv)

    import torch

    from puma.checkpoint import load_model
    from puma.models.backbone import create_backbone

    torch.set_num_threads(max(1, torch.get_num_threads()))
    datasets, read = demo_read(args.data)
    counts = assemble(Path(args.out), Path(args.source_root), Path(args.fashion_mnist), datasets, read,
                      args.per_class)
    check_disjoint(Path(args.out), read, Path(args.source_root))
    files, labels, names = listing(Path(args.out))
    print(f"[bench] unseen catalogue {args.out}: {counts}", flush=True)
    model, cfg = load_model(args.checkpoint)
    backbone = create_backbone(cfg.model.backbone).eval()  # the frozen backbone alone: CLS, no head
    results, seconds = {}, {}
    for name, forward in (("zero_shot", backbone), ("puma_demo", model)):
        results[name], seconds[name] = evaluate(files, labels, names, forward, cfg)
        print(f"[bench] {name}: harmonic r@1 {results[name]['harmonic/r@1']:.4f} "
              f"({seconds[name]:.0f} s to embed {len(files)} images)", flush=True)
    markdown = (table(results, counts) + f"\n\nzero_shot: the frozen backbone's CLS feature "
                f"({cfg.model.backbone.name}); puma_demo: {args.checkpoint}. Every image is a query "
                "against the rest of its dataset (unified: against all of them).\n")
    record("unseen_catalogue", {"checkpoint": args.checkpoint, "per_class": args.per_class, "images": counts,
                                "results": results, "embed_seconds": seconds}, markdown,
           title="An unseen catalogue: test classes' images the demo never read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
