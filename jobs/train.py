"""Train PUMA with Ray Train: `python jobs/train.py [--config FILE] [key=value ...]`.

With no arguments it runs the embedded default (configs/demo.yaml): a local Ray, local storage,
the sample data, the offline backbone, and a before/after table of Recall@1.
On a cluster: `ray job submit --working-dir . -- python jobs/train.py --config FILE ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, train, print where the outputs went and the before/after table."""
    args, cfg = parse_job_args(job_parser(__doc__.splitlines()[0]), argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.runtime import init_ray, joins_cluster
    from puma.train.driver import check_inputs, check_placement, check_placement_before_ray, run_training
    from puma.train.report import recall_table

    storage.preflight(cfg.storage, inputs=[cfg.model.backbone.weights],  # before Ray: one-line errors
                      outputs=[cfg.data.uri, cfg.data.source_root, cfg.train.storage_path,
                               cfg.data.rejects_uri])
    check_inputs(cfg)  # a config or weights file that cannot work fails before Ray starts
    check_placement_before_ray(cfg)  # so does a worker group a local Ray could never hold
    print(f"[puma] Ray: {init_ray()}", flush=True)
    check_placement(cfg, local=not joins_cluster())  # a worker group that can never start: said now
    outcome = run_training(cfg)
    print(recall_table(outcome.metrics))
    print(f"[puma] run directory:   {outcome.run_uri}")
    print(f"[puma] best checkpoint: {outcome.best_checkpoint}")
    print(f"[puma] last checkpoint: {outcome.last_checkpoint}")
    if "run/resumes" in outcome.metrics:
        print(f"[puma] recoveries:      {outcome.metrics['run/resumes']} resume(s), "
              f"{outcome.metrics['run/recomputed_epochs']} epoch(s) trained twice")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
