"""The partition's side of the direct channel (puma.serve.channel): an asyncio server in a thread of
the IndexPartition replica (puma.serve.holders), on its node's IP and an ephemeral port. It admits
clients holding the app's token and answers their requests from a pool of worker threads, the
waiting calls of a method with a batched form in one go (e.g. one FAISS search for many queries).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from puma.serve.channel import PROTOCOL, ChannelError, no_delay, pack, read_frame
from puma.serve.errors import RequestError

log = logging.getLogger(__name__)

MAX_BATCH = 64  # requests one worker runs in one go
CONNECT_TIMEOUT_S = 5.0  # a client must present its token within this
HELLO_LIMIT = 4096  # bytes of that first frame (no large frame before the token is checked)


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
        no_delay(writer)
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

