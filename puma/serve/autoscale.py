"""How the index partitions autoscale: Serve's own rule (replicas = ongoing requests /
serve.target_ongoing_requests) over the requests Serve sees, the ones through the deployment
handles, plus those on the partitions' direct channel (puma.serve.channel), which Serve does not
see: each replica reports its channel's mean requests in flight (``record_autoscaling_stats``).
Serve applies min/max replicas and its up- and downscale delays around this.

Serve pickles this module by value for its controller: keep it free of puma imports.
"""

from __future__ import annotations

CHANNEL_ONGOING = "channel_ongoing"  # the custom metric a partition replica reports


def partition_replicas(ctx) -> tuple[float, dict]:
    """Replicas a partition wants (a ray.serve.config.AutoscalingContext in): (handle requests +
    channel requests in flight, over all replicas) / target per replica."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    channel = sum((ctx.aggregated_metrics or {}).get(CHANNEL_ONGOING, {}).values())
    return (ctx.total_num_requests + channel) / ctx.config.get_target_ongoing_requests(), {}
