"""``data``, ``storage``: where prepared datasets live and how they are streamed; the S3 settings and
retry policy of puma.storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from puma import storage
from puma.config.checks import _check, _check_choice, _check_range


@dataclass
class DataConfig:
    """Where prepared Parquet lives and how it is streamed."""

    uri: str = "artifacts/data/demo"  # prepared dataset root (local path or s3://)
    preset: str = "demo"  # how a missing data.uri is built: demo | cub | cars | ... ('' = never)
    source_root: str = "../shared/data"  # raw data: the demo's sample folders, or a named preset's release
    fashion_mnist_dir: str = "/usr/share/datasets/fashion-mnist"  # demo: Debian's Fashion-MNIST IDX files
    datasets: Optional[list[str]] = None  # datasets of the manifest to use; null: all of them
    val_fraction: float = 0.0  # fraction of training classes held out for validation (tune)
    shard_rows: int = 2000  # prepare: rows per Parquet shard (a shard also closes at 256 MiB of images)
    prepare_max_side: int = 0  # prepare: store images whose longer side exceeds this many px shrunk to it
    # (0: as encoded). Decoding a large photo then costs a small one's; about 2.3 x img_size (512 for 224
    # px) keeps the training crops' resolution. Must be >= the eval view's resize (256 for 224 px)
    max_images_per_class: Optional[int] = None  # demo: per-class cap of cub/flowers/omniglot (null: 12)
    fashion_mnist_per_class: int = 400  # demo: per-class cap of Fashion-MNIST, the large, dominant dataset
    num_decode_cpus: float = 1.0  # CPUs reserved per Ray Data read/decode task: 1 runs one task per CPU
    # (0.5 ran two per core and cut rows per core-second 2-4x, bench/results/data_decode_cpus_0.5.md);
    # below 1 only where Train workers must leave fractions of a CPU
    rejects_uri: str = ""  # where training lists rejected images (prepare's and decode's); ''
    # = <train.storage_path>/<train.run_name>/data_rejects.jsonl
    min_image_size: int = 16  # images whose shorter side is below this are rejected as tiny
    shuffle: str = "global"  # per-epoch shuffle: global (random_shuffle) | block (shard order and rows
    # within each read block, in the read task: no all-to-all, cheaper per core, but a block keeps its rows
    # every epoch: -0.023 harmonic R@1 on the demo's validation classes, docs/performance.md) | local (block
    # order and a consumer shuffle buffer) | none
    shuffle_buffer_rows: int = 1024  # local shuffle buffer for iter_batches consumers (shuffle=local)
    decode_batch_size: int = 128  # rows per Ray Data decode batch (and per embed-job decode task): each
    # output block costs the consumer and the executor a fixed share; 32 cost 20-25% more CPU per row on
    # CUB-sized photos (profiled: docs/performance.md)
    jpeg_draft: bool = True  # decode a JPEG at a reduced DCT scale (1/2, 1/4, 1/8) that still leaves the
    # pixels the view needs (eval: 256 px shorter side at 224; train: 2.6 x img_size): large photos decode
    # several times faster; at 224 px embeddings stay within cosine 0.9997 of a full-size decode
    crop_draft: bool = True  # with jpeg_draft: a training view decodes at the DCT scale of its own crop
    # (half the CPU for 1,000 px photos; pixels within 0.006-0.023 of a full-size decode's same crop)
    decode_on: str = "tasks"  # tasks: Ray Data tasks decode, crop and normalise (PIL) | worker: the tasks
    # read only plain JPEGs' headers and plan the crop; the consuming Train worker / embedding actor decodes
    # them on its device (nvjpeg on a GPU) and crops there; CPU cores per GPU drop to the header parsing
    shots_per_class: int = 0  # few-shot training: k training images per class (0: all), seeded, stable
    shots_seed: int = 0  # which k images (puma/data/fewshot.py): the same seed picks the same images
    deterministic: bool = False  # each worker gets the same rows in the same order on every run (Ray
    # Data preserve_order): multi-worker runs repeat exactly, wherever the workers are placed; a little slower

    def __post_init__(self) -> None:
        _check_range("data.val_fraction", self.val_fraction, 0.0, 0.9)
        _check(self.shard_rows >= 1, "data.shard_rows must be >= 1")
        _check(self.prepare_max_side >= 0, f"data.prepare_max_side={self.prepare_max_side!r} must be >= 0 "
                                           "(0: store images as encoded)")
        _check(self.num_decode_cpus > 0, f"data.num_decode_cpus={self.num_decode_cpus!r} must be > 0")
        _check(self.min_image_size >= 1, f"data.min_image_size={self.min_image_size!r} must be >= 1")
        _check_choice("data.shuffle", self.shuffle, ("global", "block", "local", "none"))
        _check_choice("data.decode_on", self.decode_on, ("tasks", "worker"))
        _check(self.decode_batch_size >= 1, "data.decode_batch_size must be >= 1")
        _check(self.shots_per_class >= 0, f"data.shots_per_class={self.shots_per_class!r} must be >= 0 "
                                         "(0: every training image)")
        _check(self.max_images_per_class is None or self.max_images_per_class >= 2,
               "data.max_images_per_class must be >= 2 (retrieval needs pairs) or null")
        _check(self.fashion_mnist_per_class >= 2, "data.fashion_mnist_per_class must be >= 2")


@dataclass
class RetryConfig:
    """puma.storage's one retry policy: transient S3 errors (connection refused or reset, timeouts,
    5xx, throttling) are retried; permanent ones (403, a missing bucket, a bad endpoint) are not."""

    max_attempts: int = 6  # attempts per storage call, the first included (1: never retry)
    initial_backoff_s: float = 0.25  # wait before the first retry; doubles each retry (with jitter)
    max_backoff_s: float = 4.0  # cap of one wait between attempts
    max_elapsed_s: float = 10.0  # no retry starts after this many seconds: how soon a dead endpoint
    # is reported; raise it to ride out longer outages

    def __post_init__(self) -> None:
        _check(self.max_attempts >= 1, f"storage.retry.max_attempts={self.max_attempts!r} must be >= 1 "
                                       "(1: never retry)")
        for name in ("initial_backoff_s", "max_backoff_s", "max_elapsed_s"):
            _check(getattr(self, name) >= 0, f"storage.retry.{name}={getattr(self, name)!r} must be >= 0")


@dataclass
class StorageConfig:
    """S3 settings; credentials come from the standard AWS chain, never from config."""

    endpoint_url: str = ""  # S3-compatible endpoint, e.g. http://127.0.0.1:8333 (SeaweedFS, MinIO);
    # '' = AWS_ENDPOINT_URL if set, else AWS S3
    region: str = ""  # AWS region of the buckets; '' = AWS_REGION or AWS_DEFAULT_REGION, else us-east-1
    connect_timeout_s: float = 3.0  # seconds to wait for a TCP connection to the endpoint
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        problem = storage.endpoint_problem(self.endpoint_url)
        _check(not problem, f"storage.endpoint_url={problem}")
        _check(self.connect_timeout_s > 0,
               f"storage.connect_timeout_s={self.connect_timeout_s!r} must be > 0")
