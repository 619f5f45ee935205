"""The ingress's side of the direct channel (puma.serve.channel): a PartitionClient per partition
(puma.serve.fanout), holding a Connection to each of the partition's replicas, with several requests
in flight on each, matched to their answers by id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

from puma.serve.channel import PROTOCOL, ChannelError, no_delay, pack, read_frame
from puma.serve.errors import RequestError

log = logging.getLogger(__name__)

RELEARN_S = 5.0  # how often a client asks for its partition's replicas while calls flow


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
            no_delay(writer)
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
