"""A serving process's local cache folder: shards' columns as local Arrow IPC files read a few rows at a
time (``ColumnFile``), and on-disk FAISS inverted lists (``puma.index.backend.lists_on_disk``).

A replica serving millions of items keeps their hit fields (item id, image URI, metadata JSON, embedding,
...) out of its memory: each shard's columns are written once, uncompressed, to
``<folder>/<sha256 of the shard's Parquet>.arrow`` (one record batch; repetitive strings
dictionary-encoded, small integers narrowed: ``compact_table``), and a query reads its k rows' values
with positioned reads (``os.pread``) at the offsets of the file's Arrow buffers. The bytes stay in the
kernel's page cache, shared and reclaimable, and are not mapped into the process for these reads: a
memory map would count every page a query touched in the replica's resident memory (about 10 pages per
hit), growing it towards the whole file as queries spread over the catalogue. Measured on 250,000-row
shards of a realistic table: about 20 us a hit on this machine's page cache. The one exception is the
embedding column of a selective filter's brute force (``ColumnFile.matrix``), which reads thousands of
rows a query: it is mapped, and what it touched is file-backed memory (like on-disk lists).

The folder (``<root>/puma-serve-<pid>-<random>``) belongs to one LiveIndex: files no loaded state uses
are deleted after each load (a request still holding an older state reads through its open descriptor:
an unlinked file lives until closed), the whole folder when the owner is garbage collected or the
process exits, and folders of processes that are gone at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
import weakref

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from puma.index.table import read_columns

log = logging.getLogger(__name__)
PREFIX = "puma-serve-"
_OWNED = re.compile(rf"{PREFIX}(\d+)-")
_TWO_INT32 = struct.Struct("<ii")
_TWO_INT64 = struct.Struct("<qq")


class LocalCache:
    """One folder of local files under ``root`` ('' = the system temp folder)."""

    def __init__(self, root: str = "") -> None:
        root = root or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        self.folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def keep(self, names: set[str]) -> list[str]:
        """Delete the files not named in ``names``; returns the deleted names."""
        gone = sorted(set(os.listdir(self.folder)) - names)
        for name in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(name))
        return gone

    def close(self) -> None:
        """Delete the folder now (open files stay readable until closed)."""
        self._cleanup()

    def column_file(self, sha256: str, table: pa.Table) -> tuple[ColumnFile, str]:
        """``table`` (compacted: ``compact_table``) written as this cache's file for the Parquet file of
        checksum ``sha256``, opened for row reads; returns (it, its file name)."""
        name = f"{sha256[:32]}.arrow"
        path = self.path(name)
        write_ipc(table, path)
        return ColumnFile(path), name


def read_compact(uri: str, columns: list[str], schema: pa.Schema | None = None) -> pa.Table:
    """A Parquet file's ``columns`` (absent ones null), compacted (``compact_table``)."""
    return compact_table(read_columns(uri, columns, missing_ok=True), schema)


def compact_table(table: pa.Table, schema: pa.Schema | None = None) -> pa.Table:
    """The table in one chunk per column, cast to ``schema``'s types where given: a dictionary type
    encodes repetitive strings (with the narrowest index type its values need), int32 narrows int64
    (kept int64 when a value does not fit)."""
    table = table.combine_chunks()
    if schema is None:
        return table
    for field in schema:
        if field.name not in table.column_names:
            continue
        at = table.schema.get_field_index(field.name)
        table = table.set_column(at, field.name, _cast(table.column(at), field.type))
    return table


def as_dictionary(array: pa.Array) -> pa.Array:
    """A string array dictionary-encoded with the narrowest index type its values need."""
    return _cast(pa.chunked_array([array]), pa.dictionary(pa.int32(), array.type)).combine_chunks()


def _cast(column: pa.ChunkedArray, to: pa.DataType) -> pa.ChunkedArray:
    if column.type == to:
        return column
    if pa.types.is_null(column.type):
        return pa.chunked_array([pa.nulls(len(column), to)])
    if pa.types.is_dictionary(to):
        encoded = pc.dictionary_encode(column.cast(to.value_type))
        size = sum(len(chunk.dictionary) for chunk in encoded.chunks)
        widths = (pa.int8(), pa.int16(), pa.int32(), pa.int64())
        index = next(t for t in widths if size < 2 ** (t.bit_width - 1))
        return encoded.cast(pa.dictionary(index, to.value_type))
    try:
        return column.cast(to)  # safe: raises when a value does not fit
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return column


def write_ipc(table: pa.Table, path: str) -> None:
    """The table as an uncompressed Arrow IPC file, one record batch, written beside and renamed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, len(table)))
    os.replace(tmp, path)


class ColumnFile:
    """A local Arrow IPC file (one record batch) whose values are read row by row with positioned reads
    at its buffers' offsets: nothing of the columns is held in memory but their layout (and the small
    dictionaries of dictionary-encoded columns)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with pa.memory_map(path, "r") as mapped:  # to learn where the buffers are; no value is read
            base = mapped.read_buffer(1).address
            mapped.seek(0)
            batch = pa.ipc.open_file(mapped).read_all().combine_chunks()
            self.num_rows = batch.num_rows
            self._columns = {name: _Layout(batch.column(name).chunk(0), base) for name in batch.column_names}
            del batch
        self._matrices: dict[str, np.ndarray] = {}
        self._fd = os.open(path, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self._fd)

    @property
    def names(self) -> list[str]:
        return list(self._columns)

    def value(self, column: str, row: int):
        """One value as a Python object (an embedding: float32 (E,)); None where null."""
        return self._columns[column].value(self._fd, row)

    def matrix(self, name: str) -> np.ndarray:
        """A column of float vectors as a read-only (num_rows, E) array mapped from the file, for reading
        many rows at once (a filtered search's brute force over its selected rows). Unlike the row reads,
        the pages such reads touch count in the process's file-backed resident memory, as on-disk lists'
        do: shared with the page cache and reclaimable. Mapped once, on first use."""
        matrix = self._matrices.get(name)
        if matrix is None:
            layout = self._columns[name]
            if layout.read != layout._vector:
                raise TypeError(f"column {name!r} of {self.path} is not a column of float vectors")
            with open(self.path, "rb") as f:  # a plain array over the map (np.memmap's indexing is slower)
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            dim = layout.width // layout.dtype.itemsize
            matrix = np.frombuffer(mapped, layout.dtype, self.num_rows * dim, layout.position)
            matrix = self._matrices[name] = matrix.reshape(self.num_rows, dim)
        return matrix

    def column(self, name: str) -> pa.Array:
        """A whole column read into memory (for the few columns a caller keeps)."""
        with pa.OSFile(self.path) as source:
            reader = pa.ipc.open_file(source)
            return reader.read_all().column(name).combine_chunks()


class _Layout:
    """Where one column's buffers are in the file, and how to decode a value at a row."""

    def __init__(self, array: pa.Array, base: int) -> None:
        if array.offset:
            raise ValueError("a column file's arrays start at offset 0")
        kind = array.type
        buffers = array.buffers()
        self.validity = None if buffers[0] is None or not array.null_count else buffers[0].address - base
        self.decode = None
        if pa.types.is_dictionary(kind):
            self.width, self.signed = kind.index_type.bit_width // 8, True
            self.position = buffers[1].address - base
            self.decode = array.dictionary.to_pylist().__getitem__
            self.read = self._integer
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            self.pair = _TWO_INT64 if pa.types.is_large_string(kind) else _TWO_INT32
            self.position = buffers[1].address - base
            self.data = buffers[2].address - base if buffers[2] is not None else 0
            self.read = self._string
        elif pa.types.is_fixed_size_list(kind) and pa.types.is_floating(kind.value_type):
            values = array.values
            self.dtype = np.dtype(values.type.to_pandas_dtype())
            self.width = kind.list_size * self.dtype.itemsize
            self.position = values.buffers()[1].address - base
            self.read = self._vector
        elif pa.types.is_integer(kind):
            self.width, self.signed = kind.bit_width // 8, pa.types.is_signed_integer(kind)
            self.position = buffers[1].address - base
            self.read = self._integer
        elif pa.types.is_null(kind):
            self.read = lambda fd, row: None
        else:
            raise TypeError(f"a column file cannot hold {kind}; valid: strings, integers, dictionaries, "
                            "fixed-size lists of floats")

    def value(self, fd: int, row: int):
        if self.validity is not None and not os.pread(fd, 1, self.validity + (row >> 3))[0] >> (row & 7) & 1:
            return None
        value = self.read(fd, row)
        return value if self.decode is None else self.decode(value)

    def _integer(self, fd: int, row: int) -> int:
        return int.from_bytes(os.pread(fd, self.width, self.position + self.width * row), "little",
                              signed=self.signed)

    def _string(self, fd: int, row: int) -> str:
        start, end = self.pair.unpack(os.pread(fd, self.pair.size, self.position + self.pair.size // 2 * row))
        return os.pread(fd, end - start, self.data + start).decode() if end > start else ""

    def _vector(self, fd: int, row: int) -> np.ndarray:
        return np.frombuffer(os.pread(fd, self.width, self.position + self.width * row), dtype=self.dtype)


def remove_stale(root: str) -> list[str]:
    """Delete cache folders under ``root`` whose process is gone; returns their names."""
    gone = []
    for name in os.listdir(root):
        match = _OWNED.match(name)
        if match and not _alive(int(match.group(1))) and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
