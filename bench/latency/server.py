"""`skylb toxiproxy`: a TCP proxy that speaks Shopify Toxiproxy's HTTP API (v2) and injects latency and faults.

The real Toxiproxy (a Go binary) cannot run here, so this stand-in keeps its API: same paths, JSON shapes, status
codes and error bodies (Shopify/toxiproxy README "HTTP API", api.go), so the `toxiproxy-python` client and tests
written for the real server work unchanged, and the same tests run against a real Toxiproxy elsewhere.

    GET  /version                                  {"version": str}
    GET  /proxies                                  {name: proxy}
    POST /proxies                                  proxy fields -> 201 proxy; 409 duplicate name
    POST /populate                                 [proxy fields] -> 201 {"proxies": [proxy]} (create or replace)
    GET|POST|PATCH|DELETE /proxies/{proxy}         show | update listen/upstream/enabled | delete (204)
    GET|POST /proxies/{proxy}/toxics               list | create (200 toxic)
    GET|POST|PATCH|DELETE /proxies/{proxy}/toxics/{toxic}
    POST /reset                                    enable every proxy, remove every toxic (204)

A proxy is ``{"name", "listen": "host:port", "upstream": "host:port", "enabled": bool, "toxics": [toxic]}``;
``listen`` with port 0 picks a free port and the API shows the real one. Errors are
``{"error": str, "status": int}``: 400 bad input or unknown toxic type, 404 unknown proxy or toxic, 409 duplicate.
Toxic types and their semantics: bench/latency/toxics.py.

Data path (asyncio streams): each accepted connection dials the upstream and runs two links, ``upstream``
(client -> server) and ``downstream`` (server -> client). A link's reader stamps each chunk with its read time and
queues it; its writer passes chunks through the link's toxics in order and writes them, so a latency toxic delays
chunks in a pipeline instead of dividing throughput. Toxics added, updated or removed apply to open connections.
End of stream is passed on as a half-close; the connection is closed when both directions ended, or at once on an
error. Disabling or deleting a proxy closes its listener and drops its connections.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import struct
import sys
from typing import Any

import structlog
from aiohttp import web

from skylb import aio
from bench.latency.toxics import DOWNSTREAM, STREAMS, UPSTREAM, ApiError, Chunk, ToxicSpec, ToxicState, bad_request
from skylb import logs
from skylb.logs import configure_logging

__all__ = ["VERSION", "Proxy", "ProxyCollection", "build_app", "serve", "add_arguments", "main"]

#: The Toxiproxy API version this server follows, with our build tag.
VERSION = "2.12.0+skylb"
READ_BYTES = 32 * 1024  # one read; Toxiproxy's io.Copy uses 32 KiB buffers too
BUFFER_CHUNKS = 1024  # chunks queued per link before the reader stops reading (Toxiproxy's latency buffer size)
CONNECT_TIMEOUT_S = 10.0  # dialing the upstream
CLOSE_TIMEOUT_S = 2.0  # waiting for a socket to flush and close before aborting it

log = structlog.get_logger("skylb.toxiproxy")


# -- addresses -----------------------------------------------------------------------------------------------------

def split_hostport(addr: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``, ``":port"``) -> (host, port); ApiError 400 if malformed."""
    if not isinstance(addr, str):
        raise bad_request(f"{what} must be a string")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise bad_request(f"{what} {addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_hostport(host: str, port: int) -> str:
    """(host, port) -> ``"host:port"``, IPv6 hosts in brackets, as Go's net.JoinHostPort."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- data path -----------------------------------------------------------------------------------------------------

class Link:
    """One direction of one connection: reads ``src``, passes chunks through ``stream``'s toxics, writes ``dst``."""

    def __init__(self, conn: Connection, stream: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                 specs: list[ToxicSpec]):
        self.conn = conn
        self.stream = stream
        self.src = src
        self.dst = dst
        self.chain: list[ToxicState] = []
        self._buffer: asyncio.Queue[Chunk | None] = asyncio.Queue(maxsize=BUFFER_CHUNKS)
        for spec in specs:
            self.add(spec)

    def add(self, spec: ToxicSpec) -> None:
        """Append a toxic to this link's chain (if it is for this stream) and start it."""
        if spec.stream == self.stream:
            state = ToxicState(spec, self.conn)
            self.chain.append(state)
            state.start()

    def update(self, spec: ToxicSpec) -> None:
        """Restart the toxic after its attributes or toxicity changed."""
        for state in self.chain:
            if state.spec is spec:
                state.restart()

    def remove(self, spec: ToxicSpec) -> None:
        """Take the toxic out of the chain; whatever it holds goes on."""
        for state in [s for s in self.chain if s.spec is spec]:
            self.chain.remove(state)
            state.remove()

    def stop(self) -> None:
        """Cancel every toxic's timers (the connection is ending)."""
        for state in self.chain:
            state.stop()

    async def read_loop(self) -> None:
        """Read chunks until EOF (queued as None) or an error (drops the connection)."""
        loop = asyncio.get_running_loop()
        try:
            while data := await self.src.read(READ_BYTES):
                await self._buffer.put(Chunk(data, loop.time()))
        except OSError:  # includes ConnectionResetError
            self.conn.abort()
            return
        except Exception:  # a bug must not leave the connection half alive
            log.exception("link_failed", proxy=self.conn.proxy.name, stream=self.stream)
            self.conn.abort()
            return
        await self._buffer.put(None)

    async def write_loop(self) -> None:
        """Pass queued chunks through the toxics and write them; on EOF let the toxics see it, then half-close."""
        try:
            while True:
                chunk = await self._buffer.get()
                chain = list(self.chain)  # a toxic added now applies from the next chunk on
                if chunk is None:
                    for state in chain:
                        if state.holding:
                            await state.toxic.on_eof(state)
                    if self.dst.can_write_eof():
                        self.dst.write_eof()
                    self.conn.link_finished()
                    return
                await self._through(chunk, chain, 0)
        except OSError:
            self.conn.abort()
        except Exception:  # a bug in a toxic must not leave the connection half alive
            log.exception("link_failed", proxy=self.conn.proxy.name, stream=self.stream)
            self.conn.abort()

    async def _through(self, chunk: Chunk, chain: list[ToxicState], i: int) -> None:
        while i < len(chain) and not chain[i].holding:
            i += 1
        if i == len(chain):
            self.dst.write(chunk.data)
            await self.dst.drain()
            return
        state = chain[i]
        await state.toxic.process(chunk, state, lambda c: self._through(c, chain, i + 1))


class Connection:
    """One accepted client connection and its upstream connection; ends in exactly one way (see ``run``)."""

    def __init__(self, proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.proxy = proxy
        self.task: asyncio.Task | None = None
        self.links: dict[str, Link] = {}
        self._client = (reader, writer)
        self._writers: list[asyncio.StreamWriter] = [writer]
        self._tasks: list[asyncio.Future] = []
        self._finished_links = 0
        # How the connection ends: "normal" (both directions ended), "close" (FIN), "abort", "reset" (RST).
        self._end: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def close(self) -> None:
        """End the connection gracefully: both sockets flush what was written, then close (FIN)."""
        self._finish("close")

    def abort(self) -> None:
        """Drop the connection at once (proxy disabled or deleted, or an I/O error)."""
        self._finish("abort")

    def reset(self) -> None:
        """Reset both sockets with TCP RST (SO_LINGER 0), as Toxiproxy's reset_peer."""
        self._finish("reset")

    def link_finished(self) -> None:
        """A direction passed its EOF on; when both have, the connection ends normally."""
        self._finished_links += 1
        if self._finished_links == len(STREAMS):
            self._finish("normal")

    def _finish(self, mode: str) -> None:
        if not self._end.done():
            self._end.set_result(mode)

    async def run(self) -> None:
        """Dial the upstream, pump both directions until the connection ends, then cancel tasks and close sockets."""
        host, port = split_hostport(self.proxy.upstream, "upstream")
        dial = asyncio.ensure_future(asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S))
        self._tasks.append(dial)
        try:
            await asyncio.wait([dial, self._end], return_when=asyncio.FIRST_COMPLETED)
            if self._end.done():
                return
            try:
                up_reader, up_writer = dial.result()
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("upstream_unreachable", proxy=self.proxy.name, upstream=self.proxy.upstream,
                            error=repr(exc))
                self.close()
                return
            self._writers.append(up_writer)
            client_reader, client_writer = self._client
            specs = list(self.proxy.toxics.values())
            self.links = {UPSTREAM: Link(self, UPSTREAM, client_reader, up_writer, specs),
                          DOWNSTREAM: Link(self, DOWNSTREAM, up_reader, client_writer, specs)}
            for link in self.links.values():
                self._tasks.append(asyncio.create_task(link.read_loop()))
                self._tasks.append(asyncio.create_task(link.write_loop()))
            await self._end
        finally:
            mode = self._end.result() if self._end.done() else "abort"
            self._finish(mode)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if dial.done() and not dial.cancelled() and dial.exception() is None:
                up_writer = dial.result()[1]
                if up_writer not in self._writers:  # dialed just as the connection was dropped
                    self._writers.append(up_writer)
            for link in self.links.values():
                link.stop()
            await self._close_sockets(mode)

    async def _close_sockets(self, mode: str) -> None:
        for writer in self._writers:
            if mode == "reset":
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass
            if mode in ("reset", "abort"):
                writer.transport.abort()
            else:
                writer.close()
        for writer in self._writers:
            try:
                await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:  # the peer does not read what is left to flush
                writer.transport.abort()
            except OSError:
                pass


class Proxy:
    """One named proxy: a listener on ``listen`` forwarding to ``upstream``, its toxics and open connections."""

    def __init__(self, name: str, listen: str, upstream: str):
        self.name = name
        self.listen = listen
        self.upstream = upstream
        self.enabled = False
        self.toxics: dict[str, ToxicSpec] = {}  # by name, in the order added
        self._server: asyncio.Server | None = None
        self._conns: set[Connection] = set()

    def to_json(self) -> dict[str, Any]:
        """``{"name", "listen", "upstream", "enabled", "toxics"}`` as Toxiproxy's proxyWithToxics."""
        return {"name": self.name, "listen": self.listen, "upstream": self.upstream, "enabled": self.enabled,
                "toxics": self.toxic_list()}

    def toxic_list(self) -> list[dict[str, Any]]:
        """Toxics as JSON, upstream ones first, each stream in the order added (as Toxiproxy lists them)."""
        return [spec.to_json() for stream in STREAMS for spec in self.toxics.values() if spec.stream == stream]

    async def start(self) -> None:
        """Listen on ``listen`` (port 0: a free port, then shown in ``listen``); ApiError 500 if binding fails."""
        if self.enabled:
            return
        host, port = split_hostport(self.listen, "listen")
        loop = asyncio.get_running_loop()
        try:
            # Bind one socket ourselves: start_server("localhost", 0) could bind IPv4 and IPv6 on different ports.
            infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.setblocking(False)
                self._server = await asyncio.start_server(self._accept, sock=sock)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise ApiError(f"listen tcp {self.listen}: {exc.strerror or exc}", 500) from exc
        bound = sock.getsockname()
        self.listen = join_hostport(bound[0], bound[1])
        self.enabled = True
        log.info("proxy_started", proxy=self.name, listen=self.listen, upstream=self.upstream)

    async def stop(self) -> None:
        """Close the listener and drop every open connection; returns once they are all closed."""
        if not self.enabled:
            return
        self.enabled = False
        server, self._server = self._server, None
        if server is not None:
            server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        await asyncio.gather(*(c.task for c in conns if c.task is not None), return_exceptions=True)
        if server is not None:
            try:
                await asyncio.wait_for(server.wait_closed(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        log.info("proxy_stopped", proxy=self.name, listen=self.listen, dropped_connections=len(conns))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.enabled:  # accepted just before the listener closed
            writer.transport.abort()
            return
        conn = Connection(self, reader, writer)
        conn.task = asyncio.current_task()
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)

    def add_toxic(self, spec: ToxicSpec) -> None:
        """Add a toxic; it applies to open connections too. ApiError 409 if the name is taken."""
        if spec.name in self.toxics:
            raise ApiError("toxic already exists", 409)
        self.toxics[spec.name] = spec
        for conn in self._conns:
            for link in conn.links.values():
                link.add(spec)

    def get_toxic(self, name: str) -> ToxicSpec:
        """The toxic called ``name``; ApiError 404 if none."""
        spec = self.toxics.get(name)
        if spec is None:
            raise ApiError("toxic not found", 404)
        return spec

    def update_toxic(self, name: str, body: Any) -> ToxicSpec:
        """Change a toxic's attributes and/or toxicity (fields left out keep their values); applies to open links."""
        spec = self.get_toxic(name)
        spec.toxic, spec.toxicity = spec.parse_update(body)
        for conn in self._conns:
            for link in conn.links.values():
                link.update(spec)
        return spec

    def remove_toxic(self, name: str) -> None:
        """Remove a toxic from the proxy and from every open connection."""
        spec = self.get_toxic(name)
        del self.toxics[name]
        for conn in self._conns:
            for link in conn.links.values():
                link.remove(spec)


# -- the proxy collection and its HTTP API ---------------------------------------------------------------------------

def _proxy_fields(body: Any, *, where: str = "") -> tuple[str, str, str, bool]:
    """(name, listen, upstream, enabled) of a proxy create request; ApiError 400 when invalid."""
    if not isinstance(body, dict):
        raise bad_request("expected a JSON object")
    fields = []
    for key in ("name", "upstream"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise ApiError(f"missing required field: {key}{where}", 400)
        fields.append(value)
    name, upstream = fields
    listen = body.get("listen") or ""
    enabled = body.get("enabled", True)
    if not isinstance(enabled, bool):
        raise bad_request("enabled must be true or false")
    split_hostport(listen or ":0", "listen")
    split_hostport(upstream, "upstream")
    return name, listen or ":0", upstream, enabled


class ProxyCollection:
    """Every proxy of this server by name; API mutations are serialized by one lock (Toxiproxy's collection lock)."""

    def __init__(self) -> None:
        self.proxies: dict[str, Proxy] = {}
        self.lock = asyncio.Lock()

    def get(self, name: str) -> Proxy:
        """The proxy called ``name``; ApiError 404 if none."""
        proxy = self.proxies.get(name)
        if proxy is None:
            raise ApiError("proxy not found", 404)
        return proxy

    async def create(self, body: Any) -> Proxy:
        """Create (and, unless ``enabled`` is false, start) a proxy; 409 if the name exists."""
        name, listen, upstream, enabled = _proxy_fields(body)
        async with self.lock:
            if name in self.proxies:
                raise ApiError("proxy already exists", 409)
            proxy = Proxy(name, listen, upstream)
            if enabled:
                await proxy.start()
            self.proxies[name] = proxy
            return proxy

    async def populate(self, body: Any) -> list[Proxy]:
        """Create or replace a list of proxies; one with the same listen and upstream is left untouched."""
        if not isinstance(body, list):
            raise bad_request("expected a JSON array of proxies")
        wanted = [_proxy_fields(item, where=f" at proxy {i + 1}") for i, item in enumerate(body)]
        names = [w[0] for w in wanted]
        if len(set(names)) != len(names):
            raise bad_request("duplicate proxy name")
        result = []
        async with self.lock:
            for name, listen, upstream, enabled in wanted:
                existing = self.proxies.get(name)
                if existing is not None and existing.listen == listen and existing.upstream == upstream:
                    result.append(existing)
                    continue
                if existing is not None:
                    await existing.stop()
                    del self.proxies[name]
                proxy = Proxy(name, listen, upstream)
                if enabled:
                    await proxy.start()
                self.proxies[name] = proxy
                result.append(proxy)
        return result

    async def update(self, name: str, body: Any) -> Proxy:
        """Change ``listen``/``upstream`` (restarts the proxy, dropping connections) and/or ``enabled``."""
        async with self.lock:
            proxy = self.get(name)
            if not isinstance(body, dict):
                raise bad_request("expected a JSON object")
            listen = body.get("listen", proxy.listen)
            upstream = body.get("upstream", proxy.upstream)
            enabled = body.get("enabled", proxy.enabled)
            split_hostport(listen, "listen")
            split_hostport(upstream, "upstream")
            if not isinstance(enabled, bool):
                raise bad_request("enabled must be true or false")
            if listen != proxy.listen or upstream != proxy.upstream:
                await proxy.stop()
                proxy.listen, proxy.upstream = listen, upstream
            if enabled and not proxy.enabled:
                await proxy.start()
            elif not enabled:
                await proxy.stop()
            return proxy

    async def delete(self, name: str) -> None:
        """Stop and forget a proxy; its port is free when this returns."""
        async with self.lock:
            proxy = self.get(name)
            await proxy.stop()
            del self.proxies[name]
            log.info("proxy_deleted", proxy=name)

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic (Toxiproxy's POST /reset)."""
        async with self.lock:
            for proxy in self.proxies.values():
                await proxy.start()
                for toxic_name in list(proxy.toxics):
                    proxy.remove_toxic(toxic_name)

    async def stop_all(self) -> None:
        """Stop every proxy (server shutdown)."""
        async with self.lock:
            for proxy in self.proxies.values():
                await proxy.stop()


COLLECTION = web.AppKey("collection", ProxyCollection)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


@web.middleware
async def _api_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.to_json(), status=exc.status)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def _proxy_index(request: web.Request) -> web.Response:
    proxies = request.app[COLLECTION].proxies
    return web.json_response({name: proxy.to_json() for name, proxy in proxies.items()})


async def _proxy_create(request: web.Request) -> web.Response:
    proxy = await request.app[COLLECTION].create(await _json_body(request))
    return web.json_response(proxy.to_json(), status=201)


async def _populate(request: web.Request) -> web.Response:
    proxies = await request.app[COLLECTION].populate(await _json_body(request))
    return web.json_response({"proxies": [p.to_json() for p in proxies]}, status=201)


async def _proxy_show(request: web.Request) -> web.Response:
    return web.json_response(request.app[COLLECTION].get(request.match_info["proxy"]).to_json())


async def _proxy_update(request: web.Request) -> web.Response:
    collection = request.app[COLLECTION]
    collection.get(request.match_info["proxy"])  # 404 before parsing the body, as Toxiproxy
    proxy = await collection.update(request.match_info["proxy"], await _json_body(request))
    return web.json_response(proxy.to_json())


async def _proxy_delete(request: web.Request) -> web.Response:
    await request.app[COLLECTION].delete(request.match_info["proxy"])
    return web.Response(status=204)


async def _toxic_index(request: web.Request) -> web.Response:
    return web.json_response(request.app[COLLECTION].get(request.match_info["proxy"]).toxic_list())


async def _toxic_create(request: web.Request) -> web.Response:
    collection = request.app[COLLECTION]
    collection.get(request.match_info["proxy"])  # 404 before parsing the body, as Toxiproxy
    spec = ToxicSpec.from_json(await _json_body(request))
    async with collection.lock:  # the proxy may have been replaced while the body was read
        collection.get(request.match_info["proxy"]).add_toxic(spec)
    return web.json_response(spec.to_json())


async def _toxic_show(request: web.Request) -> web.Response:
    proxy = request.app[COLLECTION].get(request.match_info["proxy"])
    return web.json_response(proxy.get_toxic(request.match_info["toxic"]).to_json())


async def _toxic_update(request: web.Request) -> web.Response:
    collection = request.app[COLLECTION]
    collection.get(request.match_info["proxy"]).get_toxic(request.match_info["toxic"])
    body = await _json_body(request)
    async with collection.lock:
        spec = collection.get(request.match_info["proxy"]).update_toxic(request.match_info["toxic"], body)
    return web.json_response(spec.to_json())


async def _toxic_delete(request: web.Request) -> web.Response:
    collection = request.app[COLLECTION]
    async with collection.lock:
        collection.get(request.match_info["proxy"]).remove_toxic(request.match_info["toxic"])
    return web.Response(status=204)


async def _reset(request: web.Request) -> web.Response:
    await request.app[COLLECTION].reset()
    return web.Response(status=204)


def build_app(collection: ProxyCollection | None = None) -> web.Application:
    """The aiohttp application serving Toxiproxy's HTTP API over ``collection`` (a new one if None)."""
    app = web.Application(middlewares=[_api_errors])
    app[COLLECTION] = collection if collection is not None else ProxyCollection()
    app.router.add_get("/version", _version)
    app.router.add_post("/reset", _reset)
    app.router.add_get("/proxies", _proxy_index)
    app.router.add_post("/proxies", _proxy_create)
    app.router.add_post("/populate", _populate)
    app.router.add_get("/proxies/{proxy}", _proxy_show)
    app.router.add_post("/proxies/{proxy}", _proxy_update)
    app.router.add_patch("/proxies/{proxy}", _proxy_update)
    app.router.add_delete("/proxies/{proxy}", _proxy_delete)
    app.router.add_get("/proxies/{proxy}/toxics", _toxic_index)
    app.router.add_post("/proxies/{proxy}/toxics", _toxic_create)
    app.router.add_get("/proxies/{proxy}/toxics/{toxic}", _toxic_show)
    app.router.add_post("/proxies/{proxy}/toxics/{toxic}", _toxic_update)
    app.router.add_patch("/proxies/{proxy}/toxics/{toxic}", _toxic_update)
    app.router.add_delete("/proxies/{proxy}/toxics/{toxic}", _toxic_delete)

    async def _stop_proxies(app: web.Application) -> None:
        await app[COLLECTION].stop_all()

    app.on_shutdown.append(_stop_proxies)
    return app


async def serve(host: str = "127.0.0.1", port: int = 8474) -> None:
    """Serve the API on ``host:port`` until SIGTERM or SIGINT, then stop every proxy and return."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]  # the real port when --port 0
        log.info("toxiproxy_started", api=f"http://{join_hostport(bound_host, bound_port)}", version=VERSION)
        await stop.wait()
        log.info("toxiproxy_stopping")
    finally:
        await runner.cleanup()  # runs on_shutdown: every proxy stopped, connections dropped
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `skylb toxiproxy`: where the HTTP API listens (Toxiproxy's default port is 8474)."""
    parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP API (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8474, help="port of the HTTP API (default: %(default)s)")
    logs.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean stop, 1 if the API port cannot be bound."""
    try:
        configure_logging(level=args.log_level)
    except ValueError as exc:  # $SKYLB_LOG_LEVEL names no level
        print(f"skylb toxiproxy: {exc}", file=sys.stderr)
        return 2
    try:
        aio.run(serve(args.host, args.port), precise_timers=True)  # injected delays must never be short
    except OSError as exc:
        log.error("toxiproxy_failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":  # `python -m bench.latency.server`, without the other subcommands' imports
    _parser = argparse.ArgumentParser(prog="skylb toxiproxy", description=__doc__.strip().splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
