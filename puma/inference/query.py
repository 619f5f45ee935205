"""Search by image: embed query image files in-process with a checkpoint's model and the eval view.

The view is the one evaluation and batch embedding use (``puma.data.images.eval_view_spec``:
resize int(img_size * 256 / 224), center crop img_size, bicubic; the backbone's mean / std), so a
query image embeds to the same vector as the same image stored in the index. Images are read
through puma.storage (local or s3://).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from puma import storage
from puma.config import Config
from puma.data.images import ImageRejected, ViewSpec, eval_view_spec, make_view
from puma.errors import UserError


class QueryImageError(UserError, ValueError):
    """A query image that cannot be read or decoded; the message names the file."""


def load_query_image(uri: str, view: ViewSpec) -> np.ndarray:
    """One image file -> float32 (3, H, W) in the eval view; raises QueryImageError naming it."""
    try:
        data = storage.read_bytes(uri)
    except OSError as exc:  # FileNotFoundError, storage.StorageError
        raise QueryImageError(f"query image {uri} cannot be read: {exc}") from exc
    try:
        return make_view(data, view)
    except ImageRejected as exc:
        raise QueryImageError(f"query image {uri} is not a usable image ({exc})") from exc


@torch.no_grad()
def embed_images(model: torch.nn.Module, cfg: Config, image_uris: Sequence[str],
                 batch_size: int = 32) -> tuple[list[str], np.ndarray]:
    """Embed image files with ``model`` (eval mode): (names = the URIs, vectors (Q, E) float32)."""
    if not image_uris:
        raise QueryImageError("no query images given")
    view = eval_view_spec(cfg)
    images = np.stack([load_query_image(str(uri), view) for uri in image_uris])  # (Q, 3, H, W)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    parts = [model(torch.from_numpy(images[i:i + batch_size]).to(device)).float().cpu().numpy()
             for i in range(0, len(images), batch_size)]  # (b, E) each
    model.train(was_training)
    return [str(uri) for uri in image_uris], np.concatenate(parts).astype(np.float32)
