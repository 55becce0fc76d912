"""The emulator's Ollama model lifecycle against Ollama's documented behaviour (docs/api.md, docs/faq.md): load on
first use, keep_alive (duration, seconds, 0, negative), LRU eviction under a memory budget, /api/ps shapes, pre-warm
with an empty generate, and model management (/api/pull, /api/delete, /api/copy, /api/create) through the official
ollama client."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import aiohttp
import ollama
import pytest

from bench.emulator.ollama_lifecycle import FOREVER_S, ModelLifecycle, ModelSpec, OutOfMemory, parse_keep_alive
from bench.launch.procs import ProcGroup, free_ports, wait_http

# One xdist worker runs the whole module (--dist loadgroup): it shares one Ollama emulator (module fixture emu),
# started once, not once per worker.
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("emulator_ollama_lifecycle")]

GIB = 2**30
LOAD_S = 0.6


# ---- the pure model ------------------------------------------------------------------------------------------------

def test_parse_keep_alive_reads_ollamas_forms():
    assert parse_keep_alive(None) == 300.0
    assert parse_keep_alive("10m") == 600.0 and parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive("30s") == 30.0 and parse_keep_alive(3600) == 3600.0 and parse_keep_alive("45") == 45.0
    assert parse_keep_alive(0) == 0.0 and parse_keep_alive("0") == 0.0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    for bad in ("soon", "5 minutes", True, [1], ""):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_lifecycle_loads_evicts_lru_idle_and_expires():
    lc = ModelLifecycle(memory_bytes=10 * GIB, disk={"a": ModelSpec(4 * GIB, 2.0), "b": ModelSpec(4 * GIB, 1.0),
                                                     "c": ModelSpec(4 * GIB, 3.0)})
    assert lc.acquire("a", 0.0) == 2.0  # not loaded: ready after its load time
    lc.release("a", 5.0, 300.0)
    assert lc.acquire("b", 6.0) == 7.0
    lc.release("b", 8.0, 300.0)
    assert lc.acquire("a", 9.0) == 9.0  # loaded: ready now
    lc.release("a", 10.0, 300.0)
    assert lc.acquire("c", 11.0) == 14.0  # 12 GiB > 10: b (least recently used, idle) is evicted
    assert set(lc.loaded) == {"a", "c"} and lc.loads == 3
    lc.acquire("a", 12.0)
    with pytest.raises(OutOfMemory):  # a and c busy: nothing idle to evict for b
        lc.acquire("b", 12.0)
    lc.release("a", 13.0, 0)  # keep_alive 0: unloaded once idle
    lc.release("c", 13.0, 60.0)
    assert set(lc.loaded) == {"c"}
    assert lc.expire(72.0) == [] and lc.expire(73.0) == ["c"]
    lc.acquire("b", 80.0)
    assert lc.ps(80.5) == []  # still loading: not listed
    lc.release("b", 81.0, None)  # negative keep_alive: forever
    (model, expires_at), = lc.ps(1e6)
    assert model.name == "b" and expires_at == 1e6 + FOREVER_S


def test_another_num_ctx_reloads_the_model():
    """Ollama reloads a model asked with another context size (absent: the default 4096)."""
    lc = ModelLifecycle(disk={"a": ModelSpec(GIB, 2.0)})
    assert lc.acquire("a", 0.0, 8192) == 2.0
    lc.release("a", 3.0, 300.0)
    assert lc.acquire("a", 4.0, 8192) == 4.0 and lc.loads == 1
    lc.release("a", 4.5, 300.0)
    assert lc.acquire("a", 5.0) == 7.0 and lc.loads == 2 and lc.loaded["a"].num_ctx == 4096


def test_unload_of_a_busy_model_waits_for_its_requests():
    lc = ModelLifecycle(disk={"a": ModelSpec(GIB, 0.0)})
    lc.acquire("a", 0.0)
    assert lc.unload("a") is False and "a" in lc.loaded
    lc.release("a", 1.0, 300.0)
    assert "a" not in lc.loaded


def test_lifecycle_max_loaded_models():
    lc = ModelLifecycle(max_loaded=2, disk={n: ModelSpec(1, 0.0) for n in "xyz"})
    for n in "xy":
        lc.acquire(n, 0.0)
    with pytest.raises(OutOfMemory):
        lc.acquire("z", 1.0)  # both busy
    lc.release("x", 2.0, 300.0)
    lc.acquire("z", 3.0)
    assert set(lc.loaded) == {"y", "z"}


# ---- a real emulator process ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """An Ollama emulator: big (4 GiB, LOAD_S to load) and small (1 GiB, instant), 5 GiB of memory; base URL."""
    port, = free_ports(1)
    group = ProcGroup(tmp_path_factory.mktemp("ollama-lifecycle"))
    try:
        proc = group.skylb("emulator", "--engine", "ollama", "--port", str(port), "--time-scale", "0.01",
                           "--no-request-log", "--model", "big:latest", "--model", "small:latest",
                           "--ollama-model-size", f"big:latest={4 * GIB}", "--ollama-model-size",
                           f"small:latest={1 * GIB}", "--ollama-model-load-s", f"big:latest={LOAD_S}",
                           "--ollama-memory-bytes", str(5 * GIB), "--ollama-pull-s", "0.1", name="ollama")
        wait_http(f"http://127.0.0.1:{port}/api/version", timeout_s=20, proc=proc.popen)
        yield f"http://127.0.0.1:{port}"
    finally:
        group.stop_all()


async def _ps(base: str) -> dict[str, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/api/ps") as resp:
        return {m["name"]: m for m in (await resp.json())["models"]}


def _expires_in_s(entry: dict) -> float:
    at = datetime.fromisoformat(entry["expires_at"].replace("Z", "+00:00"))
    return (at - datetime.now(timezone.utc)).total_seconds()


async def test_load_time_keep_alive_ps_and_unload(emu):
    client = ollama.AsyncClient(host=emu, timeout=20)
    assert await _ps(emu) == {}  # Ollama starts with nothing loaded
    started = time.monotonic()
    first = await client.generate(model="big", prompt="hello there", options={"num_predict": 2},
                                  keep_alive="10m")
    assert time.monotonic() - started >= LOAD_S and first.load_duration >= LOAD_S * 1e9 * 0.99
    second = await client.generate(model="big", prompt="hello again", options={"num_predict": 2})
    assert second.load_duration == 0  # already loaded
    ps = await _ps(emu)
    assert set(ps) == {"big:latest"}
    entry = ps["big:latest"]
    assert entry["size"] == entry["size_vram"] == 4 * GIB and {"digest", "details", "model"} <= set(entry)
    assert 290 < _expires_in_s(entry) <= 300  # the latest request gave none: the default 5m
    await client.generate(model="big", prompt="", keep_alive=-1)  # pre-warm, forever
    assert _expires_in_s((await _ps(emu))["big:latest"]) > 365 * 24 * 3600
    unloaded = await client.generate(model="big", prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload" and await _ps(emu) == {}
    loaded = await client.generate(model="big", prompt="", keep_alive="30s")  # an empty generate loads it
    assert loaded.done_reason == "load" and 25 < _expires_in_s((await _ps(emu))["big:latest"]) <= 30
    await client.generate(model="small", prompt="x", options={"num_predict": 1}, keep_alive=0)
    assert set(await _ps(emu)) == {"big:latest"}  # keep_alive 0: unloaded right after the request
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{emu}/api/generate", json={"model": "big", "prompt": "x", "keep_alive": "soon"}) as r:
            assert r.status == 400 and "keep_alive" in (await r.json())["error"]
    await client.generate(model="big", prompt="", keep_alive=0)


async def test_memory_budget_evicts_least_recently_used_idle_model(emu):
    client = ollama.AsyncClient(host=emu, timeout=20)
    await client.generate(model="big", prompt="", keep_alive="5m")
    await client.generate(model="small", prompt="", keep_alive="5m")
    assert set(await _ps(emu)) == {"big:latest", "small:latest"}  # 5 GiB: both fit
    await client.pull("other")  # the default size, 4.58 GiB
    await client.generate(model="small", prompt="", keep_alive="5m")  # small is now the most recently used
    await client.generate(model="other", prompt="", keep_alive="5m")
    assert set(await _ps(emu)) == {"other:latest"}  # 4.6 GiB + 1 GiB > 5 GiB: big, then small, evicted
    await client.delete("other")
    assert "other:latest" not in {m.model for m in (await client.list()).models}
    assert await _ps(emu) == {}


async def test_model_management_endpoints(emu):
    client = ollama.AsyncClient(host=emu, timeout=20)
    progress = [p async for p in await client.pull("fresh:1b", stream=True)]
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    downloads = [p for p in progress if p.total]
    assert downloads and downloads[-1].completed == downloads[-1].total and downloads[0].digest.startswith("sha256:")
    assert "fresh:1b" in {m.model for m in (await client.list()).models}
    reply = await client.generate(model="fresh:1b", prompt="hi", options={"num_predict": 1})
    assert reply.done
    await client.copy("fresh:1b", "copied")
    created = [p.status async for p in await client.create(model="made", from_="fresh:1b", system="be brief",
                                                           stream=True)]
    assert created[-1] == "success"
    names = {m.model for m in (await client.list()).models}
    assert {"copied:latest", "made:latest"} <= names
    for name in ("fresh:1b", "copied", "made"):
        await client.delete(name)
    with pytest.raises(ollama.ResponseError) as err:
        await client.delete("fresh:1b")
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        await client.generate(model="fresh:1b", prompt="hi")
    assert err.value.status_code == 404
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{emu}/api/pull", json={"model": "quiet", "stream": False}) as resp:
            assert resp.status == 200 and await resp.json() == {"status": "success"}
        async with http.delete(f"{emu}/api/delete", data=json.dumps({"model": "quiet"})) as resp:
            assert resp.status == 200
