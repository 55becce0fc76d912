"""Test-side name for the process helpers (they live in bench.procs, shared with `skylb local`)."""

from bench.procs import Proc, ProcGroup, free_port, free_ports, wait_http

__all__ = ["Proc", "ProcGroup", "free_port", "free_ports", "wait_http"]
