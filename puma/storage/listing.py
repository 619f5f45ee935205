"""Listing a folder (a local directory or an S3 prefix): its files, their sizes and write times, its
sub-folders; a missing folder lists as empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

from puma.storage.filesystems import resolve
from puma.storage.retry import call
from puma.storage.uris import is_s3


def list_files(uri: str, suffix: str = "", recursive: bool = True) -> list[str]:
    """Sorted URIs of the files under ``uri`` ending in ``suffix`` ([] if it does not exist)."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    files = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix)]
    return sorted(to_uri(uri, p) for p in files)


@dataclass(frozen=True)
class FileStat:
    """What a listing says of a file: where, how many bytes, when it was last written (ns)."""

    uri: str
    size: int
    mtime_ns: int

    @property
    def stamp(self) -> str:
        """``<size>:<mtime_ns>``: changes whenever the file is rewritten (the quick change check)."""
        return f"{self.size}:{self.mtime_ns}"


def list_file_stats(uri: str, suffix: str = "", recursive: bool = True) -> list[FileStat]:
    """The files under ``uri`` ending in ``suffix``, sorted, with their sizes and write times, from
    the listing alone (no file is opened; [] if ``uri`` does not exist)."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    stats = [FileStat(to_uri(uri, i.path), int(i.size or 0), mtime_ns_of(i)) for i in infos
             if i.type == pafs.FileType.File and i.path.endswith(suffix)]
    return sorted(stats, key=lambda s: s.uri)


def list_dirs(uri: str) -> list[str]:
    """Sorted URIs of the immediate sub-directories (prefixes) of ``uri``."""
    fs, path = resolve(uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = call("listing", uri, lambda: fs.get_file_info(selector))
    return sorted(to_uri(uri, i.path) for i in infos if i.type == pafs.FileType.Directory)


def to_uri(base_uri: str, fs_path: str) -> str:
    """A listed filesystem path as a URI of the same kind as ``base_uri``."""
    return f"s3://{fs_path}" if is_s3(base_uri) else fs_path


def mtime_ns_of(info: pafs.FileInfo) -> int:
    """A listed file's write time in ns (0 when the filesystem gives none)."""
    return int(info.mtime_ns) if info.mtime_ns is not None else 0
