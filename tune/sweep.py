"""Sweep PUMA hyperparameters with Ray Tune: `python tune/sweep.py [--config F] [--space F] [key=value ...]`.

Optuna TPE (seeded) proposes values for the search space (default tune/search_space.yaml: adapter
rank r, keep probability p, prompt pool size M, prompt length Np, learning rate); ASHA stops weak
trials at epoch rungs. Each trial runs the jobs/train.py training path on the training classes
minus a held-out validation part (sweep.val_fraction) and is scored there (sweep.metric, default
harmonic/r@1); the test split is never used for selection. Sweep options are the sweep.* keys
(`--help-config`). Re-running the same command resumes an interrupted sweep; finished trials are
kept. Results go to <sweep.storage_path>/<sweep.name>/results (storage_path defaults to
<train.storage_path>/sweeps; each trial gets its own run_name and storage_path under the sweep):
trials.csv, trials.md, best_config.yaml (for jobs/train.py --config), optimization_history.png,
param_importances.png.
On a cluster (storage must be shared, e.g. S3):
`ray job submit --working-dir . -- python tune/sweep.py train.storage_path=s3://BUCKET/runs sweep.name=NAME`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Validate the space, run or resume the sweep, print the table and where the results went."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--space", help="search-space YAML (same as sweep.space_file=FILE)")
    args, cfg = parse_job_args(parser, argv, as_given=True)  # plan_sweep resolves it; best_config keeps it
    if cfg is None:
        return 0
    from puma import storage
    from puma.sweep import plan_sweep, run_sweep

    if args.space:
        cfg = dataclasses.replace(cfg, sweep=dataclasses.replace(cfg.sweep, space_file=args.space))
    storage.preflight(cfg.storage, inputs=[cfg.sweep.space_file, cfg.model.backbone.weights],
                      outputs=[cfg.data.uri, cfg.sweep.storage_path, cfg.train.storage_path])
    plan = plan_sweep(cfg)  # every check that needs no Ray: nothing starts if this fails
    from puma.runtime import init_ray, joins_cluster
    from puma.train.driver import check_placement, check_placement_before_ray

    check_placement_before_ray(cfg)  # a trial's worker group a local Ray could never hold: said now
    print(f"[puma.sweep] Ray: {init_ray()}", flush=True)
    check_placement(cfg, local=not joins_cluster())  # each trial's worker group must fit the cluster
    outcome = run_sweep(plan)
    print(storage.read_text(outcome.files["trials.md"]))
    for name, uri in outcome.files.items():
        print(f"[puma.sweep] {name}: {uri}")
    for note in outcome.notes:
        print(f"[puma.sweep] note: {note}")
    return 0 if outcome.best is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
