"""Real Ray clusters on this machine for tests: `ray start --head` and more nodes joining it.

Each node is a `ray start --block` process in a session of its own (its GCS, raylet, agents and
workers below it), on 127.0.0.1, with every port free-picked (another Ray on the machine may hold
the defaults) and Ray 2.60's token auth on, as in production. A node is stopped or killed by
signalling its own process group (`ray stop` would stop every Ray on the machine), bounded in time.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PYTHON = sys.executable
RAY_BIN = str(Path(PYTHON).parent / "ray")
HEAD_ATTEMPTS = 5  # a raylet can abort in its fixed 15 s wait for the agent under load (ray#65983)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env() -> dict:
    """The environment of every node and driver of one cluster: a fresh auth token, this venv first."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # Ray 2.60 token auth
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this venv's
    return env


@dataclass
class RayHead:
    """A running `ray start --head` cluster: dashboard (Jobs API) and GCS addresses, its env and pid."""

    address: str  # http://127.0.0.1:<dashboard port>
    gcs: str  # 127.0.0.1:<gcs port>, for RAY_ADDRESS
    ray_bin: str
    env: dict
    pid: int
    temp: Path


def _agent_ports() -> list[str]:
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


def _resources(resources: dict | None) -> list[str]:
    return [f"--resources={json.dumps(resources)}"] if resources else []


def start_head(env: dict, temp: Path, cpus: int = 4, resources: dict | None = None) -> RayHead | None:
    """`ray start --head`, up once its raylet started and the dashboard answers; None if it died.

    Up means the raylet logged "Raylet of id ... started" (past its wait for the dashboard agent's
    port files, a fixed 15 s in Ray 2.60: on a loaded machine the raylet can abort there and take the
    head down, ray-project/ray#65983) and the dashboard answers.
    """
    gcs, dash = free_port(), free_port()
    temp.mkdir(parents=True, exist_ok=True)
    head = subprocess.Popen([RAY_BIN, "start", "--head", "--block", f"--port={gcs}",
                             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dash}", f"--num-cpus={cpus}", f"--temp-dir={temp}",
                             *_resources(resources), *_agent_ports(), "--disable-usage-stats"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    if _raylet_up(head, temp, timeout=180, url=f"http://127.0.0.1:{dash}/api/version"):
        return RayHead(f"http://127.0.0.1:{dash}", f"127.0.0.1:{gcs}", RAY_BIN, env, head.pid, temp)
    stop_node(head)
    return None


def short_temp(prefix: str = "rn") -> Path:
    """A fresh folder under /tmp with a short name: Ray's socket paths below it must stay < 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_head_with_retries(env: dict, temp_factory=short_temp, cpus: int = 4,
                            resources: dict | None = None) -> RayHead:
    """start_head, started again when it dies on the way (at most HEAD_ATTEMPTS times)."""
    for _ in range(HEAD_ATTEMPTS):
        temp = temp_factory()
        head = start_head(env, temp, cpus, resources)
        if head is not None:
            return head
    raise AssertionError(f"ray start --head did not come up in {HEAD_ATTEMPTS} attempts; see {temp}")


def start_node(head: RayHead, cpus: int = 4, resources: dict | None = None,
               attempts: int = HEAD_ATTEMPTS) -> subprocess.Popen:
    """A worker node joining ``head`` (its own raylet, node id and resources); up once its raylet started."""
    for _ in range(attempts):
        temp = short_temp("rw")
        node = subprocess.Popen([RAY_BIN, "start", "--block", f"--address={head.gcs}",
                                 "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--temp-dir={temp}",
                                 *_resources(resources), *_agent_ports(), "--disable-usage-stats"],
                                env=head.env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if _raylet_up(node, temp, timeout=180):
            return node
        stop_node(node)
    raise AssertionError(f"a worker node did not join {head.gcs} in {attempts} attempts; see {temp}")


def _raylet_up(proc: subprocess.Popen, temp: Path, timeout: float, url: str = "") -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        logs = list(temp.glob("session_latest/logs/raylet.out"))
        started = bool(logs) and "Raylet of id" in logs[0].read_text(errors="replace")
        if started and (not url or answers(url)):
            time.sleep(1.0)
            return proc.poll() is None
        time.sleep(0.5)
    return False


def stop_node(proc: subprocess.Popen | int, sig: int = signal.SIGKILL, timeout: float = 60) -> None:
    """Signal a node's process group (its raylet, agents and workers too); wait for `ray start` to exit.

    SIGKILL by default: on SIGTERM `ray start` first asks the GCS to drain the node, and the GCS, sent
    SIGTERM at the same moment, is gone, so it waits 30 s for nothing.
    """
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            proc.wait(timeout=timeout)


def kill_node(proc: subprocess.Popen) -> list[int]:
    """SIGKILL a node as a lost machine: its process group (raylet, workers) and every process below it
    that left the group (a worker in its own session would otherwise train on until it noticed its
    raylet was gone, and a rank could finish an epoch the test means to interrupt); their pids."""
    doomed = {p for p in _pids() if _pgid(p) == proc.pid} | _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    return sorted(doomed)


def _descendants(root: int) -> set[int]:
    """PIDs whose parent chain reaches ``root`` (from /proc)."""
    parents = {}
    for pid in _pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
        return True
    except OSError:
        return False


_NODES_SCRIPT = """
import json, ray
ray.init(logging_level="ERROR", log_to_driver=False)
nodes = [{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]
print(json.dumps(nodes))
"""


def gcs_nodes(head: RayHead, timeout: float = 90) -> list[dict]:
    """The cluster's nodes as its GCS holds them (id, alive, resources), from a short driver of its own."""
    out = subprocess.run([PYTHON, "-c", _NODES_SCRIPT], env=dict(head.env, RAY_ADDRESS=head.gcs),
                         capture_output=True, text=True, timeout=timeout, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ray_stacks(names: tuple[str, ...] = ("RayTrainWorker", "TrainController", "SplitCoordinator"),
               lines: int = 40) -> str:
    """py-spy dumps (py-spy comes with Ray) of this machine's Ray processes whose title names one of
    ``names``: where a stalled run waits. Each cut to its first ``lines`` lines."""
    spy, dumps = Path(PYTHON).parent / "py-spy", []
    for pid in _pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::") and any(n in title for n in names):
            try:
                out = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True,
                                     timeout=30)
                text = out.stdout or out.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
            dumps.append(f"--- {pid} {title[:80]}\n" + "\n".join(text.splitlines()[:lines]))
    return "\n".join(dumps) or "(no Ray Train process on this machine)"


def cluster_report(head: RayHead, timeout: float = 60) -> str:
    """What a failed multi-node test should show: the GCS's nodes, `ray status` (resources, demands) and
    where Ray Train's processes wait."""
    parts = []
    try:
        nodes = gcs_nodes(head, timeout)
        parts.append("nodes: " + "; ".join(
            f"{n['id'][:8]} {'alive' if n['alive'] else 'DEAD'} "
            f"{ {k: v for k, v in n['resources'].items() if not k.startswith('node:')} }" for n in nodes))
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        parts.append(f"nodes: not read ({type(exc).__name__})")
    try:
        status = subprocess.run([RAY_BIN, "status", f"--address={head.gcs}"], env=head.env,
                                capture_output=True, text=True, timeout=timeout)
        parts.append(status.stdout[-2000:] or status.stderr[-1000:])
    except subprocess.TimeoutExpired:
        parts.append(f"`ray status` did not answer in {timeout:.0f}s")
    parts.append(ray_stacks())
    return "\n".join(parts)
