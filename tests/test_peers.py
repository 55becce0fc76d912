"""The cross-region comparison (bench/live/peers.py) and what it adds to the harness: trace sessions for closed-loop
clients (bench/replay/workload.py ``trace_sessions``), the closed-loop driver (bench/replay/run.py ``replay_sessions``), which
replica served a response, the figures, the acceptance lines and the report. Seconds in all; one live smoke run of
a balancer in us through the latency links (HAProxy: skipped without it, a failure under CI=true).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from bench import bench_cli
from bench.live import peers
from bench.live.peers import PeersSetup, SYSTEMS, acceptance, client_split, figures_of, format_markdown, launch_options
from bench.replay.run import replay_sessions
from bench.replay.report import RequestRecord
from bench.replay.workload import THINK_S, Request, trace_session_count, trace_sessions
from tests.system import require_binary


def _write_trace(path: Path) -> Path:
    """Six sessions by hash ids: lines 1, 3, 7 (each extends the last's full blocks), lines 2 and 5, then single
    requests on lines 4, 6, 8 and 9."""
    rows = [([0, 1, 2], 1000), ([0, 3], 1024), ([0, 1, 2, 4], 1700), ([0, 5], 800), ([0, 3, 6], 1400),
            ([0, 7], 700), ([0, 1, 2, 4, 8], 2400), ([0, 9], 600), ([0, 10], 600)]
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": n, "output_length": 40,
                                        "hash_ids": ids}) + "\n" for i, (ids, n) in enumerate(rows)))
    return path


def test_trace_sessions_are_whole_capped_chained_and_seeded(tmp_path):
    """Sessions come in the order of their first request, whole up to max_turns, each turn after the previous one,
    one region per session drawn by the seed, think times in THINK_S; the pool stops at the first session that
    reaches the request count."""
    trace = _write_trace(tmp_path / "t.jsonl")
    kw = dict(weights={"us": 0.6, "eu": 0.2, "asia": 0.2}, token_scale=0.1)
    sessions = trace_sessions(trace, ["us", "eu", "asia"], seed=3, requests=5, max_turns=2, **kw)
    assert [[r.id for r in s] for s in sessions] == [["trace-000001", "trace-000003"], ["trace-000002",
                                                                                        "trace-000005"],
                                                     ["trace-000004"]]
    for s in sessions:
        assert len({r.region for r in s}) == 1 and len({r.session_id for r in s}) == 1
        assert [r.turn for r in s] == list(range(len(s))) and s[0].after is None
        assert all(b.after == a.id for a, b in zip(s, s[1:]))
        assert all(THINK_S[0] <= r.think_s <= THINK_S[1] and r.arrival_s == 0 for r in s)
    assert sessions[0][1].prompt_tokens == 170 and sessions[0][1].block_words == 51
    again = trace_sessions(trace, ["us", "eu", "asia"], seed=3, requests=5, max_turns=2, **kw)
    assert again == sessions
    later = trace_sessions(trace, ["us", "eu", "asia"], seed=3, requests=1, first_session=4, **kw)
    assert [[r.id for r in s] for s in later] == [["trace-000008"]]
    with pytest.raises(ValueError):
        trace_sessions(trace, ["us"], seed=0, requests=1, first_session=6, **kw)


def test_a_short_trace_is_read_again_from_its_start_and_every_seed_gets_a_pool(tmp_path):
    """A pool that reaches the trace's end goes on from its first session (each session once); bench.peers starts
    seed k at k x session_stride modulo the trace's sessions, so a trace shorter than the seeds' stretches still
    gives every run its pool (a 2,549-session trace failed at seed 2 after two whole rounds)."""
    trace = _write_trace(tmp_path / "t.jsonl")
    kw = dict(weights={"us": 0.6, "eu": 0.2, "asia": 0.2}, token_scale=0.1)
    count = trace_session_count(trace)
    whole = trace_sessions(trace, ["us", "eu", "asia"], seed=3, requests=1000, **kw)
    wrapped = trace_sessions(trace, ["us", "eu", "asia"], seed=3, requests=1000, first_session=count - 1, **kw)
    assert len(whole) == len(wrapped) == count
    assert wrapped == whole[-1:] + whole[:-1]
    setup = PeersSetup(trace=str(trace), session_stride=count, pool_requests=2)
    ids = lambda pool: [[r.id for r in s] for s in pool]
    assert ids(peers.workload(setup, 2)) == ids(peers.workload(setup, 0)) == ids(whole[:1])


class _Engine:
    """An OpenAI-style SSE server that answers after ``delay_s`` and notes, per request, its ``user`` (the session),
    when it began and ended, and the most requests it held at once."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self.active = self.peak = 0
        self.log: list[tuple[str, str, float, float]] = []  # (session, prompt, start, end)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.active += 1
        self.peak = max(self.peak, self.active)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.delay_s)
        rid = f"cmpl-{body['user']}-{len(self.log)}"
        await resp.write(f"data: {json.dumps({'id': rid, 'choices': [{'text': ' hi'}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.active -= 1
        self.log.append((body["user"], body["prompt"], start, loop.time()))
        return resp


def _session(name: str, region: str, turns: int, think_s: float = 0.01) -> list[Request]:
    return [Request(id=f"{name}-t{k}", arrival_s=0.0, region=region, session_id=name, prompt_tokens=1,
                    output_tokens=1, turn=k, think_s=think_s, text=f"{name}-t{k}") for k in range(turns)]


async def test_replay_sessions_keeps_one_request_per_client_and_turns_in_order():
    """Two clients in us run five sessions: never more than two requests at once, a session's turns one after the
    other, the sessions started in pool order, every request completed with the completion's id recorded."""
    engine = _Engine()
    await engine.start()
    try:
        sessions = [_session(f"s{i}", "us", 3 if i == 0 else 2) for i in range(5)]
        result = await replay_sessions(sessions, {"us": 2}, {"us": engine.url}, model="m", request_timeout_s=5)
    finally:
        await engine.stop()
    assert engine.peak == 2 and len(result.records) == 11 and all(r.ok for r in result.records)
    assert [r.id for r in result.records] == [r.id for s in sessions for r in s]
    assert all(r.response_id and r.response_id.startswith(f"cmpl-{r.session_id}-") for r in result.records)
    for s in sessions:
        spans = [next((b, e) for u, p, b, e in engine.log if p == r.text) for r in s]
        assert all(nxt[0] >= prev[1] for prev, nxt in zip(spans, spans[1:]))
    firsts = [next(b for u, p, b, e in engine.log if p == s[0].text) for s in sessions]
    assert firsts[1:] == sorted(firsts[1:]) and firsts[0] < firsts[2]  # s0 and s1 start together


async def test_replay_sessions_stops_sending_after_the_window():
    """With issue_s, nothing is sent after the window; the request in flight finishes; unsent ones are left out,
    not failed."""
    engine = _Engine(delay_s=0.2)
    await engine.start()
    try:
        sessions = [_session("a", "eu", 10, think_s=0.0)]
        result = await replay_sessions(sessions, {"eu": 1}, {"eu": engine.url}, model="m", request_timeout_s=5,
                                       issue_s=0.3)
    finally:
        await engine.stop()
    assert [r.id for r in result.records] == ["a-t0", "a-t1"] and all(r.ok for r in result.records)
    assert result.wall_s >= 0.4


def test_client_split_and_launch_options_follow_the_setup():
    """Clients split us 0.6 / eu 0.2 / asia 0.2 and sum to the total; cache_aware balances at half a batch of
    difference and HAProxy admits one batch per server."""
    assert client_split(72) == {"us": 43, "eu": 15, "asia": 14}
    assert client_split(3) == {"us": 1, "eu": 1, "asia": 1}
    setup = PeersSetup(max_num_seqs=8, request_timeout_s=60)
    assert launch_options(SYSTEMS["sglang-cache_aware"], setup)["balance_abs_threshold"] == 4
    assert launch_options(SYSTEMS["haproxy-per-region"], setup) == {"maxconn": 8, "timeout_queue_s": 60}
    assert launch_options(SYSTEMS["sglang-round_robin"], setup) == {}
    assert "peers" in bench_cli.LIVE_BENCHMARKS


def test_balancer_options_reach_the_skylb_config_and_a_misspelt_one_is_refused(capsys):
    """``--balancer-option KEY=VALUE`` (VALUE as YAML) sets a balancer field of SkyLB's deployment; an unknown field
    is a usage error before anything starts."""
    setup = PeersSetup(balancer_options=dict([peers._balancer_option("probe_interval_ms=500"),
                                              peers._balancer_option("pending_allowance=0")]))
    cfg = peers.skylb_config(setup, "skylb")
    assert (cfg.balancer.probe_interval_ms, cfg.balancer.pending_allowance) == (500.0, 0)
    assert peers.skylb_config(PeersSetup(), "skylb").balancer.probe_interval_ms == 100.0
    with pytest.raises(SystemExit) as exc:
        peers.main(["--balancer-option", "probe_intervl_ms=5", "--systems", "skylb", "--out-md", ""])
    assert exc.value.code == 2 and "probe_intervl_ms" in capsys.readouterr().err


def test_served_regions_reads_the_emulators_request_log(tmp_path):
    """A request_finished line names the replica by host:port; other lines and unknown ports are ignored."""
    urls = {"us": ["http://127.0.0.1:9001"], "eu": ["http://127.0.0.1:9002", "http://127.0.0.1:9003"]}
    lines = [{"event": "request_finished", "replica": "127.0.0.1:9003", "request_id": "a"},
             {"event": "request_finished", "replica": "127.0.0.1:9001", "request_id": "b"},
             {"event": "request_finished", "replica": "127.0.0.1:7777", "request_id": "c"},
             {"event": "emulator_started", "request_id": "d"}]
    (tmp_path / "emulator-eu.log").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"event": "requ')
    assert peers.served_regions(tmp_path, urls) == {"a": "eu/1", "b": "us/0"}


def _records(region_served: list[tuple[str, str]], ttft_ms: float) -> tuple[list[RequestRecord], dict[str, str]]:
    records, served = [], {}
    for i, (client, replica) in enumerate(region_served):
        records.append(RequestRecord(f"r{i}", client, sent_s=i * 0.6, ttft_ms=ttft_ms, e2e_ms=1000.0,
                                     prompt_tokens=100, cached_tokens=50, completion_tokens=10, status=200,
                                     response_id=f"id{i}"))
        served[f"id{i}"] = f"{replica}/0"
    return records, served


def test_figures_count_the_window_and_requests_served_across_regions():
    """Throughput counts requests ended within the window; cross-region share compares client and replica
    regions; CPU per request is the system's own."""
    records, served = _records([("us", "us"), ("us", "eu"), ("eu", "eu"), ("asia", "us")], 200.0)
    f = figures_of(records, 3.0, duration_s=2.0, served=served,
                   cpu={"system": 0.4, "replicas": 1.0, "proxy": 0.2, "clients": 0.4})
    assert f["completed_in_window"] == 2 and f["throughput_rps"] == 1.0
    assert f["cross_region_frac"] == 0.5 and f["served_frac"] == {"us": 0.5, "eu": 0.5, "asia": 0.0}
    assert f["cpu_ms_per_request"] == 100.0 and f["forwarded_frac"] is None and f["prefix_hit_rate"] == 0.5


def _result(p90: dict[str, list[float]], rps: dict[str, list[float]]) -> dict:
    """A result of len(p90[...]) runs whose rows have the given TTFT p90 and throughput (other figures real)."""
    names = list(p90)
    runs = []
    for k in range(len(p90[names[0]])):
        rows = []
        for name in names:
            records, served = _records([("us", "us"), ("eu", "us")], 100.0)
            f = figures_of(records, 2.0, duration_s=2.0, served=served,
                           cpu={"system": 0.1, "replicas": 0.1, "proxy": 0.0, "clients": 0.1})
            f.update(ttft_p90_ms=p90[name][k], throughput_rps=rps[name][k], pool_dry=[])
            rows.append({"system": name, "status": "ok", "figures": f, "run": k + 1, "seed": k,
                         "load": {"loadavg_start": "0", "loadavg_end": "0", "wall_s": 2.0, "others_cpu_s": 0.0,
                                  "others_cpu_frac": 0.0, "top_others": []}})
        runs.append(rows)
    return {"setup": vars(PeersSetup()), "clients": client_split(72), "systems": names, "runs": runs,
            "rows": [r for rows in runs for r in rows], "workloads": {0: "five requests"}, "rtt_ms": {"us-eu": 80},
            "versions": {"sglang-router": "0.3.2", "haproxy": "HAProxy 2.6", "python": "3.11"}, "wall_s": 10.0,
            "load": {"loadavg_start": "0", "loadavg_end": "0", "wall_s": 10.0, "others_cpu_s": 0.0,
                     "others_cpu_frac": 0.0, "top_others": []}}


def test_acceptance_lines_are_met_or_missed_by_the_rules():
    """Lower mean P90 and 4 of 5 paired wins meet line 1; one system with more throughput misses line 2; line 3
    compares with the best single balancer in us; line 4 is SkyLB's CPU per request (0.1 CPU-s over 2 requests
    here: 50 ms, missed)."""
    result = _result({"skylb": [100, 100, 100, 100, 260], "sglang-cache_aware": [300, 300, 300, 300, 250],
                      "haproxy-us": [900] * 5}, {"skylb": [10] * 5, "sglang-cache_aware": [11] * 5,
                                                 "haproxy-us": [9] * 5})
    lines = acceptance(result)
    assert [a["status"] for a in lines] == ["MET", "MISSED", "MET", "MISSED"]
    assert "sglang-cache_aware 4/5" in lines[0]["text"] and "0.46x" in lines[2]["text"]
    assert ": 50.0 ms (sglang-cache_aware 50.0" in lines[3]["text"]
    worse = _result({"skylb": [100, 300, 300, 100, 100], "haproxy-us": [250] * 5}, {"skylb": [10] * 5,
                                                                                     "haproxy-us": [9] * 5})
    assert [a["status"] for a in acceptance(worse)] == ["MISSED", "MET", "MISSED", "MISSED"]
    alone = _result({"skylb": [100]}, {"skylb": [10]})
    assert acceptance(alone)[0]["status"] == "NOT EVALUATED"


def test_report_has_acceptance_summary_runs_and_setup():
    """The Markdown report carries the acceptance lines, a summary row per system, a row per run and the setup."""
    result = _result({"skylb": [100, 120], "haproxy-per-region": [400, 500]},
                     {"skylb": [10, 11], "haproxy-per-region": [8, 9]})
    text = format_markdown(result, "## Notes\n\nhand-written")
    for part in ("## Acceptance", "**MET**", "## Over the runs", "## Each run", "## Setup", "## Conditions",
                 "--balance-abs-threshold 2", "maxconn 4", "hand-written"):
        assert part in text, part
    table = [line for line in text.splitlines() if line.startswith("| skylb ")]
    assert table and "110 [100, 120]" in table[0] and "10.50 [10.00, 11.00]" in table[0]
    assert sum(line.startswith(("| 1 ", "| 2 ")) for line in text.splitlines()) == 4


@pytest.mark.timeout(60)
def test_live_smoke_balancer_in_us_through_the_links(tmp_path):
    """haproxy-us on one replica per region, a few clients for two seconds: every request completes, every response
    is attributed to a replica, and the round trips land where they should: an eu or asia client pays its round
    trip to us, a us client served in asia pays us-asia."""
    require_binary("haproxy")  # skips on a developer's machine without it, fails under CI=true
    setup = PeersSetup(replicas=1, max_num_seqs=2, time_scale=0.05, clients=4, duration_s=2.0, token_scale=0.02,
                       ramp_s=0.0)
    sessions = [s for g in ("us", "eu", "asia") for s in [[
        Request(id=f"{g}{i}", arrival_s=0.0, region=g, session_id=f"{g}{i}", prompt_tokens=3, output_tokens=2,
                think_s=0.0, text="ace act add")] for i in range(30)]]
    row = peers.run_system(SYSTEMS["haproxy-us"], setup, sessions, run_dir=tmp_path, progress=False)
    assert row["status"] == "ok", row.get("reason")
    f = row["figures"]
    assert f["completed"] == f["sent"] > 3 and f["served_unknown"] == 0 and f["cross_region_frac"] > 0
    assert row["entry"]["eu"] != row["entry"]["us"] != row["entry"]["asia"]
    records = json.loads((tmp_path / "haproxy-us" / "records.json").read_text())["records"]
    urls = {g: [f"http://127.0.0.1:{json.loads(line)['ports'][0]}"
                for line in (tmp_path / "haproxy-us" / "logs" / f"emulator-{g}.log").read_text().splitlines()
                if "emulator_started" in line] for g in ("us", "eu", "asia")}
    served = peers.served_regions(tmp_path / "haproxy-us" / "logs", urls)
    ttft = {}
    for r in records:
        ttft.setdefault((r["region"], served[r["response_id"]].split("/")[0]), []).append(r["ttft_ms"])
    rtt = peers._latency(setup).rtt
    for (client, replica), values in ttft.items():
        assert min(values) >= 0.9 * (rtt(client, "us") + rtt("us", replica)), (client, replica, values)
