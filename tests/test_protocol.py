"""The balancer-to-balancer protocol: msgpack peer status encoding, validation and tokens."""

from __future__ import annotations

import random

import msgpack
import pytest

from skylb.balancer.protocol import ProtocolError, decode_status, encode_status, queued_ms, token_ok
from skylb.core import PeerStatus


def test_status_round_trip():
    """A status encoded by one balancer decodes to the same fields on its peer."""
    status = PeerStatus(region="eu", available_replicas=2, replicas=4, queue_len=1,
                        models={"openai": {"m": 2}, "ollama": {}}, wait_ms=12.5, queue_age_ms=2500.0,
                        dispatch_rate=3.25)
    assert decode_status(encode_status(status)) == status


def test_status_carries_the_engines_model_fields_and_keeps_only_scalars():
    """``model_cards`` (what a peer's engines say of each model) round-trips; from a newer peer, a field that is a
    list or map, or a non-finite number, is dropped rather than the whole status rejected; without it, None."""
    cards = {"m": {"owned_by": "vllm", "created": 1700000000, "max_model_len": 4096, "root": "org/m", "parent": None}}
    status = PeerStatus(region="eu", available_replicas=1, replicas=1, queue_len=0, model_cards=cards)
    assert decode_status(encode_status(status)) == status
    raw = {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0}
    newer = raw | {"model_cards": {"m": {"owned_by": "vllm", "permission": [{"id": "p"}], "meta": {"a": 1},
                                         "ratio": float("nan")}}}
    assert decode_status(msgpack.packb(newer)).model_cards == {"m": {"owned_by": "vllm"}}
    assert decode_status(msgpack.packb(raw)).model_cards is None


def test_router_status_tells_peers_what_its_engines_say_of_each_model():
    """``Router.status`` carries, per model its live replicas serve, their merged scalar fields (the smallest
    ``max_model_len``, the first ``owned_by``), and nothing for a model whose replicas gave no card."""
    from skylb.config import BalancerConfig
    from skylb.core.builder import build_router

    router = build_router("us", BalancerConfig())
    router.set_replicas([("a", "http://a", "vllm"), ("b", "http://b", "vllm")])
    for rid, length in (("a", 8192), ("b", 4096)):
        router.set_replica_models(rid, ["m", "bare"])
        router.replicas[rid].model_cards = {"m": {"id": "m", "object": "model", "owned_by": "vllm",
                                                  "created": 5, "max_model_len": length, "permission": [{}]},
                                            "bare": {"id": "bare"}}
    assert router.status(now=0.0).model_cards == {"m": {"owned_by": "vllm", "created": 5, "max_model_len": 4096}}


def test_router_status_tells_peers_its_mean_load_per_usable_replica():
    """``load_per_replica``: the mean requests in the engines of the healthy, not draining replicas (running +
    waiting at the probe + sent since, or this balancer's own in flight when more); None with none usable; it
    round-trips, an older peer's status has none, and a negative or non-finite one is refused."""
    from skylb.config import BalancerConfig
    from skylb.core.builder import build_router

    router = build_router("us", BalancerConfig())
    assert router.status(now=0.0).load_per_replica is None
    router.set_replicas([("a", "http://a", "vllm"), ("b", "http://b", "vllm"), ("c", "http://c", "vllm")])
    router.replicas["a"].observe_probe(now=0.0, healthy=True, pending=2, running=6)
    router.replicas["b"].observe_probe(now=0.0, healthy=True, pending=0, running=1)
    router.replicas["b"].outstanding = 4  # more of ours in flight than its probe saw
    router.replicas["c"].observe_probe(now=0.0, healthy=False, error="down")
    status = router.status(now=0.0)
    assert status.load_per_replica == 6.0  # (8 + 4) / 2: c is not usable
    assert decode_status(encode_status(status)).load_per_replica == 6.0
    raw = {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0}
    assert decode_status(msgpack.packb(raw)).load_per_replica is None
    assert decode_status(msgpack.packb(raw | {"load_per_replica": 3})).load_per_replica == 3
    for bad in (-1.0, float("inf")):
        with pytest.raises(ProtocolError, match="load_per_replica"):
            decode_status(msgpack.packb(raw | {"load_per_replica": bad}))


def test_status_of_an_older_peer_has_no_queue_age():
    """A peer that predates the queue age and dispatch rate decodes with both None (it is never forwarded into a
    queue); a negative age is rejected."""
    raw = {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0}
    got = decode_status(msgpack.packb(raw))
    assert (got.queue_age_ms, got.dispatch_rate) == (None, None)
    with pytest.raises(ProtocolError, match="queue_age_ms"):
        decode_status(msgpack.packb(raw | {"queue_age_ms": -1.0}))


@pytest.mark.parametrize("header, expected_ms", [
    (None, 0.0), ("1500", 1500.0), ("12.5", 12.5), ("-3", 0.0), ("nan", 0.0), ("inf", 0.0), ("soon", 0.0)])
def test_forwarded_requests_queue_wait_header(header, expected_ms):
    """``X-SkyLB-Queue-Ms`` on a forwarded request: a finite non-negative number, anything else counts as 0."""
    assert queued_ms(header) == expected_ms


def test_status_without_models_decodes_to_unknown_models():
    """A peer that does not report models (an older balancer) decodes with models None: not "serves none"."""
    raw = {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0}
    assert decode_status(msgpack.packb(raw)).models is None


@pytest.mark.parametrize("bad", [
    {"v": 2, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0},
    {"v": 1, "available_replicas": 1, "replicas": 1, "queue_len": 0},
    {"v": 1, "region": "eu", "available_replicas": -1, "replicas": 1, "queue_len": 0},
    {"v": 1, "region": "eu", "available_replicas": True, "replicas": 1, "queue_len": 0},
    {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": "0"},
    {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0, "models": ["m"]},
    {"v": 1, "region": "eu", "available_replicas": 1, "replicas": 1, "queue_len": 0, "models": {"openai": {"m": -1}}},
    [1, 2, 3],
])
def test_invalid_status_is_a_protocol_error(bad):
    """Another version, a missing or mistyped field, or a non-map is rejected with ProtocolError."""
    with pytest.raises(ProtocolError):
        decode_status(msgpack.packb(bad))


def test_random_bytes_never_crash_the_decoder():
    """Fuzz: arbitrary bytes give a status or ProtocolError, never another exception."""
    rng = random.Random(7)
    good = encode_status(PeerStatus(region="us", available_replicas=1, replicas=2, queue_len=0))
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        if rng.random() < 0.5:  # mutate a valid status
            pos = rng.randrange(len(good))
            data = good[:pos] + bytes([rng.randrange(256)]) + good[pos + 1:]
        try:
            decode_status(data)
        except ProtocolError:
            pass
    with pytest.raises(ProtocolError):
        decode_status(b"\x00" * (2 << 20))


def test_peer_token_check():
    """Without a configured token anything passes; with one, only the same token does."""
    assert token_ok(None, None) and token_ok(None, "x")
    assert token_ok("s3cret", "s3cret") and not token_ok("s3cret", "other") and not token_ok("s3cret", None)
