"""Per-dataset counts of prepared data and their check against the paper's Table 1."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from puma.data import schema

# PUMA (WACV 2025) Table 1: train images, train classes, test images, test classes. Values of
# 1,000 or more are printed in thousands with one decimal (the paper rounds or truncates them).
PAPER_TABLE1: dict[str, tuple[float, float, float, float]] = {
    "cub": (5.8e3, 100, 5.9e3, 100),
    "cars": (8.0e3, 98, 8.1e3, 98),
    "sop": (59.5e3, 11.3e3, 60.5e3, 11.3e3),
    "inshop": (25.8e3, 3.9e3, 28.7e3, 3.9e3),
    "nabirds": (22.9e3, 278, 25.6e3, 277),
    "dogs": (10.6e3, 60, 9.9e3, 60),
    "flowers": (3.5e3, 51, 4.7e3, 51),
    "aircraft": (5.0e3, 50, 5.0e3, 50),
}
# classes in each full official release: a listing with this many classes is compared to Table 1
FULL_RELEASE_CLASSES = {"cub": 200, "cars": 196, "sop": 22634, "inshop": 7982, "nabirds": 555,
                        "dogs": 120, "flowers": 102, "aircraft": 100}
# known differences between the official files and Table 1
PAPER_NOTES = {"inshop": "the official list_eval_partition.txt has 14,218 query + 12,612 gallery = 26,830 "
                         "test images; Table 1 prints 28.7K"}
CHECKED = ("train_images", "train_classes", "test_images", "test_classes")


def count_rows(rows: Iterable[tuple[str, int, str, str]]) -> dict[str, dict]:
    """Per dataset: images and classes per split and per role, from (dataset, label, split, role)."""
    images: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    classes: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for dataset, label, split, role in rows:
        for key in (split, role) if role != split else (split,):
            images[dataset][key] += 1
            if label != schema.UNLABELED:
                classes[dataset][key].add(label)
    return {name: {key: {"images": images[name][key], "classes": len(classes[name][key])}
                   for key in sorted(images[name])} for name in sorted(images)}


def paper_check(kind: str, num_classes: int, counts: dict) -> dict:
    """Compare a full official dataset's counts with Table 1 (status ok | differs | not_compared)."""
    if kind not in PAPER_TABLE1 or FULL_RELEASE_CLASSES[kind] != num_classes:
        return {"status": "not_compared", "reason": "not a full official release"}
    got = (counts.get(schema.TRAIN, {}).get("images", 0), counts.get(schema.TRAIN, {}).get("classes", 0),
           counts.get(schema.TEST, {}).get("images", 0), counts.get(schema.TEST, {}).get("classes", 0))
    rows = {key: {"paper": want, "prepared": have, "ok": _agrees(want, have)}
            for key, want, have in zip(CHECKED, PAPER_TABLE1[kind], got, strict=True)}
    out = {"status": "ok" if all(r["ok"] for r in rows.values()) else "differs", "values": rows}
    if kind in PAPER_NOTES:
        out["note"] = PAPER_NOTES[kind]
    return out


def _agrees(paper: float, prepared: int) -> bool:
    """Equal to the paper's precision: exact below 1,000, within 0.1K above."""
    return prepared == paper if paper < 1000 else abs(prepared - paper) < 100


def count_table(datasets: dict[str, dict]) -> str:
    """A text table: classes, images per split / role and the Table 1 check, one line per dataset."""
    header = f"{'dataset':<16}{'classes':>9}{'train cls':>10}{'train':>9}{'test':>9}{'query':>9}" \
             f"{'gallery':>9}  paper Table 1"
    lines = [header, "-" * len(header)]
    totals = defaultdict(int)
    for name, info in sorted(datasets.items()):
        c = info["counts"]
        keys = (schema.TRAIN, schema.TEST, schema.QUERY, schema.GALLERY)
        values = [f"{c.get(k, {}).get('images', 0):,}" for k in keys]
        if schema.GALLERY not in c:  # all-vs-all: every test image is a query and in the gallery
            values[2:] = ["-", "-"]
        totals["train"] += c.get(schema.TRAIN, {}).get("images", 0)
        totals["test"] += c.get(schema.TEST, {}).get("images", 0)
        lines.append(f"{name:<16}{info['num_classes']:>9,}{info['num_train_classes']:>10,}"
                     + "".join(f"{v:>9}" for v in values) + f"  {_status(info.get('paper_check', {}))}")
    lines.append(f"{'total':<16}{'':>19}{totals['train']:>9,}{totals['test']:>9,}")
    return "\n".join(lines)


def _status(check: dict) -> str:
    status = check.get("status", "")
    if status == "not_compared":
        return "- (not a full release)"
    if status == "differs":
        status += ": " + ", ".join(f"{k} {v['prepared']:,} vs {v['paper']:,g}"
                                   for k, v in check["values"].items() if not v["ok"])
    return status
