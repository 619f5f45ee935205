"""A checkpoint's files: written with their checksums, read back and checked, never unpickled.

Layout::

    model.safetensors      trainable weights only (keys as in model.state_dict())
    loss.safetensors       loss parameters and buffers (proxies, CurricularFace t)
    optimizer.safetensors  optimiser tensors (resume only; optional)
    config.yaml            the resolved Config
    meta.json              epoch, metrics, label map, library versions, optimiser layout, and the
                           sha256 of every other file ("files"); written last: a checkpoint is
                           complete when meta.json is present and every file matches its checksum
                           (meta.json's presence alone proves nothing: Ray Train uploads a reported
                           checkpoint's files to storage in no set order)

Every reader follows a best/ pointer first (:func:`resolve_checkpoint`; puma.checkpoint.runs writes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

from puma import library_versions, storage
from puma.config import Config, dump_yaml, from_dict
from puma.errors import UserError
from puma.run_folder import BEST_POINTER

if TYPE_CHECKING:  # torch is imported where tensors are made or read: a job that needs only a checkpoint's
    import torch  # config and model id (a catalogue run with nothing to embed) does not pay for it

MODEL_FILE = "model.safetensors"
LOSS_FILE = "loss.safetensors"
OPTIM_FILE = "optimizer.safetensors"
CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
# the libraries that shape a checkpoint's meaning (meta.json "versions")
LIBRARIES = ("torch", "timm", "ray", "pytorch-metric-learning", "faiss-cpu", "faiss-gpu", "puma-ray")


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, incomplete or does not match the model built from its config."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint folder whose files are missing, truncated or unreadable (an interrupted write)."""


@dataclass
class CheckpointState:
    """What a checkpoint holds, in memory."""

    config: Config
    model: dict[str, torch.Tensor]
    loss: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def save_checkpoint(uri: str, state: CheckpointState) -> str:
    """Write ``state`` under ``uri``; meta.json (with every file's sha256) last, so it marks completeness."""
    from safetensors.torch import save as st_save

    storage.makedirs(uri)
    files = {MODEL_FILE: st_save(_cpu(state.model)), LOSS_FILE: st_save(_cpu(state.loss))}
    meta = dict(state.meta, versions=library_versions(LIBRARIES))
    meta.pop("optimizer_layout", None)  # a copy without the optimiser (best/) must not claim one
    if state.optimizer is not None:
        tensors, layout = flatten_optimizer_state(state.optimizer)
        files[OPTIM_FILE] = st_save(tensors)
        meta["optimizer_layout"] = layout
    files[CONFIG_FILE] = dump_yaml(state.config).encode("utf-8")
    meta["files"] = {name: storage.sha256(data) for name, data in files.items()}
    for name, data in files.items():
        storage.write_bytes(storage.join(uri, name), data)
    storage.write_text(storage.join(uri, META_FILE), json.dumps(meta, indent=2, sort_keys=True))
    return uri


def resolve_checkpoint(uri: str) -> str:
    """The folder holding the checkpoint ``uri`` names: the version its pointer names (best/), or itself."""
    pointer = storage.join(uri, BEST_POINTER)
    if not storage.exists(pointer):
        return uri
    return storage.join(uri, json.loads(storage.read_text(pointer))["checkpoint"])


def has_checkpoint(uri: str) -> bool:
    """Whether ``uri`` names a checkpoint (a pointer, or a folder with meta.json); not a full check."""
    return storage.exists(storage.join(uri, BEST_POINTER)) or storage.exists(storage.join(uri, META_FILE))


def _incomplete(uri: str, what: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(f"{uri} is not a complete PUMA checkpoint: {what}")


def read_meta(uri: str) -> dict[str, Any]:
    """A checkpoint's meta.json (following a best/ pointer); IncompleteCheckpointError when it is missing."""
    uri = resolve_checkpoint(uri)
    path = storage.join(uri, META_FILE)
    try:
        meta = json.loads(storage.read_text(path))
    except FileNotFoundError as exc:
        raise _incomplete(uri, f"{META_FILE} is missing (expected files: {MODEL_FILE}, {CONFIG_FILE}, "
                               f"{META_FILE})") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise _incomplete(uri, f"{path} is not valid JSON ({exc}): the checkpoint is damaged; use another "
                               "checkpoint (e.g. an earlier checkpoint_* of the run)") from exc
    if not isinstance(meta, dict):
        raise _incomplete(uri, f"{path} holds a {type(meta).__name__}, not a JSON object: the checkpoint "
                               "is damaged; use another checkpoint")
    return meta


def _read_file(uri: str, name: str, meta: dict) -> bytes:
    """One file of a checkpoint (IncompleteCheckpointError when it is missing)."""
    try:
        return storage.read_bytes(storage.join(uri, name))
    except FileNotFoundError as exc:
        raise _incomplete(uri, f"{name} is missing") from exc


def _checksum_error(uri: str, name: str, data: bytes, meta: dict, parses: bool) -> CheckpointError | None:
    """Why ``data`` is not the file ``name`` was saved as (None when it is, or no checksum was recorded).

    A file that no longer parses was cut short or damaged (an interrupted write or copy); one that
    parses with other bytes was edited: its weights are not the trained ones, which must not be
    blamed on the backbone later (verify_probe).
    """
    expected = meta.get("files", {}).get(name)
    if expected is None or storage.sha256(data) == expected:
        return None
    path = storage.join(uri, name)
    if not parses:
        return _incomplete(uri, f"{path} is truncated or corrupt ({len(data)} bytes; it does not match the "
                                f"sha256 in {META_FILE}: an interrupted write or copy): use another "
                                "checkpoint (e.g. an earlier checkpoint_* of the run)")
    return _incomplete(uri, f"{path} was changed after the checkpoint was saved (it does not match the "
                            f"sha256 in {META_FILE}): its weights are not the trained ones; restore the "
                            "file or use another checkpoint")


def read_checkpoint(uri: str, with_optimizer: bool = False, weights: bool = True) -> CheckpointState:
    """Read a checkpoint written by :func:`save_checkpoint` (safetensors + YAML + JSON only).

    ``uri`` may be a best/ folder with a pointer; every file is checked against its recorded sha256.
    ``weights=False``: the config and meta only (model and loss empty; the model file's checksum is
    still checked), without importing torch: enough for :func:`checkpoint_id` and the eval view.
    """
    uri = resolve_checkpoint(uri)
    meta = read_meta(uri)
    config = _read_config(uri, meta)
    if not weights:
        _check_file(uri, MODEL_FILE, meta)
        return CheckpointState(config=config, model={}, meta=meta)
    model = read_weights(uri, MODEL_FILE, meta)
    loss = read_weights(uri, LOSS_FILE, meta)
    optimizer = None
    if with_optimizer and "optimizer_layout" in meta:
        optimizer = unflatten_optimizer_state(read_weights(uri, OPTIM_FILE, meta), meta["optimizer_layout"])
    return CheckpointState(config=config, model=model, loss=loss, optimizer=optimizer, meta=meta)


def _read_config(uri: str, meta: dict[str, Any]) -> Config:
    """config.yaml as a Config; a missing, edited or unreadable one is a CheckpointError naming it."""
    import yaml

    data = _read_file(uri, CONFIG_FILE, meta)
    error = _checksum_error(uri, CONFIG_FILE, data, meta, parses=True)
    if error is not None:
        raise error
    try:
        return from_dict(yaml.safe_load(data.decode("utf-8")) or {})
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{storage.join(uri, CONFIG_FILE)} is not valid YAML: the checkpoint is "
                              "damaged; use another checkpoint") from exc


def _check_file(uri: str, name: str, meta: dict[str, Any]) -> None:
    """A safetensors file of a checkpoint is whole (its header read, no torch) and has the bytes it was
    saved with (when a checksum was recorded); refused as read_weights refuses it."""
    data = _read_file(uri, name, meta)
    broken = _safetensors_problem(data)
    if broken:
        error = _checksum_error(uri, name, data, meta, parses=False)
        raise error or _incomplete(uri, f"{storage.join(uri, name)} is truncated or corrupt ({len(data)} "
                                        f"bytes; {broken}): use another checkpoint")
    error = _checksum_error(uri, name, data, meta, parses=True)
    if error is not None:
        raise error


def _safetensors_problem(data: bytes) -> str:
    """Why ``data`` is not a whole safetensors file ('' when its header parses and its tensors end where
    the file ends)."""
    if len(data) < 8:
        return "shorter than a safetensors header"
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size])
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "its header is not safetensors JSON"
    if 8 + size + end != len(data):
        return f"its tensors end at byte {8 + size + end}"
    return ""


def read_weights(uri: str, name: str, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One safetensors file of a checkpoint; a missing, truncated, corrupt or edited file is refused.

    A checkpoint written since file checksums were recorded (meta.json ``files``) must still hold
    the bytes it was saved with; a truncated file in an older checkpoint is caught by parsing it.
    """
    from safetensors.torch import load as st_load

    data = _read_file(uri, name, meta)
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        error = _checksum_error(uri, name, data, meta, parses=False)
        raise error or _incomplete(uri, f"{storage.join(uri, name)} is truncated or corrupt ({len(data)} "
                                        f"bytes; safetensors: {exc}): use another checkpoint (e.g. an "
                                        "earlier checkpoint_* of the run)") from exc
    error = _checksum_error(uri, name, data, meta, parses=True)
    if error is not None:
        raise error
    return tensors


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a torch optimiser state_dict into safetensors-ready tensors and a JSON layout."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state_dict["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], layout: dict) -> dict:
    """Inverse of :func:`flatten_optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in layout.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    return {"state": state, "param_groups": layout["param_groups"]}
