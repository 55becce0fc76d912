"""OpenAI's client-facing conventions end to end with real processes (a controller, two regions' balancers,
emulated vLLM replicas, redis-server for the quota buckets) and the official openai client: the ``x-ratelimit-*`` headers count down and reset as
OpenAI documents them (skylb/quota/headers.py); ``/v1/responses`` streamed, a follow-up with
``previous_response_id`` on the replica that holds the previous response (across regions when a peer produced
it), ``GET /v1/responses/{id}``, and OpenAI's 400 ``previous_response_not_found`` once that replica is gone."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import openai
import pytest

from tests.cluster import MODEL, Cluster, post_json
from tests.procs import ProcGroup, free_ports, wait_http
from tests.redis import RedisServer

# One deployment for the module's tests, on one worker, in order (the last one removes a replica).
pytestmark = pytest.mark.xdist_group("openai_conventions")

PEER = "peer-token-for-openai-conventions-0123"
ADMIN = "admin-token-for-openai-conventions-012"
KEY_A, KEY_B = "sk-alpha-conventions-0123456789", "sk-beta-conventions-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
EU_MODEL = "eu-only-model"
EMULATOR = ("--engine", "vllm", "--time-scale", "0.02", "--no-request-log")
# alpha: 6 requests and 600 tokens a minute on every model; every tenant's requests for MODEL also draw on the
# model's own bucket (600 requests, 60,000 tokens a minute), which is the tighter one only for beta.
SETTINGS = {"tenants": {"alpha": [KEY_A], "beta": [KEY_B]},
            "quotas": {"tenants": {"alpha": {"limits": {"*": {"requests_per_minute": 6, "tokens_per_minute": 600}}}},
                       "models": {MODEL: {"requests_per_minute": 600, "tokens_per_minute": 60000}}},
            "quota": {"wait_s": 0.3}}


def _start(c: Cluster, procs: ProcGroup) -> None:
    """The module's deployment, its five processes started at once and then waited for (not one after another)."""
    config = str(c.config(["us", "eu"]))
    ports = free_ports(6)
    c.controller_url = f"http://127.0.0.1:{ports[0]}"
    procs.skylb("controller", "--config", config, "--port", str(ports[0]), name="controller", env=c.env)
    replicas = {"us-a": ports[1], "us-b": ports[2], "eu-a": ports[3]}
    procs.skylb("emulator", "--model", MODEL, "--port", str(ports[1]), "--port", str(ports[2]), *EMULATOR,
                name="emulator-us")
    procs.skylb("emulator", "--model", EU_MODEL, "--port", str(ports[3]), *EMULATOR, name="emulator-eu")
    for region, port in (("us", ports[4]), ("eu", ports[5])):
        c.balancers[region] = f"http://127.0.0.1:{port}"
        procs.skylb("balancer", "--config", config, "--region", region, "--port", str(port), "--host", "127.0.0.1",
                    "--controller", c.controller_url, name=f"balancer-{region}", env=c.env)
    for url in (c.controller_url, *(f"http://127.0.0.1:{p}" for p in replicas.values())):
        wait_http(f"{url}/health" if url != c.controller_url else f"{url}/healthz", timeout_s=30)
    for replica_id, port in replicas.items():
        body = {"region": replica_id[:2], "url": f"http://127.0.0.1:{port}", "engine": "vllm", "id": replica_id}
        status, answer, _ = post_json(f"{c.controller_url}/v1/replicas", body, headers=ADMIN_HEADERS)
        assert status in (200, 201), answer
    for url in c.balancers.values():
        wait_http(f"{url}/healthz", timeout_s=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Controller; us with two vLLM replicas (us-a, us-b) serving MODEL; eu with one serving only EU_MODEL, so us
    forwards EU_MODEL's requests to eu; quotas counted in a real redis-server (skips without one, fails under CI),
    so a limit's headers show it whole rather than the share the controller moves between regions."""
    tmp = tmp_path_factory.mktemp("conventions")
    procs = ProcGroup(tmp / "logs")
    try:
        redis = RedisServer(procs, tmp)  # limits counted whole in Redis, not split into regions' moving shares
        redis.start()
        c = Cluster(procs, tmp, balancer={**SETTINGS, "quota": {**SETTINGS["quota"], "redis_url": redis.url}},
                    peer_token=PEER, admin_token=ADMIN, controller={"health": {"enabled": False}})
        _start(c, procs)
        c.wait_replicas_healthy("us", 2)
        c.wait_replicas_healthy("eu", 1)
        c.wait_peers_probed("us", 1)
        yield c
        c.assert_counters_return_to_zero()
    finally:
        procs.stop_all()


def client(cluster: Cluster, key: str, region: str = "us") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.balancers[region]}/v1", api_key=key, max_retries=0)


def seconds(duration: str) -> float:
    """An OpenAI reset duration ("6m0s", "1.5s", "17ms") in seconds; fails on any other shape."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?|(\d+)ms", duration)
    assert match and duration, f"not an OpenAI duration: {duration!r}"
    hours, minutes, secs, ms = match.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0)


def limits_of(headers) -> dict[str, str]:
    return {name: headers.get(f"x-ratelimit-{name}") for name in (
        "limit-requests", "remaining-requests", "reset-requests", "limit-tokens", "remaining-tokens", "reset-tokens")}


def chat(c: openai.OpenAI, max_tokens: int):
    return c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens)


def test_rate_limit_headers_count_down_to_a_429_from_the_tightest_bucket(cluster):
    """alpha (6 requests, 600 tokens a minute; the model's bucket is far looser) sees its own bucket: requests
    remaining 5, 4, ... 0 with a reset growing by 10 s a request, tokens going down by each request's charge; the
    seventh gets 429 with remaining-requests 0 and a reset of about a minute."""
    alpha = client(cluster, KEY_A)
    seen = [limits_of(chat(alpha, 50).headers) for _ in range(6)]
    assert [h["limit-requests"] for h in seen] == ["6"] * 6 and {h["limit-tokens"] for h in seen} == {"600"}
    assert [h["remaining-requests"] for h in seen] == ["5", "4", "3", "2", "1", "0"]
    for k, h in enumerate(seen, start=1):  # (6 - level) * 60 / 6 s: 10 s a request used, less what refilled
        assert k * 10 - 1.5 <= seconds(h["reset-requests"]) <= k * 10, h
    tokens = [int(h["remaining-tokens"]) for h in seen]
    charge = 600 - tokens[0]  # the prompt's estimate plus max_tokens 50
    assert 50 < charge < 60
    for before, after in zip(tokens, tokens[1:]):  # each request's charge, less a few tokens refilled (10/s)
        assert charge - 30 <= before - after <= charge, tokens
    assert seconds(seen[-1]["reset-tokens"]) == pytest.approx((600 - tokens[-1]) / 10, abs=1.5)
    with pytest.raises(openai.RateLimitError) as info:
        chat(alpha, 50)
    refused = limits_of(info.value.response.headers)
    assert refused["limit-requests"] == "6" and refused["remaining-requests"] == "0"
    assert 50 <= seconds(refused["reset-requests"]) <= 60, refused


def test_rate_limit_headers_reset_after_the_time_they_give(cluster):
    """beta draws only on the model's bucket (600 requests, 60,000 tokens a minute): after a few requests the
    headers say when it is full again; a request sent after that long finds it full (remaining = limit - 1)."""
    beta = client(cluster, KEY_B)
    warm_up = limits_of(chat(beta, 4).headers)  # the bucket may still refill what alpha's requests used
    assert warm_up["limit-requests"] == "600" and warm_up["limit-tokens"] == "60000"
    time.sleep(max(seconds(warm_up["reset-requests"]), seconds(warm_up["reset-tokens"])))
    first = limits_of(chat(beta, 4).headers)  # from a full bucket
    assert first["remaining-requests"] == "599"
    with ThreadPoolExecutor(3) as pool:  # at once, so little refills between them (10 requests a second)
        answers = list(pool.map(lambda _: limits_of(chat(beta, 4).headers), range(3)))
    last = min(answers, key=lambda h: int(h["remaining-requests"]))
    remaining = int(last["remaining-requests"])
    # The reset is the refill of what is missing: (600 - level) / 10 s, with remaining = floor(level).
    assert (599 - remaining) / 10 <= seconds(last["reset-requests"]) <= (600 - remaining) / 10 + 0.001, last
    wait_s = max(seconds(last["reset-requests"]), seconds(last["reset-tokens"]))
    assert wait_s <= 1.0, last  # 10 requests and 1,000 tokens refill per second
    time.sleep(wait_s + 0.25)  # a full bucket stays full: the margin only absorbs a loaded machine's late timers
    again = limits_of(chat(beta, 4).headers)
    assert again["remaining-requests"] == "599" and again["remaining-tokens"] == first["remaining-tokens"], again


def _stream(c: openai.OpenAI, **request) -> tuple[str, object, list[str]]:
    """A streamed /v1/responses request: (X-SkyLB-Served-By, the completed response, the event types)."""
    stream = c.responses.create(stream=True, **request)
    types, final = [], None
    for event in stream:
        types.append(event.type)
        if event.type == "response.completed":
            final = event.response
    return stream.response.headers["x-skylb-served-by"], final, types


def test_responses_streamed_and_follow_ups_land_on_the_replica_holding_the_state(cluster):
    """Streamed /v1/responses through the balancer with vLLM's event sequence; two conversations of three turns:
    every follow-up (previous_response_id) is served by the replica that produced the previous response (the
    replica's own store answers it: another replica would 404), and its input holds the history; the stored
    response is retrieved through the balancer."""
    beta = client(cluster, KEY_B)
    served_by = set()
    for n in range(2):
        where, response, types = _stream(beta, model=MODEL, input=f"conversation {n} starts here",
                                         max_output_tokens=8)
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert "response.output_text.delta" in types and response.status in ("completed", "incomplete")
        served_by.add(where)
        for turn in range(2):
            follow_where, follow, _ = _stream(beta, model=MODEL, input=f"turn {turn} of {n}",
                                              previous_response_id=response.id, max_output_tokens=8)
            assert follow_where == where and follow.previous_response_id == response.id
            assert follow.usage.input_tokens > response.usage.input_tokens  # the history came along
            response = follow
        assert beta.responses.retrieve(response.id).output_text == response.output_text
    assert served_by <= {"us/us-a", "us/us-b"}
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve("resp_unknown0123")


def test_a_follow_up_of_a_response_a_peer_produced_crosses_to_that_region(cluster):
    """A response for a model only eu serves is forwarded by us to eu; its follow-up sent to us goes to eu again
    (one hop) and reaches eu's replica, which holds it; not streamed this time."""
    beta = client(cluster, KEY_B)
    raw = beta.responses.with_raw_response.create(model=EU_MODEL, input="hello from us", max_output_tokens=6)
    first = raw.parse()
    assert raw.headers["x-skylb-route"] == "peer:eu" and raw.headers["x-skylb-served-by"] == "eu/eu-a"
    raw = beta.responses.with_raw_response.create(model=EU_MODEL, input="and again", max_output_tokens=6,
                                                 previous_response_id=first.id)
    assert raw.headers["x-skylb-served-by"] == "eu/eu-a" and raw.parse().previous_response_id == first.id


def test_a_follow_up_whose_replica_is_gone_gets_openais_previous_response_not_found(cluster):
    """Once the replica that produced a response leaves membership, a follow-up gets OpenAI's 400
    previous_response_not_found (param previous_response_id) from the balancer, saying the replica is gone; an id
    the balancer never saw, or another tenant's, gets the same error. (Run last: it removes a replica of the
    module's cluster.)"""
    beta = client(cluster, KEY_B)
    where, response, _ = _stream(beta, model=MODEL, input="a short-lived conversation", max_output_tokens=4)
    replica = where.split("/", 1)[1]
    alpha = client(cluster, KEY_A)  # another tenant: beta's stored responses are not its to continue or read
    with pytest.raises(openai.BadRequestError) as info:
        alpha.responses.create(model=MODEL, input="may I?", previous_response_id=response.id)
    assert info.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(response.id)
    request = urllib.request.Request(f"{cluster.controller_url}/v1/replicas/{replica}", method="DELETE",
                                     headers=ADMIN_HEADERS)
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
    cluster.wait_until(lambda: replica not in {r["id"] for r in cluster.status("us")["replicas"]}, timeout_s=10,
                       what=f"{replica} gone from us")
    for previous, words in ((response.id, f"replica {replica} left"), ("resp_never_seen_here", "no record")):
        with pytest.raises(openai.BadRequestError) as info:
            beta.responses.create(model=MODEL, input="still there?", previous_response_id=previous, stream=True)
        error = info.value.body
        assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
        assert previous in error["message"] and words in error["message"], error
