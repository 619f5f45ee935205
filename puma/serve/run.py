"""Start the search service from a driver (jobs/serve.py, bench/bench_serve.py), wait, stop it.

The plan (index, checkpoint, model id) is checked before Ray starts; then the driver joins the
cluster named by RAY_ADDRESS or starts a local one on 127.0.0.1 (puma.runtime.init_ray), starts
Serve's HTTP proxy on serve.host:serve.port and deploys the app (puma.serve.app).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass

from puma.config import Config
from puma.serve.errors import ServiceSetupError
from puma.serve.plan import ServicePlan, plan_service


@dataclass
class RunningService:
    """A deployed service: where it answers, what it serves, where Ray runs."""

    url: str  # http://host:port/ (the page; POST search, GET stats, healthz, image)
    plan: ServicePlan
    ray: str  # puma.runtime.init_ray's description
    local_ray: bool  # this driver started the Ray cluster (and stops it)


def start_service(cfg: Config) -> RunningService:
    """Check, start Ray and Serve, deploy; returns once every deployment is ready."""
    plan = plan_service(cfg)
    s = plan.cfg.serve
    local = not os.environ.get("RAY_ADDRESS")
    if local:
        check_port_free(s.host, s.port)
    from ray import serve

    from puma.runtime import init_ray
    from puma.serve.app import build_app

    where = init_ray()
    serve.start(http_options={"host": s.host, "port": s.port})
    serve.run(build_app(plan), name=s.app_name, route_prefix="/",
              logging_config={"enable_access_log": s.access_log})
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    return RunningService(f"http://{host}:{s.port}/", plan, where, local)


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
