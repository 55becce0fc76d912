"""bench/live/admission.py's measures: what counts as a limit overrun (pure, no processes)."""

from bench.live.admission import ModelSpec, overruns, quotas, utilisation


def test_concurrency_overruns_counted():
    spec = ModelSpec("m", 1.0, 2, None)
    ok = [(0.0, 1.0, 10), (0.0, 1.0, 10), (1.0, 2.0, 10), (1.5, 2.5, 10)]
    assert overruns(ok, spec) == {"concurrency": 0, "tpm": 0}
    over = ok + [(0.5, 0.7, 10)]
    assert overruns(over, spec)["concurrency"] == 1


def test_tpm_overruns_follow_the_bucket():
    spec = ModelSpec("m", 0.1, 100, 600)  # 600 tokens of burst, 10 tokens/s after
    burst = [(0.0, 0.1, 300), (0.0, 0.1, 300)]
    assert overruns(burst, spec)["tpm"] == 0
    assert overruns(burst + [(1.0, 1.1, 20)], spec)["tpm"] == 1   # 620 > 600 + 10 x (1 + 0.05)
    assert overruns(burst + [(2.0, 2.1, 20)], spec)["tpm"] == 0   # 620 <= 600 + 20
    assert overruns(burst + [(1.96, 2.0, 20)], spec)["tpm"] == 0  # within the 50 ms admission lag
    u = utilisation(burst, spec, 60.0)
    assert u["tasks"] == 2 and u["tokens"] == 600 / 1200


def test_quotas_shape():
    q = quotas(50.0)
    assert set(q["groups"]["all"]) == {f"m{i}" for i in range(10)}
    assert q["models"]["m2"] == {"max_concurrent": 3}
