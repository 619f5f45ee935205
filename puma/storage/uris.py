"""URIs: a local path or ``s3://bucket/key``, joined, split and shown the same way everywhere.

Pure string work: nothing here opens a file or reaches S3 (``filesystems.resolve`` turns a URI into a
filesystem and a path).
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import pyarrow.fs as pafs


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI with '/' (local paths keep OS semantics)."""
    if is_s3(uri):
        return posixpath.join(str(uri), *parts)
    return str(Path(uri).joinpath(*parts))


def bucket_of(uri: str) -> str:
    """The bucket of an s3:// URI."""
    return str(uri)[len("s3://"):].split("/", 1)[0]


def display_uri(path: str, filesystem: pafs.FileSystem | None = None) -> str:
    """A location as users see it everywhere: ``s3://bucket/key`` for S3 paths (pyarrow and Ray
    drop the scheme), local paths unchanged."""
    path = str(path)
    if filesystem is not None and filesystem.type_name == "s3" and not is_s3(path):
        return "s3://" + path.lstrip("/")
    return path
