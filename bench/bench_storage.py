"""What the storage issue's choices cost and save, measured side by side in one run (interleaved):

  1. prepare with every image decoded once (rejects found at prepare) against prepare without the
     check, on the same local CUB-layout release, rounds alternating;
  2. a dead endpoint: the time until puma.storage reports it (the one retry policy, defaults)
     against one call of a pyarrow filesystem that retries on its own (AWS standard strategy,
     6 attempts, as the storage layer used before; the old layer wrapped 6 of those);
  3. a transient-failure run: 40 small objects written through a proxy that answers every third
     request with 503 SlowDown, against the same writes without failures (time per object).

Usage: python bench/bench_storage.py [--images 2000] [--rounds 3]
Results: bench/results/storage.json and storage.md (bench/record.py: machine, device, commit, command).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import pyarrow.fs as pafs  # noqa: E402

from bench.record import record  # noqa: E402
from puma import storage  # noqa: E402
from puma.config import StorageConfig  # noqa: E402
from puma.data.prepare import prepare  # noqa: E402
from puma.data.sources import SourceSpec  # noqa: E402

CUB = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(CUB), help="a CUB_200_2011-layout release")
    parser.add_argument("--images", type=int, default=2000, help="images of the release to prepare")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per comparison")
    return parser.parse_args(argv)


def small_release(source: Path, images: int, work: Path) -> Path:
    """A CUB-layout copy holding the first ``images`` images (symlinked files)."""
    root = work / "CUB_200_2011"
    lines = (source / "images.txt").read_text().splitlines()[:images]
    keep = {line.split()[0] for line in lines}
    root.mkdir(parents=True)
    for name in ("images.txt", "image_class_labels.txt", "train_test_split.txt"):
        rows = [r for r in (source / name).read_text().splitlines() if r.split()[0] in keep]
        (root / name).write_text("\n".join(rows) + "\n")
    shutil.copy(source / "classes.txt", root / "classes.txt")
    for line in lines:
        rel = line.split()[1]
        (root / "images" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "images" / rel).symlink_to(source / "images" / rel)
    return root


def bench_prepare(release: Path, work: Path, rounds: int) -> dict:
    """Seconds per prepare with and without the decode check, alternating, a fresh output each time."""
    times: dict[str, list[float]] = {"verify": [], "no_verify": []}
    spec = [SourceSpec("cub", "cub", str(release))]
    for r in range(rounds):
        for name in (("verify", "no_verify") if r % 2 == 0 else ("no_verify", "verify")):
            out = work / f"prepared-{name}-{r}"
            start = time.perf_counter()
            prepare(spec, str(out), shard_rows=2000, log=lambda _: None, verify_images=name == "verify")
            times[name].append(time.perf_counter() - start)
            shutil.rmtree(out)
            print(f"[bench] prepare {name} round {r}: {times[name][-1]:.2f} s", flush=True)
    return {name: statistics.median(t) for name, t in times.items()} | {"all": times}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_dead_endpoint(rounds: int) -> dict:
    """Seconds to report a dead endpoint: the policy (a whole call) vs one self-retrying pyarrow call."""
    times: dict[str, list[float]] = {"policy": [], "pyarrow_6": []}
    for _ in range(rounds):
        port = _closed_port()
        storage.configure(StorageConfig(endpoint_url=f"http://127.0.0.1:{port}"))
        start = time.perf_counter()
        try:
            storage.exists("s3://bucket/key")
        except storage.StorageError:
            times["policy"].append(time.perf_counter() - start)
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=6))
        start = time.perf_counter()
        try:
            fs.get_file_info("bucket/key")
        except OSError:
            times["pyarrow_6"].append(time.perf_counter() - start)
        print(f"[bench] dead endpoint: policy {times['policy'][-1]:.2f} s, one pyarrow call "
              f"{times['pyarrow_6'][-1]:.2f} s", flush=True)
    storage.configure(StorageConfig())
    return {name: statistics.median(t) for name, t in times.items()} | {"all": times}


def bench_transient(work: Path, rounds: int) -> dict:
    """Seconds per object written through a proxy: no failures vs every third request 503."""
    from conftest import AWS_TEST_ENV, _free_port, _wait_for_s3, _weed_command
    from s3proxy import ERROR_503, PASS, S3Proxy, every

    os.environ.update(AWS_TEST_ENV)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    taken: set[int] = set()
    ports = {name: _free_port(taken) for name in ("s3", "master", "volume", "filer", "admin")}
    log = work / "weed.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(_weed_command(work / "weed-data", ports), stdout=out,
                                  stderr=subprocess.STDOUT, cwd=work)
    try:
        _wait_for_s3(f"http://127.0.0.1:{ports['s3']}", server, log)
        proxy = S3Proxy(("127.0.0.1", ports["s3"])).start()
        storage.configure(StorageConfig(endpoint_url=proxy.endpoint))
        storage.ensure_bucket("s3://bench/")
        times: dict[str, list[float]] = {"clean": [], "every_3rd_503": []}
        for r in range(rounds):
            for name in ("clean", "every_3rd_503"):
                proxy.plan = every(3, ERROR_503) if name != "clean" else (lambda n, m, p: PASS)
                start = time.perf_counter()
                for i in range(40):
                    storage.write_bytes(f"s3://bench/{name}/{r}/{i:03d}.bin", os.urandom(4096))
                times[name].append((time.perf_counter() - start) / 40)
            print(f"[bench] 40 writes: clean {times['clean'][-1] * 1e3:.1f} ms/object, every third request "
                  f"503 {times['every_3rd_503'][-1] * 1e3:.1f} ms/object", flush=True)
        proxy.stop()
    finally:
        storage.configure(StorageConfig())
        server.terminate()
        server.wait(timeout=15)
    return {name: statistics.median(t) for name, t in times.items()} | {"all": times}


def table(args, prep: dict, dead: dict, flaky: dict) -> str:
    """The markdown table of medians and ratios."""
    return "\n".join([
        f"Load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: rounds alternate).", "",
        "| what | compared | median | ratio |", "|---|---|---|---|",
        f"| prepare {args.images} CUB images (local) | decode check / none | {prep['verify']:.2f} s / "
        f"{prep['no_verify']:.2f} s | {prep['verify'] / prep['no_verify']:.2f}x |",
        f"| dead endpoint reported | whole policy / one self-retrying pyarrow call | "
        f"{dead['policy']:.2f} s / {dead['pyarrow_6']:.2f} s | {dead['policy'] / dead['pyarrow_6']:.2f}x |",
        f"| 4 KiB object writes via a proxy | every 3rd request 503 / no failures | "
        f"{flaky['every_3rd_503'] * 1e3:.1f} / {flaky['clean'] * 1e3:.1f} ms per object | "
        f"{flaky['every_3rd_503'] / flaky['clean']:.2f}x |", ""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
        work = Path(tmp)
        release = small_release(Path(args.source), args.images, work / "release")
        prep = bench_prepare(release, work, args.rounds)
        dead = bench_dead_endpoint(args.rounds)
        flaky = bench_transient(work, args.rounds)
    payload = {"images": args.images, "rounds": args.rounds, "prepare_s": prep, "dead_endpoint_s": dead,
               "write_s_per_object": flaky}
    markdown = table(args, prep, dead, flaky)
    print(markdown)
    record("storage", payload, markdown, title="Storage: costs and savings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
