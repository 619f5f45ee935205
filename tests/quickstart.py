"""The documentation's quick starts, run as written (import as ``from quickstart import ...``).

A page marks a command block to run with ``<!-- quickstart: NAME -->`` on the line above its ```bash fence
(``scripts/docs_hooks.py`` refuses a marker anywhere else). ``Checkout`` is a scratch copy of the repository
as a user has it after ``git clone``: the top-level entries are links to this checkout, ``artifacts/`` and
every file a command writes are its own, and ``../shared`` sits beside it, so a block's relative paths
(``.venv/bin/python``, ``artifacts/runs/demo``, ``../shared/data``) mean what they mean for a user and
nothing lands in this checkout. Jobs read ``$PUMA_CONFIG`` when a command gives no ``--config``: the tests
point it at :func:`tiny_demo_config`, the embedded default's data and locations with a tiny model, so
every command runs unchanged in seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from tiny import TINY_BACKBONE

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
MARKER = re.compile(r"^<!-- quickstart: ([\w-]+) -->\n```bash\n(.*?)^```$", re.M | re.S)


def quickstarts(page: str | Path) -> dict[str, str]:
    """The marked blocks of a page (a path relative to the repository), by name."""
    return dict(MARKER.findall((REPO / page).read_text()))


def tiny_demo_config(path: Path) -> Path:
    """configs/demo.yaml's data and locations with the tiny model: 2 photos per class of the demo's
    folders (4 of Fashion-MNIST's), 1 epoch; written to ``path``."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"] = {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                     "prompt_pool": {"pool_size": 4, "length": 1}, "head": {"embed_dim": 16}}
    demo["data"].update(max_images_per_class=2, fashion_mnist_per_class=4, decode_batch_size=32)
    demo["train"].update(epochs=1, eval_every=1, batch_size=32, cpus_per_worker=1.0)
    demo["eval"] = {"batch_size": 64}
    demo["embed"] = {"batch_size": 64}
    path.write_text(yaml.safe_dump(demo))
    return path


@dataclass
class Result:
    returncode: int
    output: str

    def lines(self) -> list[str]:
        return self.output.splitlines()


class Checkout:
    """A scratch checkout (see the module's docstring); ``run`` runs a block in it with bash."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "repo"
        self.path.mkdir(parents=True)
        (root / "shared").symlink_to(SHARED)
        for entry in REPO.iterdir():
            if entry.name not in ("artifacts", ".git", "site"):
                (self.path / entry.name).symlink_to(entry)
        (self.path / "artifacts").mkdir()
        weights = REPO / "artifacts" / "weights"
        if weights.is_dir():  # the offline backbone scripts/setup.sh converted: not again
            (self.path / "artifacts" / "weights").symlink_to(weights)
        self.config = tiny_demo_config(root / "tiny-demo.yaml")

    def run(self, block: str, timeout: float = 600, env: dict[str, str] | None = None) -> Result:
        """Run ``block`` with ``bash -e`` in the checkout, its own local Rays and process group (what it
        leaves running, e.g. a server started with ``&``, is killed at the end)."""
        ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths stay < 108 bytes
        full = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PUMA_CONSOLE"))}
        full.update(PUMA_CONFIG=str(self.config), PUMA_RAY_TMP=ray_tmp, PUMA_PROGRESS_EVERY_S="0.5",
                    **(env or {}))
        log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a server the block starts with & keeps it open
        proc = subprocess.Popen(["bash", "-e", "-c", block], cwd=self.path, env=full, text=True,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        note = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            note = f"\n[quickstart] timed out after {timeout} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            shutil.rmtree(ray_tmp, ignore_errors=True)
        log.seek(0)
        output = log.read() + note
        log.close()
        return Result(proc.returncode, output)
