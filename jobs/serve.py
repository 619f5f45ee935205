"""Serve the index online: `python jobs/serve.py [--config FILE] [key=value ...]` (Ctrl-C stops it).

A Ray Serve app over index.uri: POST /search (an image, an indexed item id or a vector; k; dataset /
catalogue filters), a web page at /, GET /stats and /healthz. Image queries are embedded by the
checkpoint the index was built with (embed.checkpoint, default <train.storage_path>/<train.run_name>/best);
another model's checkpoint is refused before Ray starts. New shards committed by jobs/embed.py are
served without a restart. A non-empty $PUMA_SERVE_TOKEN (serve.token_env) requires a bearer token.
Example: `python jobs/serve.py index.uri=artifacts/index/demo serve.port=8000`; `serve run
puma.serve.app:build config=configs/demo.yaml` deploys the same app with Ray's own CLI.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_command_line, parse_job_args  # noqa: E402

if TYPE_CHECKING:
    from puma.serve.plan import ServicePlan


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, check the index and checkpoint, start the service, print where it answers, wait."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="check the index, checkpoint and model id, print what would be served, exit")
    args = parse_command_line(parser, argv)
    if not (args.check or args.help_config or args.print_config):
        from puma.serve.run import plan_apart

        # config, storage preflight, index and checkpoint checked in a child process: what only the
        # checks load (torch, the checkpoint) leaves with it, and this process, alive as long as the
        # service, stays small
        return serve(plan_apart(args.config, args.overrides, args.verbose))
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.serve.plan import plan_service

    storage.preflight(cfg.storage, inputs=[cfg.index.uri])  # endpoint, credentials, bucket: before Ray
    plan = plan_service(cfg)
    print(f"[puma] ok: index {plan.cfg.index.uri} ({plan.manifest.total} items, model "
          f"{plan.model_id or '(none recorded)'}), checkpoint {plan.checkpoint or '(image queries off)'}")
    print(f"[puma] {plan.partitions_reason}")
    return 0


def serve(plan: ServicePlan) -> int:
    """Start the service of a checked plan, print where it answers, wait for Ctrl-C or SIGTERM."""
    from puma.serve.run import start_service, stop_service, wait_for_signal

    service = start_service(plan.cfg, plan)
    try:
        s, index = service.plan.cfg.serve, service.plan.cfg.index
        print(f"[puma] search service on {service.ray}: {service.url}  (the page; POST {service.url}search, "
              f"GET {service.url}stats, {service.url}healthz)")
        print(f"[puma] index {index.uri}: {service.plan.manifest.total} items at start, model "
              f"{service.plan.model_id or '(none recorded)'}; new shards are picked up every "
              f"{s.watch_interval_s:g} s")
        print(f"[puma] {service.plan.partitions_reason}; ingress: {s.ingress}")
        print(f"[puma] metrics for Prometheus: {service.metrics or '(this node exports none)'} "
              "(Ray's, Ray Serve's and the service's: ray_puma_*)")
        print(f"[puma] bearer token: {'required' if service.plan.token_required else 'not required'} "
              f"(${s.token_env}); image queries: {'on' if s.image_queries else 'off'}; Ctrl-C stops it",
              flush=True)
        wait_for_signal()
    finally:
        stop_service(service)
    print("[puma] search service stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
