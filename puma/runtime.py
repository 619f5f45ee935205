"""Starting or joining Ray for the jobs: how a driver attaches to a cluster, and what of Ray's own
output reaches the console.

By default (quiet) the console shows our lines and progress only: Ray's driver-side logs below
ERROR, Ray Data's console logs, Ray's Python warnings, and everything the workers write that is not
ours (actor start-up messages, Ray Train and Ray Data INFO/WARNING lines, C++ core-worker logs,
library banners) stay in Ray's session logs, whose folder the driver names. Lines of the
autoscaler (a resource request no node can meet) still show. ``--verbose`` shows all of it again.

Worker output still flows to the driver (``log_to_driver``); :func:`route_worker_output` takes
our lines and progress events out of it (:func:`puma.console.take_remote_line`) and hands the rest
to Ray's own printer only in verbose mode.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
import warnings

from puma import console
from puma.errors import UserError, one_line

# Environment of every Ray worker of a job started here (unless the job's own runtime env sets it):
# progress leaves workers as events for the driver; Ray Train's print patch (which writes every
# print() of a Train worker twice, to stdout and to a logger on stderr) stays off.
WORKER_ENV = {console.CONSOLE_ENV: "events", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # Ray's own variable: the local head's GCS port (0/unset: any free one)
CONNECT_TIMEOUT_S = 5.0
# Cluster messages that say nothing a user can act on: Ray's raylet warns whenever more Python workers
# start than physical cores, which fractional-CPU actors and tasks (our design on small machines) do.
BENIGN_CLUSTER_MESSAGES = ("PYTHON worker processes have been started on node",)


class RayStartError(UserError):
    """Ray could not be started or joined (no cluster at RAY_ADDRESS, a port in use); says what to do."""


def worker_env() -> dict[str, str]:
    """What the job's Ray workers get in their environment: WORKER_ENV (unless the driver's environment
    sets it) and the driver's fault-injection variables (puma/faults.py), which a `ray start` cluster's
    workers would not inherit."""
    env = {k: v for k, v in WORKER_ENV.items() if k not in os.environ}
    return env | {k: v for k, v in os.environ.items() if k.startswith("PUMA_FAULT_")}


def init_ray(local_cpus: int | None = None, verbose: bool | None = None, metrics_port: int = 0) -> str:
    """Join the cluster named by RAY_ADDRESS (as ``ray job submit`` sets it) or start a local one.

    A local Ray binds to 127.0.0.1 only and gets at least 4 logical CPUs, so Train workers with
    fractional CPUs can never starve Ray Data's read and decode tasks on a 2-core machine.
    ``verbose`` (default: the job's ``--verbose``) lets Ray's own output through to the console.
    ``metrics_port``: a local Ray's metrics export port (0: a free one; a cluster's nodes set theirs with
    ``ray start --metrics-export-port``). Returns a short description of where the driver is attached.
    """
    import ray

    if ray.is_initialized():
        return "already initialised"
    verbose = console.is_verbose() if verbose is None else verbose
    quiet_ray_logging(verbose)
    options = {"log_to_driver": True, "logging_level": logging.INFO if verbose else logging.ERROR,
               "runtime_env": {"env_vars": worker_env()}}
    address = os.environ.get("RAY_ADDRESS")
    if joins_cluster():
        check_cluster_address(address)
        try:
            ray.init(address=address, **options)
        except ConnectionError as exc:
            raise RayStartError(f"no Ray cluster at RAY_ADDRESS={address}: {one_line(exc)}; start one "
                                "(`ray start --head`) or unset RAY_ADDRESS for a local Ray") from exc
        where = f"cluster at {address}"
    else:
        check_local_ports()
        cpus = local_cpus or default_local_cpus()
        temp_dir = os.environ.get("PUMA_RAY_TMP", os.path.join(tempfile.gettempdir(), "ray-puma"))
        check_temp_dir(temp_dir)
        try:
            ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir,
                     _metrics_export_port=metrics_port or None, **options)
        except RuntimeError as exc:
            raise _start_error(exc) from exc
        where = f"local Ray ({cpus} logical CPUs)"
    route_worker_output(verbose)
    logs = _session_logs()
    return where + (f"; Ray's own logs: {logs} (--verbose shows them here)" if logs and not verbose else "")


def default_local_cpus() -> int:
    """Logical CPUs of the local Ray that init_ray starts: the machine's, and at least 4."""
    return max(4, os.cpu_count() or 1)


def local_node_resources() -> dict[str, float]:
    """What the local Ray that init_ray starts will offer, known before it starts: its logical CPUs
    and the GPUs CUDA makes visible (Ray counts the same ones)."""
    import torch

    resources = {"CPU": float(default_local_cpus())}
    if torch.cuda.is_available() and torch.cuda.device_count():
        resources["GPU"] = float(torch.cuda.device_count())
    return resources


def joins_cluster() -> bool:
    """Whether init_ray joins a running cluster (RAY_ADDRESS, as `ray job submit` sets it) rather than
    starting a local Ray."""
    return bool(os.environ.get("RAY_ADDRESS"))


def check_cluster_address(address: str) -> None:
    """Fail in seconds, not after Ray's five-minute wait, when nothing listens at RAY_ADDRESS."""
    if address in ("auto", "local"):
        return  # Ray finds (or refuses) these itself, quickly
    scheme, _, rest = address.rpartition("://")
    if scheme in ("http", "https"):
        raise RayStartError(f"RAY_ADDRESS={address} is a dashboard (Jobs API) address: give it to "
                            "`ray job submit --address`, or set RAY_ADDRESS to the cluster's GCS address "
                            "host:6379, or unset it for a local Ray")
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise RayStartError(f"RAY_ADDRESS={address!r} is not host:port (e.g. 10.0.0.5:6379); "
                            "unset it to start a local Ray")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise RayStartError(f"no Ray cluster at RAY_ADDRESS={address} ({exc.strerror or exc}): start one "
                            f"there (`ray start --head --port={port}`) or unset RAY_ADDRESS for a local "
                            "Ray") from exc


# Ray's Unix sockets live at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store: 64 bytes
# after the folder with a 7-digit pid, and a socket path holds at most 107 bytes
MAX_TEMP_DIR = 107 - 64


def check_temp_dir(temp_dir: str) -> None:
    """The local Ray's temp folder must leave room for its socket paths: say so before Ray tries."""
    path = os.path.abspath(temp_dir)
    if len(path.encode()) > MAX_TEMP_DIR:
        raise RayStartError(f"PUMA_RAY_TMP={path} is {len(path.encode())} bytes long: the local Ray's socket "
                            f"paths below it would pass the 107-byte limit of Unix sockets; give a folder "
                            f"of at most {MAX_TEMP_DIR} bytes (the default is /tmp/ray-puma)")


def check_local_ports() -> None:
    """A fixed port for the local Ray (RAY_GCS_SERVER_PORT) must be free: say so before Ray tries."""
    port = os.environ.get(GCS_PORT_ENV, "")
    if not port.strip() or port.strip() == "0":
        return
    if not port.strip().isdigit():
        raise RayStartError(f"{GCS_PORT_ENV}={port!r} is not a port number; unset it to let Ray pick one")
    with socket.socket() as s:
        try:
            s.bind(("", int(port)))
        except OSError as exc:
            raise RayStartError(f"port {port} ({GCS_PORT_ENV}) is in use ({exc.strerror}): stop what holds "
                                f"it, or unset {GCS_PORT_ENV} to let Ray pick a free port") from exc


def _start_error(exc: RuntimeError) -> Exception:
    """Ray's start-up failure as a one-line RayStartError when it is a port in use, else as it was."""
    text = str(exc)
    if "Address already in use" in text or "The specified port is" in text:
        return RayStartError(f"the local Ray could not bind a port (in use): {one_line(exc)[:300]}; "
                             f"stop what holds it or unset {GCS_PORT_ENV}")
    return exc


def quiet_ray_logging(verbose: bool) -> None:
    """Driver side: Ray's loggers and Ray Data's console at ERROR, Ray's Python warnings off (not verbose)."""
    import ray.data  # configures its own logger on import: adjust it after

    level = logging.INFO if verbose else logging.ERROR
    logging.getLogger("ray").setLevel(level)
    for handler in logging.getLogger("ray.data").handlers:  # Ray Data's file log keeps every level
        if handler.get_name() == "console":
            handler.setLevel(level)
    ray.data.DataContext.get_current().enable_progress_bars = verbose  # ours show instead
    if not verbose:
        warnings.filterwarnings("ignore", module=r"ray(\.|$)")


def route_worker_output(verbose: bool) -> None:
    """Take our lines and progress events out of the workers' forwarded output; the rest only if verbose.

    Uses Ray's internal dispatcher of forwarded output (Ray is pinned; tests/test_console.py checks
    the console end to end); another Ray without it keeps its own printing.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    if not verbose:
        _patch_cluster_messages()
    ray_printer = dict(dispatcher.handlers).get("ray_print_logs")
    if ray_printer is None or getattr(ray_printer, "func", None) is _route:
        return
    dispatcher.remove_handler("ray_print_logs")  # same name: ray.shutdown() removes ours
    dispatcher.add_handler("ray_print_logs", functools.partial(_route, ray_printer, verbose))


def _route(ray_printer, verbose: bool, data: dict) -> None:
    """One batch of forwarded worker lines: ours to the console, the rest to Ray's printer or away."""
    rest = [line for line in data.get("lines", []) if not console.take_remote_line(line)]
    if rest and (verbose or data.get("pid") == "autoscaler"):
        with console.outside_bar():
            ray_printer({**data, "lines": rest})


def _patch_cluster_messages() -> None:
    """Drop the cluster's known-benign messages from the console (quiet mode), keep the rest.

    Ray prints the cluster's error channel (out-of-memory kills, resource requests no node can
    meet, crashed workers) through ``ray._private.worker.print_to_stdstream``, not through the
    forwarded worker output; only :data:`BENIGN_CLUSTER_MESSAGES` are dropped from it.
    """
    from ray._private import worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "puma_filter", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        lines = [line for line in data.get("lines", []) if not _benign(line)]
        if lines:
            with console.outside_bar():
                original({**data, "lines": lines}, ignore_prefix)

    print_to_stdstream.puma_filter = True
    ray_worker.print_to_stdstream = print_to_stdstream


def _benign(line: str) -> bool:
    return any(message in line for message in BENIGN_CLUSTER_MESSAGES)


def _session_logs() -> str:
    """The local Ray session's log folder ('' when unknown)."""
    try:
        import ray

        node = ray._private.worker._global_node
        return os.path.join(node.get_session_dir_path(), "logs") if node is not None else ""
    except (AttributeError, ImportError):
        return ""


def metrics_url() -> str:
    """Where this node's Ray exports its metrics for Prometheus (Ray's, Serve's, ours: ray.util.metrics)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return ""
