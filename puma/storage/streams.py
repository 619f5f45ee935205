"""Objects read in pieces: streamed front to back in chunks (a broken S3 stream resumes where it was),
or opened for random access (a Parquet file read part by part).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pyarrow as pa

from puma.storage.filesystems import resolve
from puma.storage.retry import call
from puma.storage.uris import is_s3


def iter_chunks(uri: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Stream an object in chunks (for checksums of large files); a broken stream resumes where it was."""
    fs, path = resolve(uri)
    state: dict = {"file": None, "pos": 0}

    def _next() -> bytes:
        try:
            if state["file"] is None:
                state["file"] = fs.open_input_file(path)
                state["file"].seek(state["pos"])
            return state["file"].read(chunk)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc
        except Exception:
            _close(state)
            raise

    try:
        while True:
            block = call("reading", uri, _next)
            if not block:
                return
            state["pos"] += len(block)
            yield block
    finally:
        _close(state)


class _ChunkReader(io.RawIOBase):
    """A read-only file over ``iter_chunks``: a parser streams an object, and a broken stream resumes."""

    def __init__(self, uri: str, chunk: int) -> None:
        super().__init__()
        self._chunks = iter_chunks(uri, chunk)
        self._block, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._at == len(self._block):
            self._block, self._at = next(self._chunks, b""), 0
        n = min(len(buffer), len(self._block) - self._at)
        buffer[:n] = self._block[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._chunks.close()
        super().close()


def open_stream(uri: str, chunk: int = 8 << 20) -> io.BufferedReader | pa.NativeFile:
    """The object at ``uri`` as a file read front to back without holding it: a local file as it is; an
    S3 object in chunks of ``chunk`` bytes, a broken stream resuming where it was (a missing object
    raises FileNotFoundError on read)."""
    if is_s3(uri):
        return io.BufferedReader(_ChunkReader(uri, chunk), buffer_size=chunk)
    fs, path = resolve(uri)
    try:
        return fs.open_input_stream(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no object at {uri}") from exc


def open_file(uri: str) -> pa.NativeFile:
    """The object at ``uri`` opened for random access (a Parquet file read part by part)."""
    fs, path = resolve(uri)

    def _open() -> pa.NativeFile:
        try:
            return fs.open_input_file(path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no object at {uri}") from exc

    return call("reading", uri, _open)


def _close(state: dict) -> None:
    if state["file"] is not None:
        state["file"].close()
        state["file"] = None
