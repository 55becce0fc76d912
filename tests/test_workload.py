"""Workload generation: trace text, windows, derived sessions and regions, synthetic conversations."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from itertools import islice
from pathlib import Path

import pytest

from bench.replay.workload import (
    ROLE_MARKERS,
    TRACE_BLOCK_TOKENS,
    TraceError,
    WorkloadConfig,
    assign_region,
    block_text,
    derive_sessions,
    describe,
    load_workload,
    prompt_from_blocks,
    read_trace,
    region_weights,
    synthetic_workload,
    trace_workload,
    workload_settings,
)
from skylb.config import ConfigError, DeploymentConfig, load_config

REGIONS = ["us", "eu", "asia"]
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def write_trace(path: Path, rows: list[dict]) -> Path:
    """Write rows as a Mooncake JSONL trace."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(ts_ms: float, ids: list[int], *, partial: bool = True, out: int = 10) -> dict:
    """A trace row whose last block is partial (100 tokens) unless ``partial`` is False."""
    n = len(ids)
    length = (n - 1) * TRACE_BLOCK_TOKENS + 100 if partial else n * TRACE_BLOCK_TOKENS
    return {"timestamp": ts_ms, "input_length": length, "output_length": out, "hash_ids": ids}


def cfg_for(trace: Path | None, **kw) -> WorkloadConfig:
    """A WorkloadConfig over ``trace`` covering the whole of a small trace unless told otherwise."""
    return WorkloadConfig(trace=str(trace) if trace else None, **({"window_s": 10_000.0} | kw))


MINI = [
    row(0, [0, 1, 2]),  # line 1: new session
    row(1000, [0, 1, 5, 6]),  # line 2: shares [0, 1] with line 1's full blocks -> same session
    row(2000, [0, 7]),  # line 3: shares only block 0 (the system prompt) -> new session
    row(3000, [0, 1, 5, 6, 8]),  # line 4: line 2's full blocks [0,1,5] are a prefix -> joins via line 2
    row(4000, [0, 7, 9]),  # line 5: line 3's full blocks are [0] only -> 1 block is not enough -> new session
    row(5000, [0, 1, 2, 3], partial=False),  # line 6: line 1's full [0, 1] prefix -> session of line 1
    row(6000, [0, 1, 2, 3, 4]),  # line 7: line 6's full blocks [0,1,2,3] (no partial last) are the longest
]


def test_same_seed_same_workload(tmp_path):
    """Two loads with the same seed give identical requests (ids, regions, sessions, text)."""
    trace = write_trace(tmp_path / "t.jsonl", MINI * 1)
    a = load_workload(cfg_for(trace, seed=7), REGIONS)
    b = load_workload(cfg_for(trace, seed=7), REGIONS)
    key = lambda rs: [(r.id, r.region, r.session_id, r.prompt) for r in rs]  # noqa: E731
    assert key(a) == key(b)
    s1 = synthetic_workload(cfg_for(None, seed=3), REGIONS)
    s2 = synthetic_workload(cfg_for(None, seed=3), REGIONS)
    assert s1 == s2


def test_different_seed_changes_regions():
    """The seed decides session regions: other seeds move some of many sessions to other regions."""
    weighted = region_weights({"us": 0.5, "eu": 0.25, "asia": 0.25}, REGIONS)
    a = [assign_region(f"s{i}", weighted, 1) for i in range(200)]
    b = [assign_region(f"s{i}", weighted, 2) for i in range(200)]
    assert a != b


def test_equal_hash_ids_give_equal_text_prefix():
    """Equal ids at equal positions give equal text; a differing block makes the text differ from there on."""
    a = prompt_from_blocks([0, 1, 2], 3 * 512, 512)
    b = prompt_from_blocks([0, 1, 9], 3 * 512, 512)
    wa, wb = a.split(), b.split()
    assert wa[:1024] == wb[:1024]
    assert wa[1024:] != wb[1024:]
    assert block_text(5, 100) == " ".join(block_text(5, 512).split()[:100])  # a cut block is a prefix


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.3, 0.01])
def test_word_count_equals_scaled_input_length(tmp_path, scale):
    """Prompt words == round(input_length * token_scale) and blocks shrink with the scale, keeping shared prefixes."""
    rows = [row(0, [0, 1, 2]), row(10, [0, 1, 2, 3], partial=False), {**row(20, [0, 4]), "input_length": 513}]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    reqs = {r.id: r for r in load_workload(cfg_for(trace, token_scale=scale), REGIONS)}
    for i, raw in enumerate(rows, start=1):
        r = reqs[f"trace-{i:06d}"]
        expected = max(1, round(raw["input_length"] * scale))
        assert r.prompt_tokens == expected
        assert len(r.prompt.split()) == expected
        assert r.output_tokens == max(1, round(raw["output_length"] * scale))
    p1, p2 = reqs["trace-000001"].prompt.split(), reqs["trace-000002"].prompt.split()
    block = max(1, round(512 * scale))
    assert p1[: 2 * block] == p2[: 2 * block]


def test_window_and_time_compression(tmp_path):
    """Only rows with start_s <= t < start_s + window_s are kept; arrival = (t - start_s) / time_compression."""
    rows = [row(ms, [i, 100 + i]) for i, ms in enumerate([0, 9_999, 10_000, 15_000, 29_999, 30_000, 45_000])]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    reqs = trace_workload(cfg_for(trace, start_s=10.0, window_s=20.0, time_compression=2.0), REGIONS, trace)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 2.5, 9.9995])
    assert [r.id for r in reqs] == ["trace-000003", "trace-000004", "trace-000005"]


def test_max_requests_keeps_the_earliest(tmp_path):
    """max_requests keeps the first N requests by arrival time."""
    trace = write_trace(tmp_path / "t.jsonl", [row(ms, [i, 50 + i]) for i, ms in enumerate([500, 100, 300, 200])])
    reqs = load_workload(cfg_for(trace, max_requests=2), REGIONS)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.1, 0.2])


def test_sessions_chain_on_a_mini_trace(tmp_path):
    """A request joins the session whose full blocks are its longest >= 2-block prefix; block 0 alone does not."""
    rows = read_trace(write_trace(tmp_path / "t.jsonl", MINI))
    s = derive_sessions(rows)
    assert s[0] == "trace-s000001"
    assert s[1] == s[0]  # extends line 1
    assert s[2] != s[0]  # only the system block in common
    assert s[3] == s[0]  # via line 2
    assert s[4] not in (s[0], s[2])  # line 3 has a single full block
    assert s[5] == s[0]
    assert s[6] == s[0]
    reqs = {r.id: r for r in trace_workload(cfg_for(None), REGIONS, tmp_path / "t.jsonl")}
    assert [reqs[f"trace-{i:06d}"].turn for i in (1, 2, 4, 6, 7)] == [0, 1, 2, 3, 4]


def test_sessions_survive_a_window_starting_mid_conversation(tmp_path):
    """Sessions are derived over the trace before the window too, so a later turn keeps its session and turn."""
    trace = write_trace(tmp_path / "t.jsonl", MINI)
    reqs = load_workload(cfg_for(trace, start_s=3.0, window_s=2.0), REGIONS)
    first = next(r for r in reqs if r.id == "trace-000004")
    assert (first.session_id, first.turn) == ("trace-s000001", 2)


def _full(a: dict) -> list[int]:
    """a's hash ids without a partial last block."""
    return a["hash_ids"][:-1] if a["input_length"] < len(a["hash_ids"]) * 512 else a["hash_ids"]


def _is_parent(a: dict, b: dict) -> bool:
    """Brute-force rule: a's full blocks are a >= 2-block prefix of b's hash ids."""
    full = _full(a)
    return len(full) >= 2 and b["hash_ids"][: len(full)] == full


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="the Mooncake trace is not in shared/traces")
def test_sessions_chain_on_the_real_trace(tmp_path):
    """On the first 400 real lines, derived sessions match a brute-force application of the rule."""
    with REAL_TRACE.open() as f:
        lines = list(islice(f, 400))
    raw = [json.loads(x) for x in lines]
    path = tmp_path / "head.jsonl"
    path.write_text("".join(lines))
    sessions = derive_sessions(read_trace(path))
    for i, b in enumerate(raw):
        parents = [j for j in range(i) if _is_parent(raw[j], b)]
        if not parents:
            assert sessions[i] == f"trace-s{i + 1:06d}"
        else:
            best = max(parents, key=lambda j: (len(_full(raw[j])), j))  # longest shared, then latest
            assert sessions[i] == sessions[best]
    assert len(set(sessions)) < len(sessions)  # the trace does chain


def test_region_skew_follows_the_weights():
    """Over 20,000 sessions the region shares are within 2 points of the weights 0.5 / 0.25 / 0.25."""
    weighted = region_weights({"us": 0.5, "eu": 0.25, "asia": 0.25}, REGIONS)
    counts = Counter(assign_region(f"trace-s{i:06d}", weighted, 0) for i in range(20_000))
    for region, w in weighted:
        assert abs(counts[region] / 20_000 - w) < 0.02


def test_region_weights_edge_cases():
    """Unlisted regions get 0, weights of absent regions are ignored, all-zero means equal, negative is an error."""
    assert region_weights({"us": 2, "mars": 5}, ["us", "eu"]) == [("us", 2.0), ("eu", 0.0)]
    assert region_weights({"mars": 1}, ["us", "eu"]) == [("us", 1.0), ("eu", 1.0)]
    with pytest.raises(ValueError, match="eu"):
        region_weights({"eu": -1}, ["us", "eu"])
    weighted = region_weights({"us": 1}, ["us", "eu"])
    assert {assign_region(f"s{i}", weighted, 0) for i in range(100)} == {"us"}


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="the Mooncake trace is not in shared/traces")
def test_a_session_stays_in_one_region():
    """Every request of a derived session goes to the same region (real trace, first 10 minutes)."""
    reqs = load_workload(WorkloadConfig(trace=str(REAL_TRACE), window_s=600.0, token_scale=0.1), REGIONS)
    regions = defaultdict(set)
    for r in reqs:
        regions[r.session_id].add(r.region)
    assert len(regions) > 100
    assert all(len(v) == 1 for v in regions.values())
    assert any(r.turn > 0 for r in reqs)


def test_synthetic_turns_extend_each_other():
    """Turn k's prompt starts with turn k-1's prompt; turns are closed loop; words == prompt_tokens."""
    reqs = synthetic_workload(WorkloadConfig(trace=None, synthetic_conversations=4, synthetic_turns=3), REGIONS)
    by_session = defaultdict(list)
    for r in reqs:
        by_session[r.session_id].append(r)
    system = reqs[0].prompt.split(f" {ROLE_MARKERS['user']} ")[0]
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [t.turn for t in turns] == [0, 1, 2]
        assert turns[0].after is None and turns[0].think_s == 0
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt.startswith(prev.prompt + f" {ROLE_MARKERS['assistant']} ")
            assert cur.after == prev.id and cur.think_s > 0
            assert len({prev.region, cur.region}) == 1
        for t in turns:
            assert len(t.prompt.split()) == t.prompt_tokens
            assert t.prompt.startswith(system)  # one system prompt shared by all conversations
            assert 0 <= t.arrival_s < 5.0


def test_synthetic_conversation_counts_follow_the_weights():
    """synthetic_conversations x regions conversations, split by the weights (24 x 3 -> 36 / 18 / 18)."""
    reqs = synthetic_workload(WorkloadConfig(trace=None), REGIONS)
    sessions = Counter(r.region for r in reqs if r.turn == 0)
    assert sessions == {"us": 36, "eu": 18, "asia": 18}
    assert len(reqs) == 72 * 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing key 'hash_ids'"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    """A malformed line raises TraceError naming the file, the 1-based line number and the problem."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, [0, 1])) + "\n\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{message}"):
        load_workload(cfg_for(path), REGIONS)


def test_missing_trace_falls_back_to_synthetic(tmp_path):
    """A trace path that does not exist gives the synthetic workload; an existing one gives the trace."""
    reqs = load_workload(cfg_for(tmp_path / "nope.jsonl"), REGIONS)
    assert describe(reqs).startswith("synthetic:")
    trace = write_trace(tmp_path / "t.jsonl", MINI)
    reqs = load_workload(WorkloadConfig(trace="t.jsonl", window_s=100.0), REGIONS, base_dir=tmp_path)
    assert describe(reqs).startswith("trace: 7 requests")
    assert reqs[0].hash_ids == (0, 1, 2)


def test_workload_section_is_validated_strictly_by_the_benchmarks(tmp_path):
    """The product loads a config whatever its workload section holds; workload_settings rejects an unknown key,
    naming the file and the key, and gives the defaults when the section is absent."""
    path = tmp_path / "cfg.yaml"
    path.write_text("workload:\n  trce: t.jsonl\n")
    cfg = load_config(path)
    with pytest.raises(ConfigError, match=r"cfg\.yaml: workload\.trce: Extra inputs are not permitted"):
        workload_settings(cfg, source=path)
    with pytest.raises(ConfigError, match=r"workload\.window_s"):
        workload_settings(DeploymentConfig(workload={"window_s": -1}))
    assert workload_settings(DeploymentConfig()) == WorkloadConfig()
    assert workload_settings(load_config(None)).region_weights == {"us": 0.5, "eu": 0.25, "asia": 0.25}
