"""bench/sim/trace_variants.py: held-out variants of a Mooncake-format trace."""

import json
import statistics

import pytest

from bench.replay.workload import TraceRow
from bench.sim.trace_variants import main, vary


def _rows(n=2000):
    # Two sessions sharing block 0 and each other's first blocks, as the real trace's rows do.
    return [TraceRow(line=i + 1, timestamp_ms=float(i * 100), input_length=1000 + i, output_length=10 + i % 7,
                     hash_ids=(0, 1 + i % 3, 5 + i)) for i in range(n)]


def test_unique_blocks_share_nothing_and_keep_the_lengths():
    rows = _rows(50)
    out = vary(rows, unique_blocks=True)
    ids = [i for r in out for i in r["hash_ids"]]
    assert len(ids) == len(set(ids)) == 150
    assert not set(ids) & {i for r in rows for i in r.hash_ids}
    assert [(r["input_length"], r["output_length"], r["timestamp"]) for r in out] == [
        (r.input_length, r.output_length, int(r.timestamp_ms)) for r in rows]


def test_redrawn_arrivals_keep_the_mean_gap_and_take_the_asked_spread():
    rows = _rows()
    for arrivals, cv in (("poisson", 1.0), ("gamma", 3.0)):
        times = [r["timestamp"] for r in vary(rows, arrivals=arrivals, cv=cv, seed=1)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times == sorted(times) and times[0] == 0
        assert statistics.mean(gaps) == pytest.approx(100, rel=0.25)
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.3)
    assert vary(rows, arrivals="gamma", seed=2) != vary(rows, arrivals="gamma", seed=3)


def test_scales_and_bad_arguments():
    out = vary(_rows(3), time_scale=3, output_scale=2.5)
    assert [r["timestamp"] for r in out] == [0, 300, 600]
    assert [r["output_length"] for r in out] == [25, 28, 30]
    with pytest.raises(ValueError, match="arrivals"):
        vary(_rows(3), arrivals="uniform")
    with pytest.raises(ValueError, match="positive"):
        vary(_rows(3), output_scale=0)


def test_the_command_writes_a_trace_the_replay_reads(tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                       "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                           for r in _rows(20)))
    out = tmp_path / "v.jsonl"
    assert main([str(src), str(out), "--unique-blocks", "--arrivals", "poisson"]) == 0
    assert "20 requests" in capsys.readouterr().out
    from bench.replay.workload import read_trace
    assert len(read_trace(out)) == 20
    src.write_text('{"timestamp": 0}\n')
    assert main([str(src), str(out)]) == 2
    assert "error:" in capsys.readouterr().err
