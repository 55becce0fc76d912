"""Test-side name for the process helpers (they live in bench.launch.procs, shared with `skylb local`), and a check that
nothing outlives them."""

import contextlib
import json
import socket
import time
from pathlib import Path

from bench.launch.procs import Proc, ProcGroup, free_port, free_ports, wait_http

__all__ = ["Proc", "ProcGroup", "free_port", "free_ports", "wait_http", "alive_in_groups", "wait_for", "log_events",
           "saturated"]


def alive_in_groups(pgids: set[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of ``pgids``: each process a ProcGroup starts leads its own
    group, so this finds it and anything it started. Read from /proc/PID/stat (proc(5): state and pgrp fields)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited while we looked
            if fields[0] != "Z" and int(fields[2]) in pgids:
                alive.append(int(entry.name))
    return alive


def wait_for(predicate, what: str, timeout_s: float = 15.0):
    """Poll ``predicate()`` every 50 ms until it returns a truthy value, and return that value; AssertionError
    naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def log_events(log: str, event: str) -> list[dict]:
    """The JSON log lines of ``log`` (a process's output, one JSON object per line) whose ``event`` is ``event``;
    lines that are not JSON objects are passed over."""
    found = []
    for line in log.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("event") == event:
            found.append(value)
    return found


@contextlib.contextmanager
def saturated(replica_url: str, model: str, n: int, max_tokens: int):
    """Hold n long streamed completions open straight on a replica (not through a balancer), over raw sockets.

    Closing the sockets at the end makes llama-server cancel those requests at once; an unfinished request
    would otherwise hold up its shutdown (on SIGTERM it waits for its in-flight HTTP requests).
    """
    host, port = replica_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": "Tell a long story.", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(n):
            sock = socket.create_connection((host, int(port)), timeout=10)
            socks.append(sock)
            sock.sendall(head + body)
        yield
    finally:
        for sock in socks:
            sock.close()
