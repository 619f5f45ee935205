"""One catalogue's run: what it needs, resolved on the driver (Run), and what it did (EmbedReport).

The model id comes from the checkpoint (``puma.checkpoint.checkpoint_id``), and with it the index the
run writes: the model's version folder of index.uri (puma.index.versions), or index.uri itself for a
location written before versions existed. The model itself is loaded on the driver only when there is
something to embed (:func:`check_model`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from puma import storage
from puma.checkpoint import checkpoint_id, read_checkpoint, resolve_checkpoint
from puma.config import Config
from puma.data.images import ViewSpec, eval_view_spec
from puma.index.layout import IndexLocation
from puma.index.manifest import now
from puma.index.versions import is_legacy, version_name
from puma.inference.embedder import Embedder
from puma.inference.reconcile import Plan
from puma.inference.rejects import rejects_uri


@dataclass
class EmbedReport:
    """What one catalogue's run did."""

    catalogue: str
    index_uri: str  # the index written (a version folder of the location, or the location itself)
    location: str = ""  # index.uri
    version: str = ""  # the version written ('' for a location without versions)
    checkpoint: str = ""
    model_id: str = ""
    items: int = 0  # items the catalogue lists (the selected split), rejected rows not counted
    embedded: int = 0  # images read, decoded and embedded and written by this run (added + changed)
    images: int = 0  # distinct images decoded and embedded (rows sharing an image_uri and image_row: once)
    added: int = 0  # new items written
    changed: int = 0  # items whose image changed: embedded again, the old row removed
    restamped: int = 0  # same image, new stamp or metadata: stored embedding written again
    removed: int = 0  # items gone from the catalogue (or changed to an image that is now rejected)
    read_to_compare: int = 0  # images read (not decoded) because their listing stamp changed
    skipped_indexed: int = 0  # indexed and unchanged (or restamped): not decoded, not re-embedded
    skipped_rejected: int = 0  # listed in the rejects file by an earlier run: not re-tried
    rejected: int = 0  # items listed in the catalogue's rejects file after this run
    reject_reasons: dict = field(default_factory=dict)
    rejects_uri: str = ""
    ignored_files: int = 0  # non-image files under an image-folder catalogue
    shards_added: list[str] = field(default_factory=list)
    compacted: list[str] = field(default_factory=list)  # shards rewritten without their removed rows
    total: int = 0  # items in the index after this run
    promoted: str = ""  # the version this run made live ('' when none)
    seconds: float = 0.0
    plan_seconds: float = 0.0  # listing, stamping and comparing with the index (no image decoded)
    error: str = ""  # watch: why this catalogue failed ('' when it did not)

    def summary(self) -> str:
        """One line for the job's output."""
        if self.error:
            return f"{self.catalogue}: FAILED: {self.error}"
        version = f" [version {self.version}]" if self.version else ""
        return (f"{self.catalogue}: embedded {self.embedded}, already indexed {self.skipped_indexed}; "
                f"added {self.added}, changed {self.changed}, removed {self.removed}, "
                f"restamped {self.restamped}; rejected {self.rejected}{self._reasons()}, "
                f"{len(self.shards_added)} shard(s) added, {len(self.compacted)} compacted, "
                f"index total {self.total}{version} ({self.seconds:.1f} s, "
                f"planned in {self.plan_seconds:.1f} s)")

    def _reasons(self) -> str:
        return f" {self.reject_reasons}" if self.reject_reasons else ""

    def record(self) -> dict:
        """What the manifest keeps of this run."""
        return {"at": now(), "action": "reconcile", "catalogue": self.catalogue, "added": self.added,
                "changed": self.changed, "removed": self.removed, "restamped": self.restamped,
                "rejected": self.rejected, "shards_added": self.shards_added}


def report_dict(report: EmbedReport) -> dict:
    """The report as plain data (JSON)."""
    return dataclasses.asdict(report)


@dataclass
class Run:
    """What one catalogue's run needs, resolved on the driver."""

    cfg: Config
    catalogue: str
    index_uri: str
    checkpoint: str
    model_id: str
    model_cfg: Config  # the checkpoint's own config
    dim: int
    report: EmbedReport
    plan: Plan | None = None
    embedder: Embedder | None = None  # the model loaded on the driver (check_model)

    @functools.cached_property
    def view(self) -> ViewSpec:
        """The model's eval view with the job's size limit and decoder: planned on first use (it imports
        timm for the backbone's normalisation), so a run with nothing to embed never plans it."""
        view = eval_view_spec(self.model_cfg, min_size=self.cfg.data.min_image_size)
        return dataclasses.replace(view, on_worker=self.cfg.data.decode_on == "worker")


def prepare_run(cfg: Config, catalogue: str, location: str, checkpoint: str) -> Run:
    """The model id from the checkpoint (its own config), the index to write, a report."""
    checkpoint = resolve_checkpoint(checkpoint)  # best/ -> its version now: one model for the id and actors
    state = read_checkpoint(checkpoint, weights=False)  # config and id: no torch for a no-op
    model_cfg = state.config
    model_id = checkpoint_id(checkpoint, state)
    version = "" if is_legacy(location) else version_name(model_id)
    index_uri = IndexLocation(location).index(version)
    report = EmbedReport(catalogue=catalogue, index_uri=index_uri, location=location, version=version,
                         checkpoint=checkpoint, model_id=model_id,
                         rejects_uri=rejects_uri(location, catalogue))
    dim = model_cfg.model.head.embed_dim
    return Run(cfg, catalogue, index_uri, checkpoint, model_id, model_cfg, dim, report)


def check_model(run: Run) -> None:
    """Load the checkpoint once on the driver with the backbone the actors will use: a model that does
    not reproduce its probe embeddings (another backbone, an edited file) is refused here in one line
    (a CheckpointError), not inside every actor's constructor, where Ray keeps only its text. The
    loaded model is kept: a small change is embedded with it here (puma.inference.running)."""
    cfg = run.cfg
    run.embedder = Embedder(run.checkpoint, cfg.embed.backbone_weights, storage.current_config(),
                            use_gpu=cfg.embed.use_gpu, threads=0, runtime=cfg.embed.runtime)
