"""The errors a user can cause or fix, as one family: jobs print them in one line and exit 2.

A ``UserError`` says what went wrong, where (the file, URI, key or item), and what to do. Anything
else escaping a job is an internal error: exit 1 with the traceback. Library code raises the most
specific subclass it has (ConfigError, StorageError, CheckpointError, ...), each of which is also
a UserError; it never prints or exits itself.

:func:`user_error` finds the user's error behind what reaches a job: the exception itself, its
``raise ... from`` causes, and what Ray wraps (a Ray task's ``cause``, a Ray Train run's
``worker_failures`` / ``controller_failure``), so a truncated checkpoint read inside a Train worker
still ends in one line. Missing files and a full, read-only or forbidden filesystem count too.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """A failure the user can fix (input, config, storage, checkpoint, cluster address, ...)."""


class MissingFileError(UserError):
    """A file or object the job was pointed at does not exist."""


class DiskError(UserError):
    """The filesystem refused a write: no space, quota, read-only or no permission."""


# errno -> what to tell the user (the OSError's own text names the file)
FILESYSTEM_ERRNOS = {
    errno.ENOSPC: "out of disk space; free some, or write the output (train.storage_path, ...) elsewhere",
    errno.EDQUOT: "disk quota exceeded; free some, or write the job's output elsewhere",
    errno.EROFS: "read-only file system; point the job's output at a writable location",
    errno.EACCES: "permission denied; check the file's permissions or choose another location",
    errno.EPERM: "operation not permitted; check the file's permissions or choose another location",
}


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (newlines folded), never empty."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def user_error(exc: BaseException) -> UserError | None:
    """The user-fixable error behind ``exc`` (itself, a cause, one wrapped by Ray), or None if internal."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop(0)
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        inner = getattr(current, "cause", None)  # a RayTaskError: the exception its task raised
        if isinstance(current, UserError) and not isinstance(inner, BaseException):
            return current
        found = filesystem_error(current)
        if found is not None:
            return found
        failures = getattr(current, "worker_failures", None)  # ray.train.WorkerGroupError
        pending += [inner, getattr(current, "controller_failure", None), current.__cause__,
                    *(failures.values() if isinstance(failures, dict) else ())]
    return None


def filesystem_error(exc: BaseException) -> UserError | None:
    """A missing file or a refused write as a UserError (the OS text names the file); else None."""
    if isinstance(exc, FileNotFoundError):
        return MissingFileError(one_line(exc))
    if isinstance(exc, OSError) and exc.errno in FILESYSTEM_ERRNOS:
        return DiskError(f"{one_line(exc)}: {FILESYSTEM_ERRNOS[exc.errno]}")
    return None
