"""KV-cache events over real ZMQ sockets on loopback: the emulator's vLLM-format publisher (in-process, and as a
real `skylb emulator` process) followed by SkyLB's subscriber into the block index: gaps filled by replay, holes
that cannot be filled, corrupt messages, restarts and a killed stream falling back to the trie."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import msgpack
import pytest

from bench.emulator import kv_hash
from bench.emulator.kv_publisher import KVEventPublisher, KVEventsConfig
from skylb.core.kv_events import BlockRemoved, BlockStored
from skylb.core.kv_index import BlockIndex
from skylb.engines.kv_subscriber import KVEventSubscriber, KVEventsEndpoint, KVEventSubscribers
from tests.procs import free_ports

pytestmark = pytest.mark.timeout(30)


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 16 * len(hashes), 16)


async def _until(condition, timeout_s: float = 5.0) -> None:
    """Wait (polling every 10 ms) until ``condition()`` holds; fail the test after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


@contextlib.asynccontextmanager
async def _stream(buffer_steps: int = 100, replay: bool = True, port: int = 0, replay_port: int = 0):
    """A publisher bound on loopback and a subscriber of replica "r" into a fresh index; both closed at exit."""
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay_port}" if replay else None, buffer_steps=buffer_steps,
                            topic="kv-events")
    publisher = KVEventPublisher(config, host="127.0.0.1")
    publisher.start()
    index = BlockIndex(1000)
    source = KVEventsEndpoint(publisher.endpoint, publisher.replay_endpoint, "kv-events")
    task = asyncio.create_task(KVEventSubscriber(index, "r", source, replay_timeout_s=0.5).run())
    try:
        await _until(lambda: index.is_live("r"))
        yield publisher, index
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()


async def _settle(publisher, index: BlockIndex, *events: tuple) -> None:
    """Publish until the subscriber has joined (a PUB drops messages before the subscription arrives), then the
    events and a marker block; returns once the index holds the marker (so every event before it was applied)."""
    while index.replica("r").batches == 0:
        publisher.publish([_stored(999)])
        await asyncio.sleep(0.02)
    for batch in events:
        publisher.publish([batch])
    marker = 10**9 + publisher._seq
    publisher.publish([_stored(marker)])
    await _until(lambda: index.holders(marker))


async def test_dropped_sequence_numbers_are_filled_from_the_replay_socket():
    """Three batches kept off the PUB socket (a high-water-mark loss) show as one gap; the subscriber asks the
    replay socket for them and the index ends exactly as if nothing was lost (a removal included)."""
    async with _stream() as (publisher, index):
        await _settle(publisher, index, _stored(1, 2))
        state = index.replica("r")
        before = (state.gaps, state.replayed, state.unfilled_gaps)  # joining may have replayed the first batches
        publisher.drop_next(3)
        for batch in (_stored(3), BlockRemoved([1]), _stored(4), _stored(5)):
            publisher.publish([batch])
        await _until(lambda: index.holders(5))
        assert (state.gaps - before[0], state.replayed - before[1], state.unfilled_gaps - before[2]) == (1, 3, 0)
        assert index.holders(4) and index.holders(3) and not index.holders(1)
        assert index.matched_blocks([1, 2]) == {"r": 0}  # block 1 is gone, so the chain breaks at once
        assert index.matched_blocks([999]) == {"r": 1}


async def test_a_gap_the_replay_buffer_no_longer_holds_drops_the_replica():
    """With a 2-batch replay buffer, 5 lost batches cannot be filled: the replica's earlier blocks are dropped (a
    lost removal could leave a block it no longer holds) and what follows is kept; the gap is counted unfilled."""
    async with _stream(buffer_steps=2) as (publisher, index):
        await _settle(publisher, index, _stored(1))
        publisher.drop_next(5)
        for h in range(10, 16):
            publisher.publish([_stored(h)])
        await _until(lambda: index.holders(15))
        state = index.replica("r")
        assert state.gaps == 1 and state.unfilled_gaps == 1
        assert not index.holders(1) and index.holders(14) and not index.holders(12)


async def test_corrupt_and_unknown_messages_are_counted_and_never_stop_the_subscriber():
    """A two-frame message, a short sequence number, a payload that is not msgpack and a batch with an unknown
    event are counted as skipped; the events after them still arrive."""
    async with _stream() as (publisher, index):
        await _settle(publisher, index)
        pub = publisher._pub
        seq = publisher._seq
        pub.send_multipart([b"kv-events", b"\x00"])
        pub.send_multipart([b"kv-events", b"\x01", b"x"])
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), b"\xc1garbage"])
        pub.send_multipart([b"kv-events", (seq + 1).to_bytes(8, "big"),
                            msgpack.packb([1.0, [{"type": "BlockPinned"}, {"type": "BlockStored"}]])])
        publisher._seq = seq + 2
        publisher.publish([_stored(7)])
        await _until(lambda: index.holders(7))
        state = index.replica("r")
        assert (state.skipped_corrupt, state.skipped_unknown, state.gaps) == (4, 1, 0)


async def test_a_restarted_engine_is_dropped_then_followed_again():
    """The engine's stream goes away (its sockets close): the replica turns stale at once and leaves
    matched_tokens (the router uses the trie); an engine started again on the same port is live again, starting
    from nothing and catching up from its own replay buffer."""
    # Both ports fixed: the engine started again binds the same two, as a restarted vLLM does with its config (with
    # "tcp://*:0" the replay socket moved and the catch-up asked the old port, so a batch lost to the slow joiner
    # stayed lost).
    port, replay_port = free_ports(2)
    async with _stream(port=port, replay_port=replay_port) as (publisher, index):
        await _settle(publisher, index, _stored(1, 2))
        assert index.matched_tokens([1, 2]) == {"r": 32}
        await publisher.close()
        await _until(lambda: not index.is_live("r"))
        assert index.matched_tokens([1, 2]) == {} and index.holders(1) == []
        again = KVEventPublisher(publisher.config, host="127.0.0.1")
        again.start()
        try:
            await _until(lambda: index.is_live("r"))
            assert index.matched_tokens([1, 2]) == {"r": 0}
            again.publish([_stored(1)])  # may be lost to the slow joiner: the next batch's catch-up replays it
            await asyncio.sleep(0.1)
            again.publish([_stored(3)])
            await _until(lambda: index.holders(3))
            assert index.matched_tokens([1, 2]) == {"r": 16}
        finally:
            await again.close()


@pytest.mark.parametrize("endpoint, replay", [("tcp://127.0.0.1", None), ("127.0.0.1:5557", None),
                                              ("tcp://*:5557", None), ("tcp://h:99999", None),
                                              ("tcp://h:5557", "tcp://h:")])
def test_an_endpoint_that_is_not_a_zmq_address_is_refused(endpoint, replay):
    """A subscriber endpoint must be tcp://HOST:PORT (a wildcard host binds, it cannot be connected to)."""
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        KVEventsEndpoint(endpoint, replay)


async def test_subscribers_follow_the_membership():
    """KVEventSubscribers starts one subscriber per replica with events and forgets a replica that left."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0")
    publisher = KVEventPublisher(config, host="127.0.0.1")
    publisher.start()
    index = BlockIndex(100)
    subscribers = KVEventSubscribers(index)
    try:
        subscribers.update({"a": KVEventsEndpoint(publisher.endpoint), "b": KVEventsEndpoint(publisher.endpoint)})
        await _until(lambda: index.is_live("a") and index.is_live("b"))
        subscribers.update({"a": KVEventsEndpoint(publisher.endpoint)})
        await asyncio.sleep(0.05)  # b's subscriber has stopped and closed its sockets
        assert "b" not in index.replicas and index.is_live("a")
    finally:
        await subscribers.close()
        await publisher.close()
    assert not index.is_live("a")


async def test_the_emulator_stream_recovers_dropped_batches_then_is_killed_and_falls_back_to_the_trie(procs):
    """A real `skylb emulator --kv-events-config` process: a completion's full prompt blocks arrive as BlockStored
    with vLLM's block hashes (the chain over the ids its /tokenize gives matches all 3 blocks, as a balancer would
    compute it); the next step's batch is dropped mid-run (a
    second prompt overflowing the 4-block cache: its eviction and store) and recovered through the replay socket
    once a third request's batch shows the gap; a prefix-cache reset (AllBlocksCleared) empties the replica in the
    index; SIGKILL of the process then makes the replica stale."""
    http, pub, replay = free_ports(3)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    base = f"http://127.0.0.1:{http}"
    proc = procs.skylb("emulator", "--port", str(http), "--time-scale", "0.01", "--kv-cache-tokens", "64",
                       "--model", "m", "--fault-control", "--kv-events-config", json.dumps(config), name="emu-kv",
                       wait_url=f"{base}/health")
    index = BlockIndex(1000)
    source = KVEventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "kv-events")
    task = asyncio.create_task(KVEventSubscriber(index, "emu", source).run())
    prompts = [[f"{tag}{i}" for i in range(n)] for tag, n in (("w", 50), ("x", 40), ("y", 20))]
    chains = [[kv_hash.external(h) for h in kv_hash.block_hashes(kv_hash.token_ids(p), 16)] for p in prompts]
    try:
        await _until(lambda: index.is_live("emu"))
        await asyncio.sleep(0.2)  # the subscription reaches the PUB socket
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async def complete(words: list[str]) -> None:
                async with session.post(f"{base}/v1/completions",
                                        json={"model": "m", "prompt": " ".join(words), "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()

            async with session.post(f"{base}/tokenize", json={"model": "m", "prompt": " ".join(prompts[0])}) as resp:
                ids = (await resp.json())["tokens"]
            assert chains[0] == [kv_hash.external(h) for h in kv_hash.block_hashes(ids, 16)]
            await complete(prompts[0])
            await _until(lambda: index.matched_tokens(chains[0]) == {"emu": 48})
            state = index.replica("emu")
            before = (state.gaps, state.replayed, state.unfilled_gaps)  # joining may have replayed batch 0
            async with session.put(f"{base}/emulator/kv-events", json={"drop_next": 1}) as resp:
                assert resp.status == 200 and (await resp.json())["drop_next"] == 1
            await complete(prompts[1])
            await asyncio.sleep(0.1)
            assert index.matched_tokens(chains[1]) == {"emu": 0}  # its batch never came on the PUB socket
            await complete(prompts[2])
        await _until(lambda: index.matched_tokens(chains[2]) == {"emu": 16})
        assert (state.gaps - before[0], state.replayed - before[1], state.unfilled_gaps - before[2]) == (1, 1, 0)
        assert index.matched_tokens(chains[1]) == {"emu": 32} and index.matched_tokens(chains[0])["emu"] < 48
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(f"{base}/reset_prefix_cache") as resp:
                assert await resp.json() == {"success": True}
        await _until(lambda: index.replica("emu").cleared == 1)
        assert index.matched_tokens(chains[1]) == {"emu": 0} and index.is_live("emu")
        proc.kill()
        await _until(lambda: not index.is_live("emu"), timeout_s=3)
        assert index.matched_tokens(chains[2]) == {}  # not live: the router uses the prefix trie
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
