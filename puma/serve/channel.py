"""The index partitions' direct channel: the ingress asks them for ``search_part`` and ``vector_of``
over TCP of its own instead of through Ray calls (puma.serve.fanout.PartitionedIndex).

Why: a query fans out to every partition, and on a Ray call the time goes to the machinery, not the
search. Timed from inside a replica (2 cores, Ray 2.60, no-op methods, p50): a call through a
DeploymentHandle 4-5 ms, two at once 6-8 ms; a plain async actor call 1.5-2 ms; a call on this
channel 0.35 ms, two at once 0.6 ms (a write and a read on an open socket, msgpack both ways).

    ingress (PartitionedIndex)                    IndexPartition replica (a Serve deployment)
    PartitionClient, one per partition  --TCP-->  ChannelServer: an asyncio server in a thread of the
      every replica's address learnt through          replica, on its node's IP and an ephemeral port;
      the deployment handle (``address()``),          a free worker answers its share of the waiting
      a connection to each, several requests          requests in one go, in its own thread
      in flight on each (request ids)

The partitions stay Serve deployments: Serve places, restarts and autoscales them (the replicas
report their channel's load to the autoscaler, ``ChannelServer.ongoing``), and the calls that are not
on a query's path (stats, health, thumbnails, prepare) stay on the handles.

Frames: a 4-byte big-endian length, then msgpack (unpacking runs no code, unlike pickle); numpy
arrays travel as an extension type (dtype, shape, bytes), tuples arrive as lists. A connection
opens with ``["puma-channel", 1, token]`` (the app's random token, puma.serve.app.build_app); the
server answers ``["ok"]``, or a refusal and closes. Then requests ``[id, method, args]`` and answers
``[id, status, value]``: status 0 and the method's result, or an HTTP status and its reason (a
RequestError's, 500 for any other failure), in any order.

Here: the protocol, its frames and errors. The replica's side is puma.serve.channel_server, the
ingress's puma.serve.channel_client.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import numpy as np

PROTOCOL = ("puma-channel", 1)
LENGTH = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024  # a larger length is a broken or hostile peer, not an answer
NDARRAY = 1  # msgpack extension code of a numpy array


class ChannelError(ConnectionError):
    """A partition replica that cannot answer over its channel now: refused, broken, gone, or it refused
    the token."""


# ----------------------------------------------------------------------------- frames


def _encode(value):
    if isinstance(value, np.ndarray):
        return msgpack.ExtType(NDARRAY, msgpack.packb([value.dtype.str, list(value.shape), value.tobytes()]))
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} over the partition channel")


def _decode(code: int, data: bytes):
    if code != NDARRAY:
        raise ValueError(f"unknown msgpack extension {code} on the partition channel")
    dtype, shape, raw = msgpack.unpackb(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()  # writable, like a sent one


def pack(value) -> bytes:
    """One frame: length + msgpack of ``value`` (numpy arrays and scalars included)."""
    body = msgpack.packb(value, default=_encode, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes):
    """A frame's value (without its length)."""
    return msgpack.unpackb(body, ext_hook=_decode, raw=False, strict_map_key=False)


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME):
    """The next frame's value; IncompleteReadError at the end of the stream, ChannelError for a frame
    longer than ``limit`` bytes."""
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if size > limit:
        raise ChannelError(f"a frame of {size} bytes on the partition channel (at most {limit})")
    return unpack(await reader.readexactly(size))


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Small frames go out at once (no Nagle), and a peer that vanished is noticed eventually (keepalive)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
