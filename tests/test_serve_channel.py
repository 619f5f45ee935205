"""The index partitions' direct channel (puma.serve.channel): the ingress's fan-out over it answers
exactly as one index, a client without the app's token is refused, a partition that goes away
gives a clean 503 at once (or after serve.partition_timeout_s when it hangs), and its replacement
is found at its new address; each replica's channel load reaches Serve's autoscaling policy.

Ray-free: real IndexPartition objects (the deployment's class, its channel in a thread) over real
shards and TCP; the ingress side is puma.serve.fanout.PartitionedIndex with its ``learn`` pointed at
the partitions themselves instead of Serve's broadcast through the deployment handles.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from test_serve_partitions import CATALOGUES, DATASETS, DIM, SHARD, table

from puma import storage
from puma.config import IndexConfig, load_config
from puma.index import add_items, build_index
from puma.serve.app import IndexPartition, PartitionedIndex, deployment_options
from puma.serve.autoscale import CHANNEL_ONGOING, partition_replicas
from puma.serve.channel import LENGTH, ChannelError, pack, read_frame
from puma.serve.channel_client import Connection
from puma.serve.channel_server import ChannelServer
from puma.serve.errors import RequestError
from puma.serve.live_index import LiveIndex
from puma.serve.partitions import Partition

TOKEN = "the-apps-token"


def partition(uri: str, p: int, count: int, token: str = TOKEN):
    """The IndexPartition deployment's own class, as a replica builds it (its channel listening)."""
    cfg = IndexConfig(uri=uri, use_gpu=False, nprobe=4)
    return IndexPartition.func_or_class(cfg, DIM, storage.current_config(), 60.0, 30.0, Partition(p, count),
                                        token)


def close(parts: list) -> None:
    for part in parts:
        part.channel.stop()
        part.index.stop()


def fan_out(parts: list, timeout_s: float = 60.0, token: str = TOKEN) -> PartitionedIndex:
    """The ingress's PartitionedIndex, learning each partition's address from ``parts[p]`` (an
    IndexPartition or a bare ChannelServer; read at each learning: replace an entry to move a partition)."""
    def learn(p: int):
        async def addresses() -> list:
            part = parts[p]
            return [part.address() if isinstance(part, IndexPartition.func_or_class) else part.address]
        return addresses
    return PartitionedIndex(list(range(len(parts))), timeout_s, token, learn=learn)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("channel") / "index")
    build_index(uri, table(0, 300, 0), IndexConfig(index_type="ivf_flat", nlist=8, shard_size=SHARD),
                model_id="m")
    add_items(uri, table(300, 180, 1), model_id="m")  # 8 shards of 60
    return uri


async def ask_many(one: LiveIndex, fan: PartitionedIndex, n: int, seed: int) -> int:
    """n random vector and item queries with random filters, answered by the fan-out over the channels
    and by one index: identical answers; returns the hits compared."""
    rng = np.random.default_rng(seed)
    ids = [i for i in one.state.index.to_item_ids(np.arange(one.state.index.ntotal)) if i]
    compared = 0
    for i in range(n):
        k = int(rng.integers(1, 25))
        datasets = tuple(rng.choice(DATASETS, int(rng.integers(0, 3)), replace=False).tolist())
        names = ["shop_a", CATALOGUES[1]]  # by folder name and by URI
        catalogues = tuple(rng.choice(names, int(rng.integers(0, 2)), replace=False).tolist())
        if i % 4 == 3:
            item, include_self = ids[int(rng.integers(len(ids)))], bool(i % 8 == 3)
            want = one.search_item(item, k, datasets, catalogues, include_self)
            got = await fan.search_item(item, k, datasets, catalogues, include_self, None, "")
        else:
            q = rng.standard_normal(DIM).astype(np.float32)
            q /= np.linalg.norm(q)
            want = one.search_vector(q, k, datasets, catalogues)
            got = await fan.search_vector(q, k, datasets, catalogues, None, "")
        assert got == want, f"query {i} (k={k}, {datasets}, {catalogues})"
        compared += len(want)
    return compared


def test_the_fan_out_over_the_channels_answers_600_queries_exactly_like_one_index(index: str):
    one = LiveIndex(IndexConfig(uri=index, use_gpu=False, nprobe=4), "m", DIM)
    parts = [partition(index, p, 2) for p in range(2)]
    try:
        assert [p.index.served.get().state.items for p in parts] == [240, 240]
        fan = fan_out(parts)

        queries = [one.vector_of(f"item/{i:05d}") for i in range(0, 480, 8)]

        async def run() -> tuple[int, list]:
            compared = await ask_many(one, fan, 600, seed=7)
            together = await asyncio.gather(*(fan.search_vector(q, 10, (), (), None, "") for q in queries))
            return compared, together

        compared, together = asyncio.run(run())
        assert compared > 5000
        assert together == [one.search_vector(q, 10) for q in queries]
        answered = [p.channel.requests for p in parts]
        assert min(answered) >= 600 + 60  # every query reached both partitions over their channels
        with pytest.raises(RequestError) as bad:  # a partition's refusal crosses the channel as it is
            asyncio.run(fan.search_vector(np.ones(DIM + 1, np.float32), 5, (), (), None, ""))
        assert bad.value.status == 422 and f"holds {DIM}-dim" in bad.value.reason
    finally:
        close(parts)


def test_calls_that_wait_together_share_one_search_and_answer_as_each_alone(index: str):
    """The channel's batched search_part: the unfiltered calls of a batch are one FAISS search per
    version, trimmed to each call's k; filtered and malformed calls get their own answers, in order."""
    part = partition(index, 0, 2)
    try:
        rng = np.random.default_rng(3)
        q = rng.standard_normal((12, DIM)).astype(np.float32)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        calls = [[q[i], int(rng.integers(1, 20)), ["cub"] if i % 4 == 1 else [], [], None, ""]
                 for i in range(12)]
        calls[5][0] = np.ones(DIM + 2, np.float32)  # a wrong length: its own 422, the others answered
        alone = []
        for call in calls:
            try:
                alone.append(part._search_part_sent(*call))
            except RequestError as exc:
                alone.append(exc)
        frames = part.channel._answer_all([[i, "search_part", call] for i, call in enumerate(calls)])
        answers = [read_answer(f) for f in frames]
        assert [a[0] for a in answers] == list(range(12))
        assert answers[5][1] == 422 and isinstance(alone[5], RequestError)
        for i, (_, status, value) in enumerate(answers):
            if i != 5:
                assert status == 0 and value == normalised(alone[i]), f"call {i}"
        assert sum(len(a[2]["hits"]) for a in answers if a[1] == 0) > 50
    finally:
        close([part])


def read_answer(frame: bytes) -> list:
    from puma.serve.channel import unpack

    return unpack(frame[LENGTH.size:])


def normalised(answer: dict) -> dict:
    """An answer as it crosses the channel (tuples become lists)."""
    from puma.serve.channel import unpack

    return unpack(pack(answer)[LENGTH.size:])


def test_a_client_without_the_apps_token_is_refused(index: str):
    part = partition(index, 0, 1)
    address = tuple(part.address())
    try:
        with pytest.raises(ChannelError, match="refused the channel: wrong token"):
            asyncio.run(Connection.open(address, "another-apps-token"))

        async def request_without_hello():
            reader, writer = await asyncio.open_connection(*address)
            writer.write(pack([0, "search_part", [np.ones(DIM, np.float32), 5, [], [], None, ""]]))
            reply = await read_frame(reader)
            rest = await reader.read()  # the server closed: b""
            writer.close()
            return reply, rest

        async def huge_hello() -> bytes:  # a frame of 100 MB announced before any token: closed unread
            reader, writer = await asyncio.open_connection(*address)
            writer.write(LENGTH.pack(100_000_000) + b"x" * 1000)
            rest = await reader.read()
            writer.close()
            return rest

        reply, rest = asyncio.run(request_without_hello())
        assert reply[0] == "refused" and rest == b""
        assert asyncio.run(huge_hello()) == b""
        with pytest.raises(RequestError) as refused:
            asyncio.run(fan_out([part], token="another-apps-token").search_vector(
                np.ones(DIM, np.float32) / 4, 5, (), (), None, ""))
        assert refused.value.status == 503 and "refused the channel" in refused.value.reason
        assert part.channel.requests == 0  # nothing was searched for them
    finally:
        close([part])
    with pytest.raises(ValueError, match="non-empty token"):
        ChannelServer({}, "", "127.0.0.1")


def test_a_partition_gone_gets_503_at_once_and_its_replacement_is_found_at_its_new_address(index: str):
    one = LiveIndex(IndexConfig(uri=index, use_gpu=False, nprobe=4), "m", DIM)
    parts = [partition(index, p, 2) for p in range(2)]
    fan = fan_out(parts, timeout_s=600.0)  # a wait for the timeout would be a hang here
    q = one.vector_of("item/00042")

    async def scenario() -> dict:
        seen = {"before": await fan.search_vector(q, 10, (), (), None, "")}
        old = parts[1].address()
        parts[1].channel.stop()  # its replica died: the connection closes, the port refuses
        for attempt in ("first", "second"):  # the next learning still gives the dead address
            try:
                await fan.search_vector(q, 10, (), (), None, "")
            except RequestError as exc:
                seen[attempt] = exc
        parts[1] = partition(index, 1, 2)  # Serve's replacement: a new port
        seen["moved"] = old != parts[1].address()
        seen["after"] = await fan.search_vector(q, 10, (), (), None, "")
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        close(parts)
    assert seen["before"] == one.search_vector(q, 10) == seen["after"] and seen["moved"]
    for attempt in ("first", "second"):
        assert seen[attempt].status == 503, seen[attempt]
        assert "index partition index-1 is unavailable" in seen[attempt].reason, seen[attempt].reason


def test_a_partition_that_hangs_gets_503_after_the_partition_timeout(index: str):
    release = threading.Event()
    hung = ChannelServer({"search_part": lambda *args: release.wait(60)}, TOKEN, "127.0.0.1")
    hung.start()
    live = partition(index, 0, 2)
    fan = fan_out([live, hung], timeout_s=0.5)
    try:
        with pytest.raises(RequestError) as late:
            asyncio.run(fan.search_vector(np.ones(DIM, np.float32) / 4, 5, (), (), None, ""))
    finally:
        release.set()
        hung.stop()
        close([live])
    assert late.value.status == 503 and "index-1 did not answer within 0.5 s" in late.value.reason


def test_the_channels_load_reaches_the_autoscaling_policy():
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    release = threading.Event()
    server = ChannelServer({"wait": lambda: release.wait(60)}, TOKEN, "127.0.0.1", threads=3)
    server.start()

    async def three_in_flight() -> float:
        connection = await Connection.open(server.address, TOKEN)
        calls = [asyncio.ensure_future(connection.call("wait", (), 60)) for _ in range(3)]
        while server._ongoing < 3:
            await asyncio.sleep(0.01)
        server.ongoing()  # a new averaging window, with 3 in flight all along
        await asyncio.sleep(0.05)
        load = server.ongoing()
        release.set()
        assert await asyncio.gather(*calls) == [True, True, True]
        return load

    try:
        assert asyncio.run(three_in_flight()) == pytest.approx(3.0)
    finally:
        server.stop()
    assert server.requests == 3 and server._ongoing == 0

    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=2)
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="index-0", app_name="puma-search", current_num_replicas=2,
        target_num_replicas=2, running_replicas=[], total_num_requests=2.0, total_queued_requests=0.0,
        aggregated_metrics={CHANNEL_ONGOING: {"a": 3.0, "b": 5.0}}, raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)
    assert partition_replicas(ctx) == (5.0, {})  # (2 through handles + 8 on the channels) / 2 per replica
    options = deployment_options(load_config(None, []), use_gpu=False)["index"]
    deployment = IndexPartition.options(**options, name="index-0")  # Serve takes the policy
    policy = deployment._deployment_config.autoscaling_config.policy
    assert policy.get_policy()(ctx) == (5.0, {})  # what Serve's controller will run (pickled by value)


def test_a_channel_that_cannot_listen_says_where_in_one_line():
    server = ChannelServer({}, TOKEN, "203.0.113.1")  # TEST-NET-3: not an address of this machine
    with pytest.raises(ChannelError, match="could not listen on 203.0.113.1"):
        server.start()
