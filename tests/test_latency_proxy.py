"""The Toxiproxy-API-compatible latency proxy (`skylb toxiproxy`) and LatencyLinks, run as a real subprocess.

API checks go through the official `toxiproxy-python` client where it has a call, raw HTTP otherwise. Data-path
checks use a TCP echo server and an aiohttp server started in the test's event loop on 127.0.0.1 as upstreams (the
acceptance test runs its upstream as a separate process, see there). Most tests share one proxy server (module
fixture; every proxy is deleted after each test) to keep the file fast; the acceptance and SIGTERM tests start their
own through the ``procs`` fixture.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import sys
import time

import aiohttp
import pytest
import requests
from aiohttp import web
from toxiproxy import Toxiproxy
from toxiproxy.api import APIConsumer
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from bench.latency.links import ENV_VAR, LatencyLinks, LinkError, api_reachable, split_rtt
from tests.procs import ProcGroup, free_port

# One xdist worker runs the whole module (--dist loadgroup): it shares one proxy server (module fixture shared_server),
# started once, not once per worker.
pytestmark = [pytest.mark.timeout(30), pytest.mark.xdist_group("latency_proxy")]

#: Scheduling noise between two separate timings of one request by the test's client (s).
TIMING_NOISE_S = 0.001


# -- fixtures and helpers ------------------------------------------------------------------------------------------

class Server:
    """A running `skylb toxiproxy`: its API URL and process id."""

    def __init__(self, url: str, pid: int):
        self.url = url
        self.pid = pid


def start_toxiproxy(group: ProcGroup) -> Server:
    """Start `skylb toxiproxy` on a free port through the test process helpers and wait for /version."""
    port = free_port()
    proc = group.skylb("toxiproxy", "--port", str(port), name="toxiproxy",
                       wait_url=f"http://127.0.0.1:{port}/version")
    return Server(f"http://127.0.0.1:{port}", proc.popen.pid)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory) -> Server:
    """One proxy server for the module, stopped at the end."""
    with ProcGroup(tmp_path_factory.mktemp("toxiproxy-logs")) as group:
        yield start_toxiproxy(group)


def point_client(url: str) -> None:
    """The toxiproxy-python client keeps its server as class attributes: point them at ``url``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    APIConsumer.host, APIConsumer.port = host, int(port)


@pytest.fixture
def api(shared_server) -> str:
    """The shared server's URL with the client pointed at it; every proxy is deleted after the test."""
    point_client(shared_server.url)
    yield shared_server.url
    for name in requests.get(f"{shared_server.url}/proxies", timeout=5).json():
        requests.delete(f"{shared_server.url}/proxies/{name}", timeout=5)


class EchoServer:
    """TCP echo server in the test's loop: echoes bytes; on EOF writes b"<EOF>" and closes. Counts open conns."""

    def __init__(self) -> None:
        self.open = 0
        self.addr = ""
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.addr = "127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        self.open += 1
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write(b"<EOF>")
            await writer.drain()
        except OSError:
            pass
        finally:
            self.open -= 1
            writer.close()
            self._tasks.discard(asyncio.current_task())

    async def stop(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def echo() -> EchoServer:
    """A started EchoServer, stopped after the test."""
    server = EchoServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def http_upstream() -> str:
    """An aiohttp server on 127.0.0.1: GET /ping -> "pong"; GET /stream?n=&gap_ms= -> n lines "chunk i", gap apart."""

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def stream(request: web.Request) -> web.StreamResponse:
        n, gap_s = int(request.query["n"]), int(request.query["gap_ms"]) / 1000
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(n):
            if i:
                await asyncio.sleep(gap_s)
            await resp.write(f"chunk {i}\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/ping", ping)
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield "127.0.0.1:%d" % runner.addresses[0][1]
    await runner.cleanup()


async def connect(listen: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a TCP connection to ``"host:port"`` (2 s timeout)."""
    host, port = listen.rsplit(":", 1)
    return await asyncio.wait_for(asyncio.open_connection(host, int(port)), 2)


async def echo_rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes = b"ping") -> float:
    """Seconds for ``payload`` to come back through an echo connection."""
    start = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 5) == payload
    return time.perf_counter() - start


async def read_to_eof(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until EOF; fails after ``timeout_s``."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def timed_get(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds for one GET (new connection each time) whose body must be "pong"."""
    start = time.perf_counter()
    async with session.get(url) as resp:
        assert await resp.text() == "pong"
    return time.perf_counter() - start


def fresh_session() -> aiohttp.ClientSession:
    """A client session that opens a new connection per request (no pooling effects on timings)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=10))


def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    """Poll ``predicate`` every 20 ms until true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(0.02)
    return True


def fd_count(pid: int) -> int:
    """Open file descriptors of process ``pid`` (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- the acceptance line -------------------------------------------------------------------------------------------

# The acceptance test's upstream runs in its own process, so the upstream's work after answering does not run in
# the client's event loop: otherwise it lands inside an untoxic request's timing but inside the toxic's wait.
UPSTREAM_SCRIPT = """
import sys
from aiohttp import web
async def ping(request):
    return web.Response(text="pong")
app = web.Application()
app.router.add_get("/ping", ping)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


async def test_100ms_latency_toxic_adds_at_least_100ms_to_a_request(procs):
    """A 100 ms latency toxic adds at least 100 ms (and under 1 s) to an HTTP request that crosses it."""
    server = start_toxiproxy(procs)
    up_port = free_port()
    procs.start([sys.executable, "-c", UPSTREAM_SCRIPT, str(up_port)], name="http-upstream",
                wait_url=f"http://127.0.0.1:{up_port}/ping")
    point_client(server.url)
    client = Toxiproxy()
    plain = client.create(upstream=f"127.0.0.1:{up_port}", name="plain", listen="127.0.0.1:0")
    toxic = client.create(upstream=f"127.0.0.1:{up_port}", name="toxic", listen="127.0.0.1:0")
    toxic.add_toxic(type="latency", attributes={"latency": 100})
    without, with_toxic = [], []
    async with fresh_session() as session:
        await timed_get(session, f"http://{plain.listen}/ping")  # warm-up
        for _ in range(5):  # interleaved, each after a pause so the previous request's teardown is not timed
            await asyncio.sleep(0.03)
            without.append(await timed_get(session, f"http://{plain.listen}/ping"))
            await asyncio.sleep(0.03)
            with_toxic.append(await timed_get(session, f"http://{toxic.listen}/ping"))
    # Strict: every request that crosses the toxic takes at least its 100 ms (the response is held that long).
    assert min(with_toxic) >= 0.100, with_toxic
    # Compared with the same request without the toxic, it adds at least 100 ms. The proxy adds 100 ms plus ~0.1 ms,
    # while two separate timings of the client differ by up to ~0.3 ms of scheduling noise; TIMING_NOISE_S absorbs
    # that, and median-vs-fastest makes the comparison conservative.
    added = statistics.median(with_toxic) - min(without)
    assert 0.100 - TIMING_NOISE_S <= added < 1.0, (without, with_toxic)


# -- API through the toxiproxy-python client -----------------------------------------------------------------------

def test_version_and_empty_proxy_list(api):
    """/version answers Toxiproxy's {"version": ...} and a fresh server lists no proxies."""
    assert requests.get(f"{api}/version", timeout=5).json()["version"].startswith("2.")
    client = Toxiproxy()
    assert client.running() is True
    assert b"version" in client.version()
    assert client.proxies() == {}


def test_proxy_lifecycle_with_the_client(api, echo):
    """create (port 0 -> real port), list, get, disable, enable and destroy work through the real client."""
    client = Toxiproxy()
    proxy = client.create(upstream=echo.addr, name="redis", listen="127.0.0.1:0")
    host, port = proxy.listen.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and proxy.enabled is True and proxy.upstream == echo.addr
    assert list(client.proxies()) == ["redis"]
    proxy.disable()
    assert client.get_proxy("redis").enabled is False
    proxy.enable()
    shown = requests.get(f"{api}/proxies/redis", timeout=5).json()
    assert shown == {"name": "redis", "listen": proxy.listen, "upstream": echo.addr, "enabled": True, "toxics": []}
    assert client.destroy(proxy) is True
    assert client.proxies() == {} and client.get_proxy("redis") is None


def test_duplicate_proxy_is_409(api, echo):
    """Creating a proxy whose name exists is 409 {"error": "proxy already exists"} (ProxyExists in the client)."""
    body = {"name": "dup", "listen": "127.0.0.1:0", "upstream": echo.addr}
    APIConsumer.post("/proxies", json=body)
    with pytest.raises(ProxyExists):
        APIConsumer.post("/proxies", json=body)
    with pytest.raises(ProxyExists):
        Toxiproxy().create(upstream=echo.addr, name="dup")
    resp = requests.post(f"{api}/proxies", json=body, timeout=5)
    assert resp.status_code == 409 and resp.json() == {"error": "proxy already exists", "status": 409}


def test_unknown_proxy_or_toxic_is_404(api, echo):
    """Unknown proxies and toxics are 404 with Toxiproxy's error bodies (NotFound in the client)."""
    resp = requests.get(f"{api}/proxies/missing", timeout=5)
    assert resp.status_code == 404 and resp.json() == {"error": "proxy not found", "status": 404}
    for call in (lambda: APIConsumer.get("/proxies/missing"), lambda: APIConsumer.delete("/proxies/missing"),
                 lambda: APIConsumer.post("/proxies/missing", json={"enabled": False}),
                 lambda: APIConsumer.get("/proxies/missing/toxics")):
        with pytest.raises(NotFound):
            call()
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    resp = requests.get(f"{api}/proxies/p/toxics/missing", timeout=5)
    assert resp.status_code == 404 and resp.json() == {"error": "toxic not found", "status": 404}
    with pytest.raises(NotFound):
        proxy.destroy_toxic("missing")


def test_toxic_crud_with_the_client(api, echo):
    """Toxics are added (default name <type>_<stream>), listed, shown, updated in part and removed."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="latency", attributes={"latency": 10, "jitter": 2})
    proxy.add_toxic(type="bandwidth", stream="upstream", toxicity=0.5, attributes={"rate": 100})
    toxics = proxy.toxics()
    assert set(toxics) == {"latency_downstream", "bandwidth_upstream"}
    assert toxics["latency_downstream"].attributes == {"latency": 10, "jitter": 2}
    assert toxics["bandwidth_upstream"].stream == "upstream" and toxics["bandwidth_upstream"].toxicity == 0.5
    listed = requests.get(f"{api}/proxies/p/toxics", timeout=5).json()
    assert [t["name"] for t in listed] == ["bandwidth_upstream", "latency_downstream"]  # upstream first
    updated = APIConsumer.post("/proxies/p/toxics/latency_downstream", json={"attributes": {"latency": 20}}).json()
    assert updated == {"attributes": {"latency": 20, "jitter": 2}, "name": "latency_downstream", "type": "latency",
                       "stream": "downstream", "toxicity": 1.0}
    assert requests.get(f"{api}/proxies/p/toxics/latency_downstream", timeout=5).json() == updated
    assert proxy.destroy_toxic("latency_downstream") is True
    assert proxy.destroy_toxic("bandwidth_upstream") is True
    assert proxy.toxics() == {}


def test_bad_toxic_or_proxy_input_is_400(api, echo):
    """Unknown toxic type, bad stream, non-integer attribute and missing fields are 400; a toxic name clash 409."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="no_such_toxic")
    resp = requests.post(f"{api}/proxies/p/toxics", json={"type": "no_such_toxic"}, timeout=5)
    assert resp.status_code == 400 and resp.json() == {"error": "invalid toxic type", "status": 400}
    for body in ({"type": "latency", "stream": "sideways"}, {"type": "latency", "attributes": {"latency": 37.5}},
                 {"type": "latency", "attributes": {"latency": "100"}}, {"type": "latency", "toxicity": "x"}):
        resp = requests.post(f"{api}/proxies/p/toxics", json=body, timeout=5)
        assert resp.status_code == 400 and resp.json()["status"] == 400, body
    proxy.add_toxic(type="latency", attributes={"latency": 1})
    with pytest.raises(ProxyExists):  # the client maps every 409 to ProxyExists
        proxy.add_toxic(type="latency", attributes={"latency": 2})
    for body in ({"name": "x"}, {"upstream": echo.addr}, {"name": "x", "upstream": "no-port"}):
        resp = requests.post(f"{api}/proxies", json=body, timeout=5)
        assert resp.status_code == 400 and "error" in resp.json(), body
    resp = requests.post(f"{api}/proxies", data=b"{not json", timeout=5)
    assert resp.status_code == 400 and resp.json()["error"].startswith("bad request body")


def test_populate_creates_keeps_and_replaces(api, echo):
    """POST /populate creates proxies (201), leaves unchanged ones alone and replaces changed ones."""
    first = requests.post(f"{api}/populate", timeout=5, json=[
        {"name": "a", "listen": "127.0.0.1:0", "upstream": echo.addr},
        {"name": "b", "listen": "127.0.0.1:0", "upstream": echo.addr, "enabled": False}])
    assert first.status_code == 201
    a, b = first.json()["proxies"]
    assert a["enabled"] is True and not a["listen"].endswith(":0") and b["enabled"] is False
    again = requests.post(f"{api}/populate", json=[{"name": "a", "listen": a["listen"], "upstream": echo.addr}],
                          timeout=5)
    assert again.status_code == 201 and again.json()["proxies"][0]["listen"] == a["listen"]
    moved = requests.post(f"{api}/populate", json=[{"name": "a", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:9"}],
                          timeout=5).json()["proxies"][0]
    assert moved["upstream"] == "127.0.0.1:9" and moved["listen"] != a["listen"]
    bad = requests.post(f"{api}/populate", json=[{"name": "c"}], timeout=5)
    assert bad.status_code == 400 and bad.json()["error"] == "missing required field: upstream at proxy 1"


# -- data path -----------------------------------------------------------------------------------------------------

async def test_jitter_varies_the_delay_within_bounds(api, echo):
    """latency 100 +/- 50 ms: every round trip is delayed 50..150 ms, and the delays differ."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="latency", attributes={"latency": 100, "jitter": 50})
    reader, writer = await connect(proxy.listen)
    rtts = [await echo_rtt(reader, writer) for _ in range(8)]
    writer.close()
    assert all(0.050 <= r < 0.150 + 0.05 for r in rtts), rtts
    assert max(rtts) - min(rtts) > 0.010, rtts


async def test_downstream_stream_is_pipelined_and_ordered(api, http_upstream):
    """A response streamed in 5 chunks 100 ms apart through 200 ms latency arrives in order at ~200 + 100*i ms."""
    proxy = Toxiproxy().create(upstream=http_upstream, name="p")
    proxy.add_toxic(type="latency", attributes={"latency": 200})
    arrivals, lines = [], []
    async with fresh_session() as session:
        start = time.perf_counter()
        async with session.get(f"http://{proxy.listen}/stream?n=5&gap_ms=100") as resp:
            while line := await resp.content.readline():
                arrivals.append(time.perf_counter() - start)
                lines.append(line.decode().strip())
    assert lines == [f"chunk {i}" for i in range(5)]
    assert arrivals[0] >= 0.200
    assert all(later - earlier > 0.05 for earlier, later in zip(arrivals, arrivals[1:])), arrivals
    # Pipelined: latency + streaming time (0.6 s), not latency x chunks (1.4 s).
    assert 0.6 <= arrivals[-1] < 0.85, arrivals


async def test_toxics_apply_to_open_connections(api, echo):
    """Adding, updating and removing an upstream latency toxic changes an already open connection at once."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    reader, writer = await connect(proxy.listen)
    assert await echo_rtt(reader, writer) < 0.05
    proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 150})
    assert 0.150 <= await echo_rtt(reader, writer) < 0.4
    APIConsumer.post("/proxies/p/toxics/latency_upstream", json={"attributes": {"latency": 60}})
    assert 0.060 <= await echo_rtt(reader, writer) < 0.15
    proxy.destroy_toxic("latency_upstream")
    assert await echo_rtt(reader, writer) < 0.05
    # Removing a toxic releases the chunk it holds instead of serving the rest of the delay.
    proxy.add_toxic(type="latency", attributes={"latency": 3000})
    start = time.perf_counter()
    writer.write(b"held")
    await asyncio.sleep(0.1)
    proxy.destroy_toxic("latency_downstream")
    assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
    assert time.perf_counter() - start < 1.0
    writer.close()


async def test_toxicity_is_the_chance_a_connection_gets_the_toxic(api, echo):
    """toxicity 0 never applies the toxic; toxicity 1 applies it to every connection."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="latency", name="never", toxicity=0.0, attributes={"latency": 300})
    proxy.add_toxic(type="latency", name="always", stream="upstream", toxicity=1.0, attributes={"latency": 80})
    for _ in range(3):
        reader, writer = await connect(proxy.listen)
        assert 0.080 <= await echo_rtt(reader, writer) < 0.3
        writer.close()


async def test_half_close_and_eof_follow_the_data(api, echo):
    """A client's half-close reaches the upstream and the upstream's reply and EOF come back, in order, via toxics."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 50})
    proxy.add_toxic(type="latency", stream="downstream", attributes={"latency": 50})
    proxy.add_toxic(type="noop")
    reader, writer = await connect(proxy.listen)
    writer.write(b"hello")
    writer.write_eof()
    assert await read_to_eof(reader) == b"hello<EOF>"
    writer.close()
    assert await asyncio.to_thread(wait_until, lambda: echo.open == 0)


async def test_disable_drops_connections_and_refuses_new_ones(api, echo):
    """Disabling closes the listener and both sides of open connections; enabling listens on the same port."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    reader, writer = await connect(proxy.listen)
    await echo_rtt(reader, writer)
    assert echo.open == 1
    proxy.disable()
    try:
        assert await read_to_eof(reader, 2) == b""
    except ConnectionResetError:
        pass
    writer.close()
    assert await asyncio.to_thread(wait_until, lambda: echo.open == 0)
    with pytest.raises(ConnectionRefusedError):
        await connect(proxy.listen)
    proxy.enable()
    assert Toxiproxy().get_proxy("p").listen == proxy.listen
    reader, writer = await connect(proxy.listen)
    assert await echo_rtt(reader, writer) < 0.5
    writer.close()


async def test_delete_frees_the_port_and_leaks_no_sockets(api, shared_server, echo):
    """Deleting (or disabling) a proxy with open connections closes every socket it held and frees its port."""
    client = Toxiproxy()
    baseline = fd_count(shared_server.pid)
    proxy = client.create(upstream=echo.addr, name="p")
    conns = [await connect(proxy.listen) for _ in range(5)]
    for reader, writer in conns:
        await echo_rtt(reader, writer)
    proxy.add_toxic(type="latency", attributes={"latency": 1000})
    for _, writer in conns:
        writer.write(b"in flight")  # held by the toxic when the proxy goes
    await asyncio.sleep(0.05)
    proxy.disable()
    proxy.enable()
    conns += [await connect(proxy.listen) for _ in range(3)]
    await asyncio.sleep(0.05)
    client.destroy(proxy)
    for _, writer in conns:
        writer.close()
    host, port = proxy.listen.rsplit(":", 1)
    with socket.socket() as sock:  # free again: a new listener can take it (SO_REUSEADDR: closed conns TIME_WAIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen()
    assert await asyncio.to_thread(wait_until, lambda: fd_count(shared_server.pid) <= baseline), \
        (fd_count(shared_server.pid), baseline)
    assert await asyncio.to_thread(wait_until, lambda: echo.open == 0)


async def test_reset_enables_proxies_and_removes_toxics(api, echo):
    """POST /reset re-enables every proxy and removes every toxic, so traffic flows undelayed again."""
    client = Toxiproxy()
    proxy = client.create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="latency", attributes={"latency": 500})
    proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 0})
    proxy.disable()
    assert client.reset() is True
    shown = client.get_proxy("p")
    assert shown.enabled is True and shown.toxics() == {}
    reader, writer = await connect(proxy.listen)
    assert await echo_rtt(reader, writer) < 0.1
    writer.close()


async def test_bandwidth_limits_the_rate(api, echo):
    """bandwidth rate 100 KB/s: 30 kB come back in about 0.3 s, complete and in order."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="bandwidth", attributes={"rate": 100})
    payload = bytes(range(256)) * 117 + b"x" * 48  # 30,000 bytes
    reader, writer = await connect(proxy.listen)
    elapsed = await echo_rtt(reader, writer, payload)
    writer.close()
    assert 0.25 <= elapsed < 1.0, elapsed


async def test_timeout_holds_data_then_closes(api, echo):
    """timeout 300 ms passes no data and closes the connection after ~300 ms; timeout 0 holds until removed."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="timeout", attributes={"timeout": 300})
    reader, writer = await connect(proxy.listen)
    start = time.perf_counter()
    writer.write(b"lost")
    assert await read_to_eof(reader, 2) == b""
    assert 0.28 <= time.perf_counter() - start < 0.8
    writer.close()
    proxy.destroy_toxic("timeout_downstream")
    reader, writer = await connect(proxy.listen)
    proxy.add_toxic(type="timeout", attributes={"timeout": 0})
    writer.write(b"held")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    proxy.destroy_toxic("timeout_downstream")
    assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
    writer.close()


async def test_reset_peer_resets_the_connection(api, echo):
    """reset_peer resets the connection (ECONNRESET at the client) once data crosses it."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="reset_peer", stream="upstream", attributes={"timeout": 100})
    reader, writer = await connect(proxy.listen)
    start = time.perf_counter()
    writer.write(b"boom")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 2)
    assert 0.09 <= time.perf_counter() - start < 1.0
    writer.close()


async def test_slow_close_delays_only_the_close(api, echo):
    """slow_close 300 ms passes data at once but the end of the stream only 300 ms later."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="slow_close", attributes={"delay": 300})
    reader, writer = await connect(proxy.listen)
    start = time.perf_counter()
    writer.write(b"bye")
    writer.write_eof()
    assert await asyncio.wait_for(reader.readexactly(8), 2) == b"bye<EOF>"
    assert time.perf_counter() - start < 0.2
    assert await read_to_eof(reader) == b""
    assert time.perf_counter() - start >= 0.3
    writer.close()


async def test_limit_data_closes_after_the_limit(api, echo):
    """limit_data 10 bytes passes exactly the first 10 bytes of the stream, then closes the connection."""
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    proxy.add_toxic(type="limit_data", attributes={"bytes": 10})
    reader, writer = await connect(proxy.listen)
    writer.write(b"0123456789abcdefghij")
    assert await read_to_eof(reader) == b"0123456789"
    writer.close()


# -- process and LatencyLinks ----------------------------------------------------------------------------------------

async def test_sigterm_stops_the_server_cleanly(procs, echo):
    """SIGTERM makes `skylb toxiproxy` drop its proxies' connections, free their ports and exit 0."""
    server = start_toxiproxy(procs)
    point_client(server.url)
    proxy = Toxiproxy().create(upstream=echo.addr, name="p")
    reader, writer = await connect(proxy.listen)
    await echo_rtt(reader, writer)
    proc = procs.procs[-1]
    proc.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.popen.wait, 5) == 0
    try:
        assert await read_to_eof(reader, 2) == b""
    except ConnectionResetError:
        pass
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await connect(proxy.listen)
    assert "toxiproxy_stopping" in proc.log()


def test_split_rtt_halves_sum_to_the_rtt():
    """An RTT (rounded up to whole ms) and its jitter are split into integer halves that sum to them."""
    assert split_rtt(80) == ((40, 0), (40, 0))
    assert split_rtt(75, 10) == ((37, 5), (38, 5))
    assert split_rtt(0.4) == ((0, 0), (1, 0))
    with pytest.raises(ValueError):
        split_rtt(-1)


async def test_latency_links_round_trip_pays_the_rtt(api, http_upstream):
    """LatencyLinks.link gives an address whose request/response round trip is at least the RTT; close() cleans up."""
    async with fresh_session() as session:
        links = LatencyLinks(api)
        assert links.reachable()
        listen = links.link("us-eu", http_upstream, rtt_ms=80)
        assert links.link("us-eu", http_upstream, rtt_ms=80) != listen  # replaced, on a new port
        listen = links.links["us-eu"]
        toxics = requests.get(f"{api}/proxies/us-eu/toxics", timeout=5).json()
        assert {(t["stream"], t["attributes"]["latency"]) for t in toxics} == {("upstream", 40), ("downstream", 40)}
        for _ in range(3):  # the request pays 40 ms on the way in, the response 40 ms on the way out
            assert 0.080 <= await timed_get(session, f"http://{listen}/ping") < 0.5
        port = free_port()  # a port the caller reserved: the link listens there, not on one the server picks
        assert links.link("pinned", http_upstream, rtt_ms=10, listen_port=port) == f"127.0.0.1:{port}"
        assert 0.010 <= await timed_get(session, f"http://127.0.0.1:{port}/ping") < 0.5
        links.close()
    assert requests.get(f"{api}/proxies", timeout=5).json() == {}
    assert links.links == {}


def test_a_link_whose_reserved_port_was_taken_listens_on_a_spare_or_says_why(api, http_upstream):
    """A reserved port can be taken before the proxy binds it (by another process's connection): with spare ports
    of the same reservation the link listens on the next one; without, LinkError says which link and why (not a
    KeyError on the refusal's body)."""
    links = LatencyLinks(api)
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spare = free_port()
        assert links.link("spared", http_upstream, rtt_ms=0, listen_port=port,
                          spare_ports=iter([spare])) == f"127.0.0.1:{spare}"
        with pytest.raises(LinkError, match="'stuck' refused: HTTP 5"):
            links.link("stuck", http_upstream, rtt_ms=0, listen_port=port)
        with pytest.raises(LinkError, match="'dry' refused: HTTP 5"):  # the spares ran out: the refusal, said
            links.link("dry", http_upstream, rtt_ms=0, listen_port=port, spare_ports=iter([]))
    finally:
        taken.close()
        links.close()


def test_api_reachable_says_whether_an_api_answers(api):
    """api_reachable is True for a running server and False (quickly) for a closed port."""
    assert api_reachable(api) is True
    start = time.monotonic()
    assert api_reachable(f"http://127.0.0.1:{free_port()}", timeout_s=1.0) is False
    assert time.monotonic() - start < 2


@pytest.mark.skipif(not os.environ.get(ENV_VAR), reason=f"{ENV_VAR} not set (no external Toxiproxy)")
async def test_latency_links_use_toxiproxy_url(http_upstream):
    """With TOXIPROXY_URL set, LatencyLinks() talks to that Toxiproxy (it must reach 127.0.0.1 upstreams here)."""
    links = LatencyLinks()
    assert links.api_url == os.environ[ENV_VAR] and links.reachable()
    try:
        listen = links.link("skylb-test-link", http_upstream, rtt_ms=60)
        async with fresh_session() as session:
            assert await timed_get(session, f"http://{listen}/ping") >= 0.060
    finally:
        links.close()
