"""What the search service needs, resolved and checked on the driver before any replica starts.

A config that cannot work fails here, in one line: no index at index.uri, a checkpoint that does
not load, or a checkpoint of another model than the one the index was built with (the model id,
``puma.checkpoint.checkpoint_id``, compared by ``puma.inference.search.query_model_mismatch``).
With versions (puma.index.versions) the live version is served, and its query model is the
checkpoint its manifest records (the configured one when it records none or it is gone).
An index that records no model id (built from vectors by ``puma.index.build_index``) can still be
served with ``serve.image_queries=false``: vector and item-id queries only.

index.on_disk=auto is decided here for the replicas: an IVF index whose share per replica (its
estimated bytes over the partitions) exceeds serve.index_replica_memory_gb is served from on-disk
(memory-mapped) inverted lists.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from puma import storage
from puma.config import Config, for_this_process
from puma.data.images import ViewSpec, eval_view_spec
from puma.index.manifest import Manifest, read_manifest
from puma.index.plan import IndexInputError
from puma.index.versions import read_alias, resolve
from puma.serve.errors import ServiceSetupError
from puma.serve.partitions import index_bytes, partitions_for


@dataclass
class ServicePlan:
    """The resolved service: config (absolute paths), index, model, devices."""

    cfg: Config
    manifest: Manifest
    checkpoint: str = ""  # '' when image queries are off
    view: ViewSpec | None = None  # the model's eval view for query images
    version: str = ""  # the live version served ('' for a location without versions)
    partitions: int = 1  # index partitions (serve.index_partitions, or picked from the index's size)
    partitions_reason: str = ""  # one line: the index's size and how the count was chosen

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @property
    def token_required(self) -> bool:
        """Whether this process's environment sets a token (replicas read their own environment)."""
        return bool(os.environ.get(self.cfg.serve.token_env, ""))


def plan_service(cfg: Config) -> ServicePlan:
    """Check the index and the checkpoint against each other (storage only: no Ray, no replicas)."""
    cfg = for_this_process(cfg)
    try:
        alias = read_alias(cfg.index.uri)
        manifest = read_manifest(resolve(cfg.index.uri))
    except IndexInputError as exc:
        raise ServiceSetupError(f"{exc}; embed a catalogue first: python jobs/embed.py --catalogue URI "
                                f"index.uri={cfg.index.uri}") from exc
    plan = ServicePlan(cfg, manifest, version=alias.live if alias else "")
    plan.partitions, plan.partitions_reason = partitions_for(manifest, cfg.serve.index_partitions,
                                                             cfg.serve.index_replica_memory_gb)
    plan.cfg, on_disk = lists_on_disk(cfg, manifest, plan.partitions)
    plan.partitions_reason += on_disk
    if cfg.serve.image_queries:
        plan.checkpoint, plan.view = check_model(cfg, manifest)
    return plan


def lists_on_disk(cfg: Config, manifest: Manifest, partitions: int) -> tuple[Config, str]:
    """``cfg`` with index.on_disk=auto decided (always when a replica's share of an IVF index is
    estimated above serve.index_replica_memory_gb, else never), and a note for the plan's reason line
    ('' when the lists stay in memory)."""
    mode = cfg.index.on_disk
    share = index_bytes(manifest) / max(1, partitions)
    if mode == "auto":
        mode = "always" if share > cfg.serve.index_replica_memory_gb * 1e9 else "never"
        cfg = dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, on_disk=mode))
    if mode != "always" or not manifest.nlist:
        return cfg, ""
    return cfg, (f"; IVF lists memory-mapped from local files (index.on_disk: {share / 1e9:.2f} GB a "
                 f"replica, serve.index_replica_memory_gb={cfg.serve.index_replica_memory_gb:g})")


def check_model(cfg: Config, manifest: Manifest) -> tuple[str, ViewSpec]:
    """(checkpoint URI, its eval view) for the index's model; else ServiceSetupError. A checkpoint
    given as embed.checkpoint must be that model; without one, the run's best when it is that model,
    else the checkpoint the manifest records (e.g. a newer version's model)."""
    from puma.checkpoint import configured_checkpoint

    configured = configured_checkpoint(cfg)
    try:
        return _checked_model(cfg, manifest, configured)
    except ServiceSetupError:
        recorded = manifest.checkpoint
        if cfg.embed.checkpoint or not recorded or recorded == configured or \
                not storage.exists(storage.join(recorded, "config.yaml")):
            raise
        return _checked_model(cfg, manifest, recorded)


def _checked_model(cfg: Config, manifest: Manifest, checkpoint: str) -> tuple[str, ViewSpec]:
    from puma.checkpoint import checkpoint_id, read_checkpoint  # torch: only with image queries
    from puma.inference.search import query_model_mismatch

    try:
        state = read_checkpoint(checkpoint)
    except (ValueError, OSError) as exc:  # CheckpointError, FileNotFoundError, StorageError
        raise ServiceSetupError(f"image queries need the checkpoint the index was built with: {exc}; set "
                                "embed.checkpoint=URI, or serve.image_queries=false for vector and "
                                "item-id queries only") from exc
    if not manifest.model_id:
        raise ServiceSetupError(f"index {cfg.index.uri} records no model id, so query images cannot be "
                                "checked against it; re-embed it with jobs/embed.py, or set "
                                "serve.image_queries=false for vector and item-id queries only")
    dim, query_id = state.config.model.head.embed_dim, checkpoint_id(checkpoint, state)
    try:
        mismatch = query_model_mismatch(manifest, cfg.index.uri, checkpoint, dim, query_id)
    except IndexInputError as exc:
        raise ServiceSetupError(str(exc)) from exc
    if mismatch:
        raise ServiceSetupError(f"refusing to serve: {mismatch} (embed.checkpoint=URI)")
    return checkpoint, eval_view_spec(state.config, min_size=cfg.data.min_image_size)
