"""``index``, ``embed``: the sharded FAISS index (puma/index) and the batch embedding job that fills it
(puma/inference)."""

from __future__ import annotations

from dataclasses import dataclass, field

from puma.config.checks import _check, _check_choice, _check_custom_resources

# ----------------------------------------------------------------------------- index

INDEX_TYPES = ("auto", "flat", "ivf_flat", "ivf_pq")


@dataclass
class IndexConfig:
    """Sharded FAISS index (puma/index): type from size and memory budget, trained once, shared."""

    uri: str = "artifacts/index/demo"  # index folder (local path or s3://)
    index_type: str = "auto"  # auto | flat (exact) | ivf_flat | ivf_pq
    metric: str = "ip"  # ip (cosine on L2-normalised embeddings) | l2
    nlist: int = 0  # IVF lists; 0: auto, 4*sqrt(N) rounded to a power of 2, <= N/39
    pq_m: int = 0  # IVF-PQ bytes per code (sub-quantizers, divides E); 0: auto from the budget
    nprobe: int = 16  # IVF lists visited per query
    shard_size: int = 250_000  # items per shard
    memory_budget_gb: float = 8.0  # memory the whole index may take at search time (picks the type)
    flat_max_items: int = 200_000  # auto: exact search up to this many items
    train_sample: int = 0  # vectors used to train IVF; 0: auto, min(N, 64*nlist) and >= 39*nlist
    seed: int = 0  # seeds the IVF training sample and k-means
    use_gpu: bool = True  # FAISS GPUs for training and search when faiss.get_num_gpus() > 0
    query_chunk: int = 65536  # queries searched at once (bounds merge memory)
    compact_fraction: float = 0.2  # a shard whose removed rows reach this fraction is rewritten without them
    keep_versions: int = 3  # versions (one per model) kept at index.uri; the live and previous always are
    promote: str = "auto"  # auto: a new model's version goes live once it holds every live catalogue
    # and verifies; manual: only by `python jobs/index.py promote`
    on_disk: str = "auto"  # serving: IVF lists memory-mapped from a local file (FAISS on-disk lists, same
    # results): always | never | auto: when a replica's share of the index is estimated above
    # serve.index_replica_memory_gb (decided at service start; elsewhere above index.memory_budget_gb)
    cache_dir: str = ""  # serving: local folder for each replica's column files (hit fields and embeddings,
    # about the index's Parquet size uncompressed) and on-disk lists; '' = the system temp folder
    filter_cache_mb: float = 256.0  # serving: memory a replica may keep of repeated filters' selected
    # embeddings (selections small enough to scan exactly, at most 20 MB each), so their scans skip the
    # gather; 0: none kept

    def __post_init__(self) -> None:
        _check_choice("index.index_type", self.index_type, INDEX_TYPES)
        _check(0 < self.compact_fraction <= 1, f"index.compact_fraction={self.compact_fraction!r} must be in "
                                               "(0, 1] (1: only shards whose every row was removed)")
        _check(self.keep_versions >= 2, f"index.keep_versions={self.keep_versions!r} must be >= 2 (the live "
                                        "version and the one a rollback returns to)")
        _check_choice("index.promote", self.promote, ("auto", "manual"))
        _check_choice("index.on_disk", self.on_disk, ("auto", "always", "never"))
        _check_choice("index.metric", self.metric, ("ip", "l2"))
        _check(self.nlist >= 0, f"index.nlist={self.nlist!r} must be >= 0 (0: auto)")
        _check(self.pq_m >= 0, f"index.pq_m={self.pq_m!r} must be >= 0 (0: auto)")
        _check(self.nprobe >= 1, f"index.nprobe={self.nprobe!r} must be >= 1")
        _check(self.shard_size >= 1, f"index.shard_size={self.shard_size!r} must be >= 1")
        _check(self.memory_budget_gb > 0, f"index.memory_budget_gb={self.memory_budget_gb!r} must be > 0")
        _check(self.flat_max_items >= 0, "index.flat_max_items must be >= 0")
        _check(self.train_sample >= 0, f"index.train_sample={self.train_sample!r} must be >= 0 (0: auto)")
        _check(self.query_chunk >= 1, "index.query_chunk must be >= 1")
        _check(self.filter_cache_mb >= 0, f"index.filter_cache_mb={self.filter_cache_mb!r} must be >= 0 "
                                          "(0: none kept)")


# ----------------------------------------------------------------------------- batch embedding

EMBED_SPLITS = ("all", "train", "test")


@dataclass
class EmbedConfig:
    """Batch embedding of catalogues into the sharded index (jobs/embed.py, puma/inference).

    The model (architecture, img_size, normalisation) comes from the checkpoint's own config;
    the job config's ``model`` section is not used. A shard holds at most
    min(commit_rows, index.shard_size) items: each commit writes whole shards, manifest last.
    """

    checkpoint: str = ""  # checkpoint folder (local, s3://); '' = <train.storage_path>/<train.run_name>/best
    backbone_weights: str = ""  # where the frozen backbone comes from on the workers; '' = the checkpoint's
    batch_size: int = 64  # images per model forward in an actor
    concurrency: int = 1  # embedding actors (each loads the model once)
    num_cpus: float = 1.0  # CPUs reserved per actor (torch threads follow it); leave some for decoding
    num_gpus: float = 1.0  # GPUs per actor when GPUs are used
    use_gpu: bool = True  # run the actors on GPUs when the cluster has any (else on CPUs)
    split: str = "all"  # rows of a prepared dataset: all | train | test (image folders: always all)
    commit_rows: int = 50_000  # items per index commit: a crash loses at most this much work
    expected_items: int = 0  # size the index plan for this many items; 0: the first catalogue's size
    retry_rejects: bool = False  # re-try items listed in the catalogue's rejects file (default: skip them)
    runtime: str = "torch"  # torch | onnx: ONNX Runtime on CPU (the model exported once by the driver,
    # parity-checked: the index takes its vectors as the same model's)
    local_max_items: int = 256  # at most this many images to embed into an existing index: embedded in
    # the job's own process with the model it loads anyway (no Ray Data pipeline to start); 0: never
    actor_resources: dict = field(default_factory=dict)  # custom Ray resources per embedding actor, e.g.
    # {embed_slot: 1} with one slot per node: one actor per node
    stamp_column: str = ""  # a table catalogue's column that changes whenever a row's image does (an ETag,
    # a version id, updated_at): the image's stamp, no storage request; '' (or an empty cell) = the image's
    # size and write time from its store. Switching it reads every image once to compare

    def __post_init__(self) -> None:
        _check_custom_resources("embed.actor_resources", self.actor_resources)
        _check(self.batch_size >= 1, f"embed.batch_size={self.batch_size!r} must be >= 1")
        _check(self.concurrency >= 1, f"embed.concurrency={self.concurrency!r} must be >= 1 actor")
        _check(self.num_cpus > 0, f"embed.num_cpus={self.num_cpus!r} must be > 0")
        _check(self.num_gpus > 0, f"embed.num_gpus={self.num_gpus!r} must be > 0 (use embed.use_gpu=false "
                                  "to run on CPUs)")
        _check_choice("embed.split", self.split, EMBED_SPLITS)
        _check(self.commit_rows >= 1, f"embed.commit_rows={self.commit_rows!r} must be >= 1")
        _check(self.local_max_items >= 0, f"embed.local_max_items={self.local_max_items!r} must be >= 0")
        _check_choice("embed.runtime", self.runtime, ("torch", "onnx"))
        _check(self.expected_items >= 0, f"embed.expected_items={self.expected_items!r} must be >= 0 "
                                         "(0: the first catalogue's size)")
