"""Stamping many files at once (size and write time of each, None where missing) in as few requests
as it takes: local files in one call; S3 objects by listing their folders where that costs fewer
requests than a HEAD per object, the others one HEAD each.

The keys a listing request asks for (``page_size``) are handed in: the package passes
``puma.storage.LIST_PAGE`` at each call, so that tests can lower it there.
"""

from __future__ import annotations

import bisect
import calendar
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.fs as pafs

from puma.storage.filesystems import boto3_client, local_fs, resolve
from puma.storage.listing import FileStat, mtime_ns_of
from puma.storage.retry import call

THREADS = 16  # requests in flight when stamping S3 objects


def stat_files(uris: Sequence[str], page_size: int) -> list[FileStat | None]:
    """Each file's size and write time (None where it is missing), in as few requests as it takes:
    local files in one call; S3 objects by listing the key range of their folder (one request per
    ``page_size`` keys) where that costs fewer requests than a HEAD per object (see ``_list_folder``), the
    others one HEAD each (threads). A listed object's write time is cut to whole seconds, as a HEAD gives
    it, so an object has one stamp however it was asked."""
    sizes, times, found = stat_arrays(uris, page_size)
    return [FileStat(u, int(sizes[i]), int(times[i])) if found[i] else None for i, u in enumerate(uris)]


def stat_arrays(uris: Sequence[str], page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stat_files`` as arrays, no object per file: sizes (N,) int64, write times (N,) int64 ns, found
    (N,) bool (False: missing, or not a file)."""
    n = len(uris)
    sizes, times, found = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
    s3 = [i for i, u in enumerate(uris) if u.startswith("s3://")]
    if len(s3) < n:
        local = [i for i, u in enumerate(uris) if not u.startswith("s3://")] if s3 else range(n)
        # an absolute path is asked as it is (resolve's pathlib per file cost 17 s at 1M files)
        infos = local_fs().get_file_info([u if u.startswith("/") else resolve(u)[1]
                                          for u in (uris[i] for i in local)])
        for i, info in zip(local, infos, strict=True):
            size = info.size  # None for a missing file or a folder
            if size is not None:
                sizes[i], times[i], found[i] = size, info.mtime_ns or 0, True
    folders: dict[str, list[int]] = {}
    for i in s3:
        folders.setdefault(uris[i].rsplit("/", 1)[0], []).append(i)
    if folders:
        out: list[FileStat | None] = [None] * n
        _stat_s3(uris, folders, out, page_size)
        for i in s3:
            if out[i] is not None:
                sizes[i], times[i], found[i] = out[i].size, out[i].mtime_ns, True
    return sizes, times, found


def _stat(uri: str, info: pafs.FileInfo) -> FileStat | None:
    return FileStat(uri, int(info.size or 0), mtime_ns_of(info)) if info.is_file else None


def _stat_s3(uris: Sequence[str], folders: dict[str, list[int]], out: list[FileStat | None],
             page_size: int) -> None:
    """Fill ``out`` for S3 objects: list the folders naming two or more, HEAD the rest."""
    client = boto3_client() if any(len(rows) > 1 for rows in folders.values()) else None
    listed = {f: rows for f, rows in folders.items() if len(rows) > 1}
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        unlisted = pool.map(lambda f: _list_folder(client, f, [uris[i] for i in listed[f]], out, listed[f],
                                                   page_size), listed)
        heads = [i for rows in unlisted for i in rows]
        heads += [rows[0] for rows in folders.values() if len(rows) == 1]

        def head(i: int) -> None:
            fs, path = resolve(uris[i])
            out[i] = _stat(uris[i], call("reading", uris[i], lambda: fs.get_file_info(path)))

        list(pool.map(head, heads))


def _list_folder(client, folder: str, uris: list[str], out: list[FileStat | None], rows: list[int],
                 page_size: int) -> list[int]:
    """List the keys of ``folder`` from its first to its last wanted object, page by page, filling ``out``;
    stop once the pages spent reach the objects still unseen (a HEAD each costs no more then). Returns
    the rows left to HEAD; a wanted object the finished listing passed without seeing is missing."""
    bucket, prefix = folder[len("s3://"):].split("/", 1) if "/" in folder[len("s3://"):] else \
        (folder[len("s3://"):], "")
    prefix = prefix + "/" if prefix else ""
    wanted = dict(zip((u[len("s3://") + len(bucket) + 1:] for u in uris), rows, strict=True))
    keys = sorted(wanted)
    args = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/", "MaxKeys": page_size,
            "StartAfter": keys[0][:-1]}
    pages, last = 0, ""
    while True:
        page = call("listing", folder, lambda a=dict(args): client.list_objects_v2(**a))
        pages += 1
        for item in page.get("Contents", []):
            if item["Key"] in wanted:
                seconds = calendar.timegm(item["LastModified"].utctimetuple())
                out[wanted[item["Key"]]] = FileStat(f"s3://{bucket}/{item['Key']}", int(item["Size"]),
                                                    seconds * 1_000_000_000)
        last = max([last] + [c["Key"] for c in page.get("Contents", [])] +
                   [c["Prefix"] for c in page.get("CommonPrefixes", [])])
        unseen = [wanted[k] for k in keys[bisect.bisect_right(keys, last):]]
        if not page.get("IsTruncated") or not unseen:
            return []
        if pages >= len(unseen):
            return unseen
        args["ContinuationToken"] = page["NextContinuationToken"]
