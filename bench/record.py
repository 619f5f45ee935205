"""Where benchmarks record their figures: bench/results/<name>.json and <name>.md, self-describing.

    from bench.record import record
    record("methods", {"rows": [...]}, markdown_table)

Both files carry the machine (CPU model, logical cores, memory), the device (CUDA device name and
driver, or "cpu"), the commit (and whether the tree had uncommitted changes), the date, the
command line and the library versions, so a figure can always be traced to what produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# PUMA_BENCH_RESULTS: another folder (a lent GPU machine writes to its $OUT, copied back here)
RESULTS = Path(os.environ.get("PUMA_BENCH_RESULTS") or ROOT / "bench" / "results")
LIBRARIES = ("torch", "torchvision", "timm", "ray", "faiss-cpu", "faiss-gpu", "pytorch-metric-learning",
             "pyarrow", "numpy", "pillow", "optuna")


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def device() -> dict[str, Any]:
    """The accelerator the run could use: CUDA device names and driver, else cpu."""
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return {"kind": "cuda", "names": names, "cuda": torch.version.cuda,
                    "driver": _nvidia_driver()}
    except ImportError:
        pass
    return {"kind": "cpu"}


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> dict[str, Any]:
    """The checkout's commit and whether tracked files had uncommitted changes (PUMA_COMMIT and
    PUMA_DIRTY stand in where there is no .git, e.g. on a lent GPU machine)."""
    return {"commit": os.environ.get("PUMA_COMMIT") or _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")
                          or os.environ.get("PUMA_DIRTY"))}


def environment() -> dict[str, Any]:
    """Machine, device, commit, date and command line of this run."""
    from puma import library_versions

    return {"machine": {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(), "memory_gib": _memory_gib(),
                        "platform": platform.platform(), "python": platform.python_version()},
            "device": device(), **commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "libraries": library_versions(LIBRARIES)}


def header(env: dict[str, Any]) -> str:
    """Markdown lines naming the machine, device and commit."""
    dev = env["device"]
    device_text = "cpu only" if dev["kind"] == "cpu" else \
        f"{', '.join(dev['names'])} (CUDA {dev['cuda']}, driver {dev.get('driver') or '?'})"
    commit = env["commit"][:12] + (" + uncommitted changes" if env["dirty"] else "")
    m = env["machine"]
    return "\n".join([f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB",
                      f"- device: {device_text}", f"- commit: {commit}", f"- date: {env['date']}",
                      f"- command: `{env['command']}`"])


def record(name: str, payload: dict[str, Any], markdown: str, title: str = "") -> tuple[Path, Path]:
    """Write bench/results/<name>.json (payload + environment) and <name>.md (title, header, table)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = environment()
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    json_path.write_text(json.dumps({"environment": env, **payload}, indent=1, sort_keys=True) + "\n")
    md_path.write_text(f"# {title or name}\n\n{header(env)}\n\n{markdown.rstrip()}\n")
    print(f"[bench] results: {json_path} and {md_path}", flush=True)
    return json_path, md_path
