"""The Ray Serve application of the search service: which deployments it has, their options, and the
app builder; each deployment lives in its own module.

    HTTP --> SearchIngress   puma.serve.ingress: FastAPI routes; bearer token, body limits, request
                             parsing (puma.serve.http, puma.serve.requests); pins every request to one
                             version (model + index) of the location (puma.serve.versions).
                             With serve.ingress=direct it listens on serve.port itself (no proxy).
               |--> QueryModel      puma.serve.query_model: the version's checkpoint's model;
               |                    @serve.batch: images that arrive together share one forward; on a
               |                    GPU when there is one
               |    LocalIndex      serve.index_partitions=1: the whole index in the ingress replica
               |                    (puma.serve.holders): vector and item-id queries never leave it
               '--> IndexPartition  serve.index_partitions=N>1: N deployments, each holding its
                    x N             shards (puma.serve.holders, puma.serve.partitions; faiss-gpu when on a
                                    GPU); a query fans out to all and their top-k are merged exactly
                                    (puma.serve.fanout), over each replica's direct TCP channel
                                    (puma.serve.channel; with serve.partition_channel=ray through
                                    deployment handles)

Every replica holding index shards watches the manifest (serve.watch_interval_s) and loads new
shards without a restart.

A new model goes live without a restart: when the location's alias names a new version, the
ingress's watcher asks the model and index to load it beside the old one and only then
pins new requests to it, so a query is always embedded and searched by one model; requests already
running finish on the old version, which the replicas drop after serve.version_grace_s. Every
response names the version and model id that answered.

QueryModel and each IndexPartition autoscale between serve.*_min_replicas and serve.*_max_replicas
on ongoing requests (serve.target_ongoing_requests). An ingress replica works on
serve.max_ongoing_requests at once and queues serve.max_queued_requests more; beyond that a request
gets 503 with Retry-After at once.

``build`` is the app builder for ``serve run`` and for a KubeRay RayService (import path
``puma.serve.app:build``; args: ``config`` = a YAML file, plus dotted config keys).
"""

from __future__ import annotations

import dataclasses
import math
import secrets

from ray.serve import Application

from puma import storage
from puma.config import Config
from puma.serve.autoscale import partition_replicas
from puma.serve.fanout import PartitionedIndex
from puma.serve.holders import IndexPartition
from puma.serve.ingress import SearchIngress
from puma.serve.partitions import Partition
from puma.serve.plan import ServicePlan, plan_service
from puma.serve.query_model import QueryModel
from puma.serve.requests import Limits
from puma.serve.versions import Pinned

# the builders, and the classes their callers imported from here (each defined in its own module)
__all__ = ["IndexPartition", "PartitionedIndex", "QueryModel", "SearchIngress", "build", "build_app",
           "deployment_options", "gpus_wanted"]


def build_app(plan: ServicePlan) -> Application:
    """The application for a checked plan: the model deployment, and the index in the ingress or in
    plan.partitions partition deployments, behind the HTTP ingress."""
    cfg, s = plan.cfg, plan.cfg.serve
    use_gpu = gpus_wanted(cfg)
    options = deployment_options(cfg, use_gpu)
    index_cfg = dataclasses.replace(cfg.index, use_gpu=cfg.index.use_gpu and use_gpu)
    index_args = {"index_cfg": index_cfg, "dim": plan.manifest.dim, "storage_cfg": storage.current_config(),
                  "watch_interval_s": s.watch_interval_s, "grace_s": s.version_grace_s, "metrics": s.metrics}
    partitions = None
    # the partitions' direct channels admit the holders of this app's token (a new one per build)
    token = secrets.token_urlsafe(24) if plan.partitions > 1 and s.partition_channel == "direct" else ""
    if plan.partitions > 1:
        threads = max(2, math.ceil(s.index_num_cpus))  # FAISS releases the GIL: searches overlap
        partitions = [IndexPartition.options(**options["index"], name=f"index-{p}").bind(
            **index_args, partition=Partition(p, plan.partitions), channel_token=token,
            channel_threads=threads) for p in range(plan.partitions)]
    model = None
    if s.image_queries:
        model = QueryModel.options(**options["model"]).bind(
            plan.checkpoint, cfg.embed.backbone_weights, storage.current_config(), use_gpu,
            max(1, int(s.model_num_cpus)), s.max_batch_size, s.batch_wait_timeout_s, cfg.data.min_image_size,
            s.runtime, s.metrics)
    pinned = Pinned(plan.version, plan.model_id, plan.checkpoint, plan.view)
    local = {} if partitions else {**index_args, "index_cfg": dataclasses.replace(cfg.index, use_gpu=False)}
    return SearchIngress.options(**options["ingress"]).bind(
        partitions, local, model, pinned, Limits.from_config(s), s.token_env, cfg.index.uri,
        storage.current_config(), s.watch_interval_s, s.partition_timeout_s, token, s.metrics)


def deployment_options(cfg: Config, use_gpu: bool) -> dict[str, dict]:
    """Replicas, autoscaling, resources and load limits of the deployments (GPUs only when ``use_gpu``)."""
    s = cfg.serve
    index_scaling = _autoscaling(s.index_min_replicas, s.index_max_replicas, s.target_ongoing_requests)
    # Serve's rule over the handles' requests and the direct channels' (which it does not see)
    index_scaling["policy"] = {"policy_function": partition_replicas}
    # a model replica is busy, not overloaded, with a full batch in flight: scale past that
    model_scaling = _autoscaling(s.model_min_replicas, s.model_max_replicas, float(s.max_batch_size))
    ingress = {"name": "ingress", "num_replicas": s.ingress_replicas,
               "max_ongoing_requests": s.max_ongoing_requests, "max_queued_requests": s.max_queued_requests,
               "backpressure_config": {"status_code": 503, "retry_after_s": s.retry_after_s},
               "ray_actor_options": {**_resources(s.ingress_num_cpus, 0.0),
                                     **({"resources": s.ingress_resources} if s.ingress_resources else {})}}
    if s.ingress == "direct":
        ingress["max_replicas_per_node"] = 1  # each listens on serve.port of its node
    return {
        "index": {"autoscaling_config": index_scaling, "max_ongoing_requests": 16,
                  "ray_actor_options": {**_resources(s.index_num_cpus, s.index_num_gpus if use_gpu else 0.0),
                                        **({"resources": s.index_resources} if s.index_resources else {})}},
        "model": {"name": "model", "autoscaling_config": model_scaling,
                  "max_ongoing_requests": max(2 * s.max_batch_size, 8),  # room to fill a batch and queue one
                  "ray_actor_options": _resources(s.model_num_cpus, s.model_num_gpus if use_gpu else 0.0)},
        "ingress": ingress,
    }


def build(args: dict[str, str]) -> Application:
    """App builder for ``serve run puma.serve.app:build config=FILE key=value ...`` and RayService:
    ``config`` names the YAML config (default $PUMA_CONFIG, else configs/demo.yaml), every other arg is
    a dotted key."""
    from puma.cli import default_config
    from puma.methods import load_config

    args = dict(args or {})
    path = args.pop("config", "") or default_config()
    cfg = load_config(path, [f"{key}={value}" for key, value in args.items()])
    return build_app(plan_service(cfg))


def gpus_wanted(cfg: Config) -> bool:
    """serve.gpu: always, never, or auto (when the Ray cluster has GPUs now)."""
    if cfg.serve.gpu != "auto":
        return cfg.serve.gpu == "always"
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def _autoscaling(low: int, high: int, target: float) -> dict:
    return {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
            "target_ongoing_requests": target}


def _resources(cpus: float, gpus: float) -> dict:
    return {"num_cpus": cpus, **({"num_gpus": gpus} if gpus > 0 else {})}
