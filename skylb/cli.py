"""The `skylb` command: one subcommand per process kind.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported only when their subcommand runs, so `skylb --help` stays fast. The product never imports
bench/: the demo and benchmark subcommands (local, replay, bench) are named here as module strings only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "balancer": ("skylb.balancer.process", "run one region's balancer (OpenAI API in front of local replicas)"),
    "controller": ("controller.server", "run the membership controller (SQLite store, REST API)"),
    "emulator": ("skylb.emulator.server", "run emulated inference replicas (vLLM, SGLang, llama.cpp, TGI or Ollama dialect) on one or more ports"),
    "toxiproxy": ("skylb.latency.server", "run the Toxiproxy-API-compatible latency proxy"),
    "local": ("bench.demo", "run a whole multi-region deployment on this machine and replay a workload"),
    "replay": ("bench.replay", "replay a workload (Mooncake trace or synthetic) against running balancers"),
    "bench": ("bench.bench_cli", "run benchmarks: the simulated SkyLB evaluation (sim, all)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; with ``only``, import and describe just that subcommand (fast start)."""
    parser = argparse.ArgumentParser(
        prog="skylb",
        description="SkyLB: a cross-region load balancer for LLM inference. One balancer per region; "
        "requests go to a local replica with room, else to a peer region with room, else wait in the queue.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `skylb` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:  # only subcommands that hand their options to another program take unknown ones
        if not getattr(args, "passes_options", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.rest = [*getattr(args, "rest", []), *extra]
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
