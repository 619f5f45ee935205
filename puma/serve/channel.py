"""The index partitions' direct channel: the ingress asks them for ``search_part`` and ``vector_of``
over TCP of its own instead of through Ray calls (puma.serve.app.PartitionedIndex).

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
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np

from puma.serve.errors import RequestError

log = logging.getLogger(__name__)

PROTOCOL = ("puma-channel", 1)
LENGTH = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024  # a larger length is a broken or hostile peer, not an answer
NDARRAY = 1  # msgpack extension code of a numpy array
MAX_BATCH = 64  # requests one worker runs in one go
CONNECT_TIMEOUT_S = 5.0  # a client must present its token within this
HELLO_LIMIT = 4096  # bytes of that first frame (no large frame before the token is checked)
RELEARN_S = 5.0  # how often a client asks for its partition's replicas while calls flow


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


# ----------------------------------------------------------------------------- the partition's side


class ChannelServer:
    """Serves ``methods`` (name -> function) to clients holding ``token`` on ``host`` and an ephemeral
    port, from a daemon thread with its own event loop. ``threads`` workers answer the requests; a free
    worker takes its share of those waiting and answers them in one go in its thread (FAISS releases
    the GIL: the workers' searches overlap)."""

    def __init__(self, methods: dict[str, Callable], token: str, host: str, threads: int = 2,
                 batched: dict[str, Callable] | None = None) -> None:
        if not token:
            raise ValueError("the partition channel needs a non-empty token")
        self.methods, self.token, self.host, self.threads = methods, token, host, max(1, threads)
        self.batched = batched or {}  # name -> f(list of args) -> a result or a RequestError per call
        self.address: tuple[str, int] | None = None
        self.requests = 0  # answered so far
        self._ongoing = 0  # received, not yet answered
        now = time.monotonic()
        self._load = [0.0, now, now]  # for ``ongoing``: its integral over time, since when, last change
        self._load_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="channel")

    def start(self, timeout_s: float = 30.0) -> tuple[str, int]:
        """Listen; returns (host, port) once the server accepts connections."""
        ready, failed = threading.Event(), []
        self._thread = threading.Thread(target=self._run, args=(ready, failed), name="channel", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failed:
            why = failed[0] if failed else f"not listening after {timeout_s:g} s"
            raise ChannelError(f"the partition channel could not listen on {self.host}: {why}")
        return self.address

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop listening and close every connection (their clients' calls in flight fail at once)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def ongoing(self) -> float:
        """Requests in flight, averaged over the time since the last call (what this replica reports to
        Serve's autoscaler)."""
        with self._load_lock:
            now = time.monotonic()
            area, since, last = self._load
            area += self._ongoing * (now - last)
            self._load = [0.0, now, now]
        return area / (now - since) if now > since else float(self._ongoing)

    def _run(self, ready: threading.Event, failed: list) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(asyncio.start_server(self._serve, self.host, 0))
        except OSError as exc:
            failed.append(exc)
            ready.set()
            return
        self.address = (self.host, server.sockets[0].getsockname()[1])
        self._queue: asyncio.Queue = asyncio.Queue()
        for _ in range(self.threads):
            loop.create_task(self._work(self._queue))
        ready.set()
        try:
            loop.run_forever()
        finally:  # stopped: close the server and the connections (their tasks end), then the workers
            server.close()
            for writer in self._writers:
                writer.transport.abort()
            clients = [t for t in asyncio.all_tasks(loop) if t.get_coro().__name__ == "_serve"]
            if clients:
                loop.run_until_complete(asyncio.wait(clients, timeout=1.0))
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client: the token first, then its requests into the queue until it closes."""
        _no_delay(writer)
        self._writers.add(writer)
        try:
            if not await self._admit(reader, writer):
                return
            while True:
                request = await read_frame(reader)
                self._count(+1)
                self._queue.put_nowait((writer, request))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError | ConnectionResetError):
                log.warning("partition channel: dropping a client: %s", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the client's first frame is the protocol and this app's token (else refuse, close)."""
        try:
            hello = await asyncio.wait_for(read_frame(reader, HELLO_LIMIT), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False
        ok = (isinstance(hello, list) and len(hello) == 3 and tuple(hello[:2]) == PROTOCOL
              and isinstance(hello[2], str) and hmac.compare_digest(hello[2].encode(), self.token.encode()))
        reply = ["ok"] if ok else ["refused", f"wrong token or protocol (this server speaks {PROTOCOL})"]
        writer.write(pack(reply))
        await writer.drain()
        return ok

    async def _work(self, queue: asyncio.Queue) -> None:
        """Take a request and this worker's share of those waiting, answer them in the worker's thread
        (one hop there and back for all), send the answers."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            for _ in range(min(MAX_BATCH - 1, queue.qsize() // self.threads)):
                batch.append(queue.get_nowait())
            frames = await loop.run_in_executor(self._pool, self._answer_all, [r for _, r in batch])
            for (writer, _), frame in zip(batch, frames, strict=True):
                if not writer.is_closing():
                    writer.write(frame)
            self._count(-len(batch))
            self.requests += len(batch)

    def _answer_all(self, requests: list) -> list[bytes]:
        """Answer frames in request order; calls of a method with a batched form that wait together
        run as one call of it (e.g. one FAISS search for the queries of a batch)."""
        frames: list = [None] * len(requests)
        for name, run in self.batched.items():
            rows = [i for i, r in enumerate(requests) if _well_formed(r) and r[1] == name]
            if len(rows) < 2:
                continue
            try:
                results = run([requests[i][2] for i in rows])
            except Exception:  # noqa: BLE001 - answered one by one below, each with its own error
                log.exception("partition channel: a batch of %d %s calls failed", len(rows), name)
                continue
            for i, result in zip(rows, results, strict=True):
                rid = requests[i][0]
                frames[i] = pack([rid, result.status, result.reason] if isinstance(result, RequestError)
                                 else [rid, 0, result])
        return [frame if frame is not None else self._answer(r) for frame, r in zip(frames, requests,
                                                                                     strict=True)]

    def _answer(self, request) -> bytes:
        """One request's answer frame: [id, 0, result] or [id, status, reason]."""
        rid = request[0] if isinstance(request, list) and request else None
        try:
            _, method, args = request
            if method not in self.methods:
                raise RequestError(400, f"the partition channel has no method {method!r}; it serves "
                                        f"{', '.join(sorted(self.methods))}")
            return pack([rid, 0, self.methods[method](*args)])
        except RequestError as exc:
            return pack([rid, exc.status, exc.reason])
        except Exception as exc:  # noqa: BLE001 - the ingress answers 500 with the reason; the replica logs it
            log.exception("partition channel: %r failed", request)
            return pack([rid, 500, f"{type(exc).__name__}: {exc}"])

    def _count(self, delta: int) -> None:
        with self._load_lock:
            now = time.monotonic()
            self._load[0] += self._ongoing * (now - self._load[2])
            self._load[2] = now
            self._ongoing += delta


def _well_formed(request) -> bool:
    return isinstance(request, list) and len(request) == 3 and isinstance(request[2], list)


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """Small frames go out at once (no Nagle), and a peer that vanished is noticed eventually (keepalive)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


# ----------------------------------------------------------------------------- the ingress's side


class Connection:
    """One admitted connection to a partition replica, on the event loop that opened it: requests in
    flight are matched to their answers by id."""

    def __init__(self, address: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.address, self._reader, self._writer = address, reader, writer
        self.error: ChannelError | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._task = asyncio.get_running_loop().create_task(self._read_answers())

    @classmethod
    async def open(cls, address: tuple[str, int], token: str) -> Connection:
        """Connect and present the token; ChannelError when refused or unreachable."""
        where = f"{address[0]}:{address[1]}"
        try:
            reader, writer = await asyncio.open_connection(*address)
            _no_delay(writer)
            writer.write(pack([*PROTOCOL, token]))
            reply = await read_frame(reader)
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise ChannelError(f"cannot open the partition channel at {where}: {exc or type(exc).__name__}") \
                from None
        if reply != ["ok"]:
            writer.close()
            raise ChannelError(f"the partition at {where} refused the channel: {reply[-1]}")
        return cls(address, reader, writer)

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(self, method: str, args: tuple, timeout_s: float):
        """``method(*args)`` on the replica: its result; RequestError for its refusals, ChannelError when
        the connection breaks first, asyncio.TimeoutError after ``timeout_s``."""
        if self.error is not None:
            raise self.error
        rid, loop = next(self._ids), asyncio.get_running_loop()
        future = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, future)  # a timer, not a task per call (wait_for's)
        self._pending[rid] = future
        try:
            self._writer.write(pack([rid, method, list(args)]))
            return await future
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    async def _read_answers(self) -> None:
        try:
            while True:
                rid, status, value = await read_frame(self._reader)
                future = self._pending.pop(rid, None)
                if future is not None and not future.done():
                    future.set_result(value) if status == 0 else future.set_exception(_failure(status, value))
        except asyncio.IncompleteReadError:
            self.close("was closed by the replica")
        except (OSError, ValueError, TypeError) as exc:
            self.close(f"broke ({type(exc).__name__}: {exc})")

    def close(self, why: str = "was closed") -> None:
        """Fail every request in flight with ChannelError (``why``) and close."""
        if self.error is None:
            self.error = ChannelError(f"the partition channel to {self.address[0]}:{self.address[1]} {why}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self.error)
        self._pending.clear()
        self._writer.close()
        if self._task is not asyncio.current_task():
            self._task.cancel()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


def _failure(status: int, reason: str) -> Exception:
    """A partition's refusal as the ingress raises it: a RequestError (4xx, 503), else an internal error."""
    if status < 500 or status == 503:
        return RequestError(status, reason)
    return RuntimeError(f"an index partition failed: {reason}")


class PartitionClient:
    """The ingress's channel to one partition: a connection to each of its replicas, whose addresses
    ``learn`` gives (IndexPartition.address of every replica, through the deployment handle's
    broadcast): all of them at the first call, again every ``relearn_s`` while calls flow (replicas
    Serve added) and whenever no connection is left. Each call goes to the connection with the fewest
    calls in flight. Use from one event loop.

    A connection that breaks or is refused is dropped and its calls are tried once more on another
    replica (learnt again when none is left: Serve gives a replaced replica a new address); one that
    does not answer within the call's time is dropped too (its node may be gone without a word)."""

    def __init__(self, name: str, learn: Callable[[], Awaitable[list]], token: str,
                 learn_timeout_s: float = 5.0, relearn_s: float = RELEARN_S) -> None:
        # learn_timeout_s: a learning gives up after this (a replica on a lost node may hold its answer), and
        # the next call starts another
        self.name, self._learn, self.token, self.relearn_s = name, learn, token, relearn_s
        self.learn_timeout_s = learn_timeout_s
        self.connections: dict[tuple[str, int], Connection] = {}
        self._learning: asyncio.Future | None = None
        self._learnt_at = -float("inf")
        self._turn = itertools.count()

    async def call(self, method: str, args: tuple, timeout_s: float):
        """``method(*args)`` on one replica of the partition within ``timeout_s`` in all (learning
        addresses and connecting included): its result, or RequestError for its refusal; ChannelError
        when no replica can answer, asyncio.TimeoutError when none answered in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in (1, 2):
            connection = await self._pick(deadline)
            try:
                return await connection.call(method, args, deadline - loop.time())
            except ChannelError:
                if attempt == 2:
                    raise
            except asyncio.TimeoutError:
                connection.close(f"did not answer within {timeout_s:g} s")
                raise

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()
        self.connections.clear()

    async def _pick(self, deadline: float) -> Connection:
        live = self._live()
        if not live:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(asyncio.shield(self._relearn()), max(0.0, deadline - loop.time()))
            live = self._live()
            if not live:
                raise ChannelError(f"no replica of {self.name} answers on the partition channel")
        elif asyncio.get_running_loop().time() - self._learnt_at > self.relearn_s:
            self._relearn()  # in the background: finds the replicas Serve added
        turn = next(self._turn)
        return min(live, key=lambda c: (c.in_flight, (live.index(c) - turn) % len(live)))

    def _live(self) -> list[Connection]:
        for address in [a for a, c in self.connections.items() if not c.alive]:
            del self.connections[address]
        return list(self.connections.values())

    def _relearn(self) -> asyncio.Future:
        """The learning in progress (started if none): the replicas' addresses; connect to new ones."""
        if self._learning is None or self._learning.done():
            self._learnt_at = asyncio.get_running_loop().time()
            self._learning = asyncio.ensure_future(asyncio.wait_for(self._learn_all(), self.learn_timeout_s))
            self._learning.add_done_callback(_retrieved)
        return self._learning

    async def _learn_all(self) -> None:
        addresses = {(str(host), int(port)) for host, port in await self._learn()}
        new = [a for a in addresses if a not in self.connections or not self.connections[a].alive]
        opened = await asyncio.gather(*(Connection.open(a, self.token) for a in new), return_exceptions=True)
        for address, connection in zip(new, opened, strict=True):
            if isinstance(connection, Connection):
                self.connections[address] = connection
            else:
                log.warning("partition channel: %s: %s", self.name, connection)
        if not self._live():
            failed = [c for c in opened if isinstance(c, BaseException)]
            raise failed[0] if failed else ChannelError(f"no replica of {self.name} is running")


def _retrieved(future: asyncio.Future) -> None:
    """Mark a background learning's failure as seen (the calls that awaited it got it already)."""
    if not future.cancelled() and future.exception() is not None:
        log.debug("partition channel: learning an address failed: %s", future.exception())
