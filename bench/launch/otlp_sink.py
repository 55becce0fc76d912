"""An OTLP/HTTP trace receiver on loopback, for tests and benchmarks: it decodes what balancers export and keeps the
spans.

It speaks the collector's side of OTLP/HTTP with protobuf bodies (OTLP specification, "OTLP/HTTP"): ``POST
/v1/traces`` with an ``ExportTraceServiceRequest`` (opentelemetry-proto's generated classes), gzip or not, answered
200 with an empty ``ExportTraceServiceResponse``. Each span is kept as a :class:`ReceivedSpan`. It runs in a thread
of the calling process (``with OtlpSink() as sink: ... sink.url``), so a test reads the spans directly; ``GET`` on any
path answers how many arrived. ``python -m bench.launch.otlp_sink --port N`` runs one as a process of its own (a benchmark's
receiver, off the measuring client's CPU), until SIGTERM.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpSink", "ReceivedSpan", "KINDS"]

#: OTLP's span kinds by number (opentelemetry-proto trace.proto, ``Span.SpanKind``).
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass
class ReceivedSpan:
    """One exported span: ids as lowercase hex (``parent_span_id`` "" for a root), ``kind`` a name of KINDS,
    ``attributes`` and ``resource`` (its resource's attributes) as plain Python values, times in ns since the epoch,
    ``status_code`` 0 unset, 1 ok, 2 error."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status_code: int
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if which is None else getattr(v, which)


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` body (protobuf). Raises google.protobuf's DecodeError."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    name=s.name, kind=KINDS.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, status_code=s.status.code,
                    attributes={kv.key: _value(kv.value) for kv in s.attributes}, resource=resource))
    return spans


class OtlpSink:
    """The receiver: ``start()`` (or ``with``) listens on ``host`` at a free port; ``url`` is its base URL (what
    ``balancer.tracing.otlp_endpoint`` or $OTEL_EXPORTER_OTLP_ENDPOINT take); ``spans()`` what arrived so far;
    ``requests`` counts the export calls, ``rejected`` those whose body did not decode (answered 400)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0
        self.rejected = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        assert self._server is not None, "OtlpSink not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> "OtlpSink":
        """Listen and serve in a daemon thread; returns self."""
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                status, reply = sink._receive(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self):  # noqa: N802: how many spans arrived, {"spans": n, "requests": n, "rejected": n}
                reply = json.dumps({"spans": len(sink.spans()), "requests": sink.requests,
                                    "rejected": sink.rejected}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet: a test's output is not the place for access lines
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()
        return self

    def _receive(self, path: str, body: bytes) -> tuple[int, bytes]:
        if path.rstrip("/") != "/v1/traces":
            return 404, b""
        try:
            spans = decode(body)
        except Exception:  # google.protobuf.message.DecodeError and kin: the sender's fault, counted
            with self._lock:
                self.requests += 1
                self.rejected += 1
            return 400, b""
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)
        return 200, ExportTraceServiceResponse().SerializeToString()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], Any], *, timeout_s: float = 10.0,
                 what: str = "spans") -> Any:
        """Poll ``predicate(spans())`` every 50 ms until it returns a truthy value, which is returned; raise
        AssertionError after ``timeout_s`` s."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate(self.spans())
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; received "
                                     f"{[(s.name, s.resource.get('skylb.region')) for s in self.spans()]}")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "OtlpSink":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """Serve on ``--host``/``--port`` until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(prog="python -m bench.launch.otlp_sink", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with OtlpSink(args.host, args.port):
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
