"""The replay client against a small in-test OpenAI SSE server, and the report built from records.

The server here is only the unit test of the client (what it records from each kind of answer); the end-to-end
test against real balancers lives elsewhere. Its behaviour is chosen by the request's session id.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from aiohttp import web

from bench.replay import run as replay_mod
from bench.replay.run import ReplayError, parse_balancers, replay
from bench.replay.report import (RequestRecord, build_report, format_table, markdown_table, parse_route, percentile,
                          write_json)
from bench.replay.workload import Request

pytestmark = pytest.mark.timeout(30)

FIRST_TOKEN_DELAY_S = 0.05


def _chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _text(text: str) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


class FakeBalancer:
    """An OpenAI-compatible SSE server; the ``user`` field picks the behaviour (ok, peer, error, 503, slow, bare)."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        # handler_cancellation: a client that timed out must not leave the slow handler running at cleanup.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.region}"}, {"id": "other"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        kind = body["user"].split("-")[0]
        if kind == "503":
            return web.json_response({"error": {"message": "no replica available", "code": 503}}, status=503)
        headers = {"Content-Type": "text/event-stream"}
        if kind != "bare":
            route = "peer:eu" if kind == "peer" else "local"
            served = "eu" if kind == "peer" else self.region
            headers |= {"X-SkyLB-Route": route, "X-SkyLB-Served-By": f"{served}/r1",
                        "X-SkyLB-Rule": "prefer_peer" if kind == "peer" else "estimated_ttft"}
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\n\n")
        await asyncio.sleep(FIRST_TOKEN_DELAY_S if kind != "slow" else 10.0)
        n = body["max_tokens"]
        await resp.write(_chunk(_text("")))  # role-like empty chunk: not the first token
        for i in range(n):
            await resp.write(_chunk(_text(f" w{i}")))
            if kind == "error" and i == 1:
                await resp.write(_chunk({"error": {"message": "engine died", "code": 500}}))
                return resp
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                 "total_tokens": n + len(body["prompt"].split()), "prompt_tokens_details": {"cached_tokens": 3}}
        await resp.write(_chunk({"id": "cmpl-1", "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def fake():
    """A running FakeBalancer for region us, stopped at teardown."""
    server = FakeBalancer("us")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def req(rid: str, session: str, *, arrival_s: float = 0.0, region: str = "us", out: int = 4, **kw) -> Request:
    """A small stored-text request."""
    return Request(id=rid, arrival_s=arrival_s, region=region, session_id=session, prompt_tokens=6,
                   output_tokens=out, text="a b c d e f", **kw)  # fmt: skip


async def test_completed_request_records_ttft_e2e_usage_and_headers(fake):
    """A streamed answer gives TTFT <= E2E, usage (prompt, cached, completion) and the routing headers."""
    result = await replay([req("r1", "ok-1"), req("r2", "peer-1")], {"us": fake.url}, request_timeout_s=5)
    ok, peer = result.records
    assert ok.ok and ok.status == 200 and ok.error is None
    assert FIRST_TOKEN_DELAY_S * 1000 * 0.8 <= ok.ttft_ms <= ok.e2e_ms
    assert (ok.prompt_tokens, ok.cached_tokens, ok.completion_tokens) == (6, 3, 4)
    assert (ok.route, ok.served_by, ok.rule) == ("local", "us/r1", "estimated_ttft")
    assert (peer.route, peer.served_by, peer.rule) == ("peer:eu", "eu/r1", "prefer_peer")
    assert result.wall_s >= FIRST_TOKEN_DELAY_S


async def test_request_body_and_session_header(fake):
    """The body streams with usage, ignore_eos and the session id; the model is the first of /v1/models."""
    await replay([req("r1", "ok-7", out=3)], {"us": fake.url}, request_timeout_s=5)
    body, headers = fake.bodies[0], fake.headers[0]
    assert body == {"model": "model-us", "prompt": "a b c d e f", "max_tokens": 3, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "user": "ok-7"}  # fmt: skip
    assert headers["X-Session-ID"] == "ok-7"


async def test_explicit_model_skips_discovery(fake):
    """--model is sent as is."""
    await replay([req("r1", "ok-1")], {"us": fake.url}, model="mine", request_timeout_s=5)
    assert fake.bodies[0]["model"] == "mine"


async def test_missing_headers_are_recorded_as_none(fake):
    """A response without X-SkyLB headers still completes, with route and served_by None."""
    (rec,) = (await replay([req("r1", "bare-1")], {"us": fake.url}, request_timeout_s=5)).records
    assert rec.ok and rec.route is None and rec.served_by is None and rec.rule is None


async def test_mid_stream_error_chunk_fails_the_request(fake):
    """A `data: {"error": ...}` chunk after some text counts as failed, with the message and the TTFT kept."""
    (rec,) = (await replay([req("r1", "error-1")], {"us": fake.url}, request_timeout_s=5)).records
    assert not rec.ok and rec.status == 200
    assert rec.error == "engine died"
    assert rec.ttft_ms is not None


async def test_503_fails_the_request(fake):
    """A non-2xx answer counts as failed with its status and the OpenAI-shaped error message."""
    (rec,) = (await replay([req("r1", "503-1")], {"us": fake.url}, request_timeout_s=5)).records
    assert not rec.ok and rec.status == 503
    assert rec.error == "HTTP 503: no replica available"


async def test_timeout_fails_the_request(fake):
    """A request slower than the per-request timeout counts as failed, ending near the timeout."""
    (rec,) = (await replay([req("r1", "slow-1")], {"us": fake.url}, request_timeout_s=0.3)).records
    assert not rec.ok and rec.error == "timeout after 0.3 s"
    assert 250 <= rec.e2e_ms < 2000


async def test_connection_refused_fails_the_request(fake):
    """A balancer that does not answer fails the request instead of raising."""
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    (rec,) = (await replay([req("r1", "ok-1")], {"us": dead}, model="m", request_timeout_s=2)).records
    assert not rec.ok and rec.status is None and rec.error


async def test_every_request_ends_in_one_record(fake):
    """A mixed run gives one record per request, in workload order, and completed + failed == sent."""
    kinds = ["ok", "peer", "error", "503", "slow", "bare"] * 2
    reqs = [req(f"r{i}", f"{k}-{i}", arrival_s=0.01 * i) for i, k in enumerate(kinds)]
    result = await replay(reqs, {"us": fake.url}, request_timeout_s=0.5)
    assert [r.id for r in result.records] == [r.id for r in reqs]
    total = build_report(result.records, result.wall_s)["total"]
    assert total["sent"] == len(reqs)
    assert total["completed"] + total["failed"] == total["sent"]
    assert (total["completed"], total["local"], total["forwarded"], total["route_unknown"]) == (6, 2, {"eu": 2}, 2)


async def test_open_loop_sends_at_arrival_times(fake):
    """A request is not sent before its arrival time."""
    result = await replay([req("a", "ok-a"), req("b", "ok-b", arrival_s=0.3)], {"us": fake.url}, request_timeout_s=5)
    a, b = result.records
    assert a.sent_s < 0.1 and 0.29 <= b.sent_s < 0.6


async def test_closed_loop_turn_waits_for_the_previous_turn(fake):
    """A turn with `after` is sent think_s after the previous turn completed, not at its arrival time."""
    reqs = [req("t0", "ok-s"), req("t1", "ok-s", turn=1, after="t0", think_s=0.1)]
    t0, t1 = (await replay(reqs, {"us": fake.url}, request_timeout_s=5)).records
    assert t1.sent_s >= t0.sent_s + t0.e2e_ms / 1000 + 0.1 - 0.01


async def test_deadline_fails_in_flight_and_unsent_requests(fake):
    """At the replay deadline, in-flight and not-yet-sent requests get failed records; none is lost."""
    reqs = [req("fast", "ok-1"), req("slow", "slow-1"), req("late", "ok-2", arrival_s=20.0)]
    result = await replay(reqs, {"us": fake.url}, request_timeout_s=20, deadline_s=0.5)
    fast, slow, late = result.records
    assert fast.ok
    assert "deadline" in slow.error and "in flight" in slow.error and slow.sent_s is not None
    assert "deadline" in late.error and "not sent" in late.error and late.sent_s is None
    assert result.wall_s < 2.0


async def test_region_without_balancer_is_an_error(fake):
    """Requests for a region with no balancer stop the replay before anything is sent."""
    with pytest.raises(ReplayError, match="asia"):
        await replay([req("r1", "ok-1", region="asia")], {"us": fake.url})
    assert fake.bodies == []


def test_parse_balancers():
    """REGION=URL specs become a dict; malformed or repeated specs are errors."""
    assert parse_balancers(["us=http://h:1/", "eu=http://h:2"]) == {"us": "http://h:1", "eu": "http://h:2"}
    for bad in (["us"], ["=http://h"], ["us=h:1"], ["us=http://a", "us=http://b"], []):
        with pytest.raises(ValueError):
            parse_balancers(bad)


async def test_cli_replays_a_trace_and_writes_json(fake, tmp_path, capsys):
    """`skylb replay` on a tiny trace prints the table and writes records + report as JSON."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 600, "output_length": 8,
                                         "hash_ids": [0, 1]}) + "\n" for i in range(3)))  # fmt: skip
    parser = argparse.ArgumentParser()
    replay_mod.add_arguments(parser)
    out = tmp_path / "out" / "r.json"
    args = parser.parse_args(["--balancer", f"us={fake.url}", "--trace", str(trace), "--token-scale", "0.01",
                              "--no-progress", "--out", str(out), "--timeout-s", "5"])  # fmt: skip
    # main() runs its own event loop; run it in a thread so this test's loop keeps serving the fake balancer.
    rc = await asyncio.to_thread(replay_mod.main, args)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["report"]["total"]["completed"] == 3 and len(doc["records"]) == 3
    assert doc["workload"]["summary"].startswith("trace: 3 requests")
    printed = capsys.readouterr().out
    assert "total" in printed and str(out) in printed
    assert all(b["max_tokens"] == 1 and len(b["prompt"].split()) == 6 for b in fake.bodies)
    # three equal prompts: the second and third are all cached but their last token
    assert doc["report"]["ideal_prefix_hit_rate"] == pytest.approx(2 * 5 / 18)
    assert "of an ideal 55.6%" in printed


def test_cli_rejects_bad_options(capsys):
    """Bad workload options exit with status 2 and a message, before anything is sent."""
    parser = argparse.ArgumentParser()
    replay_mod.add_arguments(parser)
    args = parser.parse_args(["--balancer", "us=http://127.0.0.1:9", "--token-scale", "-1", "--synthetic"])
    assert replay_mod.main(args) == 2
    assert "token_scale" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- report


def rec(rid: str, region: str, *, ttft: float | None = 100, e2e: float | None = 1000, route: str | None = "local",
        prompt: int = 100, cached: int | None = 50, out: int | None = 10, error: str | None = None,
        rule: str | None = None) -> RequestRecord:
    """A handcrafted record."""
    return RequestRecord(id=rid, region=region, ttft_ms=ttft, e2e_ms=e2e, route=route, prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=out, error=error, status=200, rule=rule)  # fmt: skip


def test_percentile_interpolates_linearly():
    """Percentiles interpolate between closest ranks (numpy 'linear'); empty input gives None."""
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([7], 90) == 7
    assert percentile([], 50) is None


def test_parse_route():
    """`local` -> "", `peer:<r>` -> r, anything else -> None."""
    assert [parse_route(x) for x in ("local", "peer:eu", "peer:", None, "weird")] == ["", "eu", None, None, None]


def test_report_on_handcrafted_records():
    """Per-region and total counts, percentiles, local vs forwarded TTFT, throughput and hit rate are exact."""
    records = [
        rec("a", "us", ttft=100, e2e=1000, prompt=100, cached=50, rule="estimated_ttft"),
        rec("b", "us", ttft=200, e2e=2000, prompt=100, cached=0, rule="estimated_ttft"),
        rec("c", "us", ttft=900, e2e=3000, route="peer:eu", prompt=200, cached=None, rule="prefer_peer"),
        rec("d", "us", error="HTTP 503: full", ttft=None, cached=100, rule="estimated_ttft"),
        rec("e", "eu", ttft=50, e2e=500, route=None, prompt=100, cached=100, out=20),
    ]
    report = build_report(records, wall_s=10.0)
    us, eu, total = report["regions"]["us"], report["regions"]["eu"], report["total"]
    assert (us["sent"], us["completed"], us["failed"]) == (4, 3, 1)
    assert (us["local"], us["forwarded"], us["forwarded_total"], us["route_unknown"]) == (2, {"eu": 1}, 1, 0)
    assert us["ttft_p50_ms"] == 200 and us["ttft_p90_ms"] == pytest.approx(760)
    assert us["ttft_p50_local_ms"] == 150 and us["ttft_p50_forwarded_ms"] == 900
    assert us["e2e_p50_ms"] == 2000 and us["e2e_p90_ms"] == pytest.approx(2800)
    assert us["prefix_hit_rate"] == pytest.approx(50 / 400)  # failed request's tokens not counted
    assert us["throughput_rps"] == pytest.approx(0.3) and us["output_tokens_per_s"] == pytest.approx(3.0)
    assert eu["route_unknown"] == 1 and eu["ttft_p50_local_ms"] is None and eu["prefix_hit_rate"] == 1.0
    assert (total["sent"], total["completed"], total["failed"]) == (5, 4, 1)
    assert total["prefix_hit_rate"] == pytest.approx(150 / 500)
    assert report["errors"] == {"HTTP 503: full": 1}
    assert us["rules"] == {"estimated_ttft": {"completed": 2, "ttft_p90_ms": pytest.approx(190)},
                           "prefer_peer": {"completed": 1, "ttft_p90_ms": 900}}  # completed requests only
    assert eu["rules"] == {} and "by rule" not in format_table(build_report(records[4:], wall_s=1.0))
    assert "estimated_ttft 2 / 190, prefer_peer 1 / 900" in format_table(report)


def test_report_table_and_json(tmp_path):
    """The table has a row per region and a total row; write_json round-trips the report."""
    report = build_report([rec("a", "us"), rec("b", "asia", route="peer:us")], wall_s=2.0)
    table = format_table(report)
    lines = table.splitlines()
    assert any(line.startswith("us") for line in lines) and any(line.startswith("asia") for line in lines)
    assert any(line.startswith("total") for line in lines) and "us:1" in table and "50.0%" in table
    path = write_json(report, tmp_path / "sub" / "report.json")
    assert json.loads(path.read_text()) == report


def test_report_table_prints_the_ideal_hit_rate_when_known():
    """A replayed trace window's ideal prefix hit rate is printed beside the achieved one; without it, no line."""
    report = build_report([rec("a", "us")], wall_s=1.0)
    assert "ideal" not in format_table(report)
    report["ideal_prefix_hit_rate"] = 0.75
    assert "prefix hit 50.0% of an ideal 75.0%" in format_table(report)


def test_empty_report_has_no_numbers():
    """No records gives zero counts and None for every rate and percentile, and still formats."""
    report = build_report([], wall_s=0.0)
    assert report["total"]["sent"] == 0 and report["total"]["ttft_p50_ms"] is None
    assert report["total"]["throughput_rps"] is None
    assert "total" in format_table(report)


def test_markdown_table_keeps_cells_as_given_and_pads_short_rows():
    """markdown_table prints formatted cells unchanged ("1.50", "1,000"), pads a short row, and is valid GFM."""
    lines = markdown_table(["system", "req/s", "tokens", "note"], [["a", "1.50", "1,000", "x"], ["b", "skipped"]])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines.splitlines()]
    assert rows[0] == ["system", "req/s", "tokens", "note"]
    assert all(set(c) <= {"-", ":"} for c in rows[1]) and len(rows[1]) == 4
    assert rows[2:] == [["a", "1.50", "1,000", "x"], ["b", "skipped", "", ""]]
