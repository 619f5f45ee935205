"""The errors a user can cause or fix, as one family: jobs print them in one line and exit 2.

A ``UserError`` says what went wrong, where (the file, URI, key or item), and what to do. Anything
else escaping a job is an internal error: exit 1 with the traceback. Library code raises the most
specific subclass it has (ConfigError, StorageError, CheckpointError, ...), each of which is also
a UserError; it never prints or exits itself.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can fix (input, config, storage, checkpoint, cluster address, ...)."""
