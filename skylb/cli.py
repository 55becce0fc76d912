"""The `skylb` command: one subcommand per process kind.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported only when their subcommand runs, so `skylb --help` stays fast. The product's own subcommands
(balancer, controller) are listed here. The test and benchmark harness (emulator, latency proxy, the local
multi-region runner, replay, benchmarks) lives in bench/, outside the product: it adds its subcommands as plugins,
Python entry points in the ``skylb.commands`` group (pyproject.toml), so the product never names it. An installed
wheel has no bench/: those subcommands then say to run them from a checkout.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import re
import sys

__all__ = ["main", "SUBCOMMANDS", "PLUGIN_GROUP", "subcommands", "SuggestingParser", "close_match"]

#: The product's subcommands: name -> (module, one-line help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "balancer": ("skylb.balancer.process", "run one region's balancer (OpenAI API in front of local replicas)"),
    "controller": ("controller.server", "run the membership controller (SQLite store, REST API)"),
}

#: The entry-point group whose entries add subcommands: ``name = "module"``; the help line is the module's first
#: docstring line.
PLUGIN_GROUP = "skylb.commands"


class HarnessMissing(Exception):
    """A plugin subcommand's module cannot be imported (an installed wheel without the checkout's bench/)."""


def subcommands() -> dict[str, str]:
    """Every subcommand: name -> module, the product's first, then the plugins' in name order."""
    found = {name: module for name, (module, _) in SUBCOMMANDS.items()}
    for entry in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        found.setdefault(entry.name, entry.value)
    return found


def _load(name: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if name in SUBCOMMANDS or not (exc.name or "").split(".")[0] == module_name.split(".")[0]:
            raise
        raise HarnessMissing(f"`skylb {name}` is part of the test and benchmark harness ({module_name}), which is "
                             "not installed: run it from a checkout of the SkyLB repository after `make install`"
                             ) from exc


def _help(name: str, module_name: str) -> str:
    if name in SUBCOMMANDS:
        return SUBCOMMANDS[name][1]
    return f"(harness, {module_name})"


def close_match(message: str, parser: argparse.ArgumentParser) -> str:
    """A hint for argparse's error ``message`` of ``parser``: " (did you mean --replica?)" for an unknown option or
    an invalid choice close to a known one (difflib), "" when nothing is close or the error is of another kind."""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice:
        words, known = [choice.group(1)], re.findall(r"'([^']*)'", choice.group(2))
    elif message.startswith("unrecognized arguments: "):
        words = [w.split("=", 1)[0] for w in message.split(": ", 1)[1].split() if w.startswith("--")]
        known = [o for o in parser._option_string_actions if o.startswith("--")]  # argparse has no public list
    else:
        return ""
    hints = [m[0] for w in words if (m := difflib.get_close_matches(w, known, n=1))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors suggest the closest option or subcommand (Python 3.14's
    ``suggest_on_error``, which 3.11 lacks)."""

    def error(self, message: str):
        super().error(message + close_match(message, self))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; with ``only``, import and describe just that subcommand (fast start)."""
    parser = SuggestingParser(
        prog="skylb",
        description="SkyLB: a cross-region load balancer for LLM inference. One balancer per region; "
        "requests go to a local replica with room, else to a peer region with room, else wait in the queue.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in subcommands().items():
        help_text = _help(name, module_name)
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = _load(name, module_name)
        except HarnessMissing:
            if only == name:
                raise
            sub.add_parser(name, help="(not installed: part of the harness in a checkout's bench/)")
            continue
        first_line = (module.__doc__ or help_text).strip().splitlines()[0]
        p = sub.add_parser(name, help=help_text if name in SUBCOMMANDS else first_line, description=first_line)
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `skylb` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(chosen if chosen in subcommands() else None)
    except HarnessMissing as exc:
        print(f"skylb: {exc}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # only subcommands that hand their options to another program take unknown ones
        if not getattr(args, "passes_options", False):  # the subcommand's own usage, not the top level's
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.rest = [*getattr(args, "rest", []), *extra]
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
