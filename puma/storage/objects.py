"""Whole objects: read, write (local writes atomic via rename), check, create folders, delete, hash.

``write_text`` lives in the package ``__init__``: it calls ``write_bytes`` there, so that a patched
``puma.storage.write_bytes`` sees every write.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.fs as pafs

from puma.storage.filesystems import resolve
from puma.storage.retry import call
from puma.storage.uris import is_s3


def read_bytes(uri: str) -> bytes:
    """The whole object at ``uri``."""
    fs, path = resolve(uri)

    def _read() -> bytes:
        try:
            with fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc

    return call("reading", uri, _read)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` to ``uri`` (parents created; local writes are atomic via rename)."""
    fs, path = resolve(uri)
    if not is_s3(uri):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)
        return

    def _write() -> None:
        with fs.open_output_stream(path) as f:
            f.write(data)

    call("writing", uri, _write)


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    info = call("checking", uri, lambda: fs.get_file_info(path))
    return info.type != pafs.FileType.NotFound


def makedirs(uri: str) -> None:
    """Create a directory (a no-op prefix on S3)."""
    if not is_s3(uri):
        fs, path = resolve(uri)
        fs.create_dir(path, recursive=True)


def delete(uri: str) -> None:
    """Delete a file or a directory tree (missing is fine)."""
    fs, path = resolve(uri)

    def _delete() -> None:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            fs.delete_file(path)

    call("deleting", uri, _delete)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
