"""``serve``: the online search service (puma/serve)."""

from __future__ import annotations

from dataclasses import dataclass, field

from puma.config.checks import _check, _check_choice, _check_custom_resources, _check_range

SERVE_GPU_MODES = ("auto", "always", "never")


@dataclass
class ServeConfig:
    """The online search service (jobs/serve.py, puma/serve): Ray Serve over the index at index.uri.

    Image queries are embedded by the checkpoint the index was built with (embed.checkpoint, '' =
    <train.storage_path>/<train.run_name>/best); its model id must equal the index's. Replicas of
    the model and index deployments autoscale between their min and max on ongoing requests.
    """

    host: str = "127.0.0.1"  # where the service listens (0.0.0.0 inside a pod)
    port: int = 8000  # the HTTP port (the page at /, POST /search) on every node with an ingress replica
    ingress: str = "direct"  # direct: each ingress replica listens on serve.port itself (Ray Serve's direct
    # ingress, one per node; no proxy hop) | proxy: Serve's HTTP proxy on every node forwards to it
    app_name: str = "puma-search"  # the Serve application's name (serve status, the RayService)
    image_queries: bool = True  # false: no model deployment; vector and item-id queries only
    default_k: int = 10  # hits when a request names no k
    max_k: int = 100  # the largest k a request may ask for
    max_upload_bytes: int = 10 * 1024 * 1024  # request bodies above this get 413
    max_image_pixels: int = 40_000_000  # images of more pixels (width x height) get 413
    max_batch_size: int = 16  # query images embedded in one forward (@serve.batch)
    batch_wait_timeout_s: float = 0.005  # how long a batch waits to fill
    gpu: str = "auto"  # auto: GPUs when the cluster has some at start | always | never
    model_min_replicas: int = 1  # the model deployment (image queries) scales between these
    model_max_replicas: int = 2  # at most this many model replicas
    model_num_cpus: float = 1.0  # CPUs per model replica (torch threads follow it)
    model_num_gpus: float = 1.0  # GPUs per model replica when GPUs are used
    index_partitions: int = 1  # 1: each ingress replica holds the whole index (no hop for vector and item
    # queries) | N > 1: N index deployments, each holding 1/N of the shards; queries fan out, top-k merged
    # exactly | 0: the plan picks N from the index's size and serve.index_replica_memory_gb
    index_replica_memory_gb: float = 8.0  # memory one replica may give the index (serve.index_partitions=0)
    index_min_replicas: int = 1  # each index partition (serve.index_partitions > 1) scales between these
    index_max_replicas: int = 2  # at most this many replicas per partition
    index_num_cpus: float = 1.0  # CPUs per index partition replica
    index_num_gpus: float = 0.5  # GPUs per index partition replica when GPUs are used (faiss-gpu)
    index_resources: dict = field(default_factory=dict)  # custom Ray resources per partition replica, e.g.
    # {index_slot: 1} with one slot per node: partitions spread over nodes, one per node
    partition_timeout_s: float = 5.0  # a partition that does not answer within this: the query gets 503
    partition_channel: str = "direct"  # how a query reaches the partitions: direct: each partition replica's
    # own TCP channel (puma.serve.channel: ~0.5 ms a fan-out) | ray: Ray Serve handle calls (~3-7 ms more
    # a query; for networks that open only Ray's ports between nodes)
    ingress_replicas: int = 1  # replicas of the HTTP ingress (requests, the page; the index when not
    # partitioned); with serve.ingress=direct at most one per node: one per node you want to answer
    ingress_num_cpus: float = 0.5  # the HTTP ingress also decodes query images
    ingress_resources: dict = field(default_factory=dict)  # custom Ray resources per ingress replica (e.g.
    # to keep it on the nodes a load balancer reaches)
    max_ongoing_requests: int = 64  # requests one ingress replica works on at once
    max_queued_requests: int = 256  # more waiting than this: 503 with Retry-After at once (-1: no bound)
    retry_after_s: float = 1.0  # the Retry-After of those 503s
    target_ongoing_requests: float = 4.0  # index autoscaling: requests per replica (model: max_batch_size)
    watch_interval_s: float = 10.0  # how often replicas look for new shards and a new live version
    version_grace_s: float = 30.0  # a replaced version stays loaded this long (and while requests hold it)
    runtime: str = "torch"  # the query model: torch | onnx (ONNX Runtime on CPU, parity-checked at load)
    token_env: str = "PUMA_SERVE_TOKEN"  # a non-empty value there requires `Authorization: Bearer <it>`
    access_log: bool = False  # one log line per request in the replicas' logs
    metrics: bool = True  # the service's own metrics (puma/serve/metrics.py); false: none recorded
    metrics_port: int = 0  # a local Ray's metrics port for Prometheus (Ray's, Serve's and the service's
    # metrics: puma/serve/metrics.py; 0: a free one, printed at start); on a cluster each node's own
    # (ray start --metrics-export-port)

    def __post_init__(self) -> None:
        _check(bool(self.host), "serve.host must be an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        _check_range("serve.port", self.port, 1, 65535)
        _check(bool(self.app_name), "serve.app_name must be set, e.g. puma-search")
        _check_range("serve.max_k", self.max_k, 1, 10_000)
        _check_range("serve.default_k", self.default_k, 1, self.max_k)
        _check(self.max_upload_bytes >= 1024, "serve.max_upload_bytes must be >= 1024")
        _check(self.max_image_pixels >= 256, "serve.max_image_pixels must be >= 256")
        _check_range("serve.max_batch_size", self.max_batch_size, 1, 4096)
        _check_range("serve.batch_wait_timeout_s", self.batch_wait_timeout_s, 0.0, 10.0)
        _check_choice("serve.gpu", self.gpu, SERVE_GPU_MODES)
        for part in ("model", "index"):
            low, high = getattr(self, f"{part}_min_replicas"), getattr(self, f"{part}_max_replicas")
            _check(1 <= low <= high, f"serve.{part}_min_replicas={low} and serve.{part}_max_replicas={high}: "
                                     "need 1 <= min <= max")
        for name in ("model_num_cpus", "index_num_cpus", "ingress_num_cpus"):
            _check(getattr(self, name) > 0, f"serve.{name}={getattr(self, name)!r} must be > 0")
        for name in ("model_num_gpus", "index_num_gpus"):
            _check(getattr(self, name) >= 0, f"serve.{name}={getattr(self, name)!r} must be >= 0")
        _check(self.ingress_replicas >= 1, "serve.ingress_replicas must be >= 1")
        _check_choice("serve.ingress", self.ingress, ("direct", "proxy"))
        _check(self.index_partitions >= 0, f"serve.index_partitions={self.index_partitions!r} must be >= 0 "
                                           "(0: picked from the index size)")
        _check(self.index_replica_memory_gb > 0, "serve.index_replica_memory_gb must be > 0")
        _check(self.max_ongoing_requests >= 1, "serve.max_ongoing_requests must be >= 1")
        _check(self.max_queued_requests == -1 or self.max_queued_requests >= 1,
               "serve.max_queued_requests must be >= 1 (or -1: no bound)")
        _check(self.retry_after_s >= 0, "serve.retry_after_s must be >= 0 seconds")
        _check(self.partition_timeout_s > 0, "serve.partition_timeout_s must be > 0 seconds")
        _check_choice("serve.partition_channel", self.partition_channel, ("direct", "ray"))
        _check_custom_resources("serve.index_resources", self.index_resources)
        _check_custom_resources("serve.ingress_resources", self.ingress_resources)
        _check(self.target_ongoing_requests > 0, "serve.target_ongoing_requests must be > 0")
        _check(self.watch_interval_s > 0, "serve.watch_interval_s must be > 0 seconds")
        _check(self.version_grace_s >= 0, "serve.version_grace_s must be >= 0 seconds")
        _check_choice("serve.runtime", self.runtime, ("torch", "onnx"))
