"""Start the search service from a driver (jobs/serve.py, bench/bench_serve.py), wait, stop it.

The plan (index, checkpoint, model id, index partitions) is checked before Ray starts; then the
driver joins the cluster named by RAY_ADDRESS or starts a local one on 127.0.0.1
(puma.runtime.init_ray) and deploys the app (puma.serve.app) on serve.host:serve.port.

How traffic reaches the ingress: with serve.ingress=direct (the default) the ingress replica itself
listens on serve.port (Ray Serve's direct ingress: no proxy hop; one ingress replica per node; Ray
still runs one HTTP proxy, on the head node, which this puts on serve.port + 1). Ray reads that mode
from its environment when the cluster starts: a local Ray started here gets direct_ingress_env; a
cluster (``ray start``) must set the same variables on its nodes, else Serve's HTTP proxy answers on
serve.port + 1 only. The KubeRay RayService (infra/base/rayservice.yaml) uses serve.ingress=proxy:
KubeRay routes its Service to the pods whose proxy is healthy.

The driver stays small while the service runs (it lives as long as the service): jobs/serve.py makes
the plan in a child process (``plan_apart``), so what only the checks load (torch and every method
module while the config resolves, the checkpoint read for the model check: about 0.7 GB) leaves with
that process, and the driver keeps Ray's client and the plan.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from puma import storage
from puma.config import Config, ServeConfig
from puma.errors import one_line, user_error
from puma.serve.errors import ServiceSetupError
from puma.serve.plan import ServicePlan, plan_service


@dataclass
class RunningService:
    """A deployed service: where it answers, what it serves, where Ray runs."""

    url: str  # http://host:port/ (the page; POST search, GET stats, healthz, image)
    plan: ServicePlan
    metrics: str  # http://host:port/metrics of the driver's node: Ray's, Serve's and the service's metrics
    ray: str  # puma.runtime.init_ray's description
    local_ray: bool  # this driver started the Ray cluster (and stops it)


def plan_apart(config: str | None, overrides: list[str], verbose: bool = False) -> ServicePlan:
    """The service's plan (``--config`` and overrides resolved, storage preflight, index and checkpoint
    checked) made in a child process, which takes with it what only the checks loaded; a user's error
    there is raised here, in one line."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_plan, config, overrides, verbose).result()


def _plan(config: str | None, overrides: list[str], verbose: bool) -> ServicePlan:
    """(In the child) resolve the config as jobs do, check storage, plan; errors sent back picklable."""
    import argparse

    from puma import console
    from puma.cli import resolve_config

    console.set_verbose(verbose)
    try:
        cfg = resolve_config(argparse.Namespace(config=config, overrides=overrides))
        storage.preflight(cfg.storage, inputs=[cfg.index.uri])
        return plan_service(cfg)
    except Exception as exc:
        found = user_error(exc)
        if found is None or _picklable(found):
            raise
        raise ServiceSetupError(one_line(found)) from None


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means: send a plain error instead
        return False
    return True


def start_service(cfg: Config, plan: ServicePlan | None = None) -> RunningService:
    """Check (unless given the ``plan``: see ``plan_apart``), start Ray and Serve, deploy; returns once
    every deployment is ready."""
    if plan is None:
        plan = plan_service(cfg)
    else:
        storage.configure_once(plan.cfg.storage)
    s = plan.cfg.serve
    local = not os.environ.get("RAY_ADDRESS")
    if local:
        for port in {s.port, proxy_port(s)}:
            check_port_free(s.host, port)
    from ray import serve

    from puma.runtime import init_ray, metrics_url
    from puma.serve.app import build_app

    if local:
        os.environ.update(direct_ingress_env(s))
    where = init_ray(metrics_port=s.metrics_port)
    serve.start(http_options={"host": s.host, "port": proxy_port(s)})
    serve.run(build_app(plan), name=s.app_name, route_prefix="/",
              logging_config={"enable_access_log": s.access_log})
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    return RunningService(f"http://{host}:{s.port}/", plan, metrics_url(), where, local)


def direct_ingress_env(s: ServeConfig) -> dict[str, str]:
    """Ray Serve's settings for serve.ingress (set before the cluster starts): direct ingress with the
    ingress replicas' ports starting at serve.port (the first replica on a node gets serve.port), and a
    short drain on a local machine (Ray's default of 30 s waits for cloud load balancers)."""
    if s.ingress != "direct":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(s.port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(s.port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def proxy_port(s: ServeConfig) -> int:
    """Where Serve's HTTP proxy listens: serve.port, or with direct ingress (where Ray keeps one proxy,
    on the head node, besides the replicas' own servers) the port after it, leaving serve.port to the
    ingress replica."""
    return s.port + 1 if s.ingress == "direct" else s.port


def stop_service(service: RunningService) -> None:
    """Delete the app; on a Ray this driver started, shut Serve and Ray down too."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if service.local_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(service.plan.cfg.serve.app_name)


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM (main thread only); returns the signal number."""
    stop, got = threading.Event(), []

    def handler(signum, _frame) -> None:
        got.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return got[0]


def check_port_free(host: str, port: int) -> None:
    """Refuse, before Ray starts, a port that something else already listens on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServiceSetupError(f"cannot listen on {host}:{port} ({exc.strerror}); set serve.port to a "
                                    "free port or serve.host to an address of this machine") from exc
