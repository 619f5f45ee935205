"""Give back the placement groups of Ray Train runs that Tune stopped part-way.

When ASHA stops a trial, Tune kills the trial's actor and with it the Ray Train controller inside it;
the controller's worker-group placement group (``train.num_workers`` bundles of
``train.cpus_per_worker`` CPUs) is job-scoped, so it outlives them. Ray 2.60 hands its removal to a
PlacementGroupCleaner actor that asks the State API whether the controller is alive; on a local
Ray started without the dashboard (ours), or with several Ray instances on one machine, that query
fails forever ("Failed to query Ray Train Controller actor state ... Continuing to monitor") and
the CPUs stay reserved: on a 4-CPU local Ray the next trial then waits for a worker group that can
never start (WorkerGroupStartupTimeoutError every 60 s). This Tune callback removes such placement
groups on the driver when a trial ends and no other trial is running (so none of them can be a
live run's), keeping Tune's own trial placement groups.
"""

from __future__ import annotations

from ray import tune

from puma import console


class ReleaseStoppedTrainGroups(tune.Callback):
    """After a trial ends with no other trial running, remove the worker-group placement groups left."""

    @classmethod
    def for_config(cls, cfg) -> ReleaseStoppedTrainGroups:
        """The worker-group shape of ``cfg``'s training runs (puma.train.driver.scaling_config)."""
        gpus = cfg.train.gpus_per_worker if cfg.train.use_gpu else 0
        bundle = {"CPU": cfg.train.cpus_per_worker, "GPU": gpus}
        return cls(bundle, cfg.train.num_workers)

    def __init__(self, worker_bundle: dict[str, float], num_workers: int) -> None:
        self.worker_bundle = {k.upper(): float(v) for k, v in worker_bundle.items() if v}
        self.num_workers = num_workers
        self.released = 0

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._release(trials, trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._release(trials, trial)

    def _release(self, trials, ended) -> None:
        if any(t is not ended and t.status == "RUNNING" for t in trials):
            return  # another run's worker group may be among them
        for pg_id in leftover_worker_groups(self.worker_bundle, self.num_workers):
            remove(pg_id)
            self.released += 1
            if console.is_verbose():
                console.say(f"released placement group {pg_id[:12]} of a stopped trial's training run",
                            tag="[puma.sweep]")


def leftover_worker_groups(worker_bundle: dict[str, float], num_workers: int) -> list[str]:
    """Ids of created placement groups shaped like a Ray Train worker group of this sweep."""
    from ray.util.placement_group import placement_group_table

    found = []
    for pg_id, info in placement_group_table().items():
        bundles = [{k.upper(): float(v) for k, v in b.items() if k.upper() in ("CPU", "GPU")}
                   for b in info["bundles"].values()]
        if info["state"] == "CREATED" and len(bundles) == num_workers and all(
                b == worker_bundle for b in bundles):
            found.append(pg_id)
    return found


def remove(pg_id: str) -> None:
    """Remove the placement group with hex id ``pg_id``."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
