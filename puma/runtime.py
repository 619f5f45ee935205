"""Starting or joining Ray for the jobs: one place for how a driver attaches to a cluster."""

from __future__ import annotations

import os
import tempfile


def init_ray(local_cpus: int | None = None) -> str:
    """Join the cluster named by RAY_ADDRESS (as ``ray job submit`` sets it) or start a local one.

    A local Ray binds to 127.0.0.1 only and gets at least 4 logical CPUs, so Train workers with
    fractional CPUs can never starve Ray Data's read and decode tasks on a 2-core machine.
    Returns a short description of where the driver is attached.
    """
    import ray

    if ray.is_initialized():
        return "already initialised"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return f"cluster at {address}"
    cpus = local_cpus or max(4, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=os.environ.get("PUMA_RAY_TMP", os.path.join(tempfile.gettempdir(), "ray-puma")))
    return f"local Ray ({cpus} logical CPUs)"
