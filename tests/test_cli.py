"""The `skylb` and `skylb-ctl` commands: help for every subcommand, clear usage errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skylb.cli import SUBCOMMANDS


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skylb", *args], capture_output=True, text=True, timeout=60)


def test_top_level_help_lists_every_subcommand():
    """`skylb --help` names every subcommand."""
    out = _run("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_help(name):
    """`skylb NAME --help` explains the subcommand and exits 0."""
    out = _run(name, "--help")
    assert out.returncode == 0 and "usage:" in out.stdout


def test_unknown_option_is_a_usage_error():
    """An unknown option fails with exit status 2 and names the option."""
    out = _run("balancer", "--region", "us", "--no-such-flag")
    assert out.returncode == 2 and "--no-such-flag" in out.stderr


def test_a_mistyped_option_or_subcommand_gets_its_usage_and_the_close_match():
    """`skylb balancer --replicas URL` exits 2 with the balancer's own usage and "did you mean --replica?";
    `skylb balancr` suggests balancer; an invalid choice suggests the close one, in skylb-ctl too."""
    out = _run("balancer", "--replicas", "http://127.0.0.1:1")
    assert out.returncode == 2 and "usage: skylb balancer" in out.stderr
    assert "unrecognized arguments: --replicas http://127.0.0.1:1 (did you mean --replica?)" in out.stderr
    out = _run("balancr", "--replica", "http://127.0.0.1:1")
    assert out.returncode == 2 and "(did you mean balancer?)" in out.stderr
    out = _run("balancer", "--replica", "http://127.0.0.1:1", "--engine", "vlm")
    assert out.returncode == 2 and "(did you mean vllm?)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "controller.ctl", "replica", "ad"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "usage: skylb-ctl replica" in out.stderr and "(did you mean add?)" in out.stderr


def test_a_balancer_without_config_runs_on_the_defaults_not_the_demo_file(monkeypatch):
    """`skylb balancer --region us` with no --config and no peer token: the built-in defaults and the default
    controller address, not the demo's three regions (which would want a peer token for peers asia and eu)."""
    from skylb.balancer.reload import resolve
    from skylb.cli import build_parser
    from skylb.config import BalancerConfig

    for name in ("SKYLB_PEER_TOKEN", "SKYLB_API_KEYS", "SKYLB_API_KEYS_FILE", "SKYLB_METRICS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    settings = resolve(build_parser("balancer").parse_args(["balancer", "--region", "us"]))
    assert settings.region == "us" and settings.static_membership is None
    assert settings.cfg.controller_url == "http://127.0.0.1:8470"
    assert settings.cfg.model_copy(update={"controller_url": None}) == BalancerConfig()


def test_live_benchmarks_receive_their_options_in_order():
    """`skylb bench overhead ARGS` hands ARGS to `python -m bench.live.overhead` unchanged."""
    out = _run("bench", "overhead", "--help")
    assert out.returncode == 0 and "--parts" in out.stdout


def test_bad_config_is_a_clear_error(tmp_path):
    """A config with an unknown key fails with the key named, not a traceback."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("balancer:\n  polcy: skylb\n")
    out = _run("balancer", "--config", str(cfg), "--region", "us")
    assert out.returncode == 2 and "polcy" in out.stderr and "Traceback" not in out.stderr


def test_ctl_help():
    """`skylb-ctl --help` explains the operator commands."""
    out = subprocess.run([sys.executable, "-m", "controller.ctl", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "replica" in out.stdout


def test_a_harness_subcommand_missing_from_an_install_says_so(monkeypatch, capsys):
    """A plugin subcommand whose module is not installed (a wheel without the checkout's bench/) is listed in
    --help as not installed, and running it exits 2 with a message saying where it lives, not a traceback."""
    from skylb import cli

    real = cli.subcommands
    monkeypatch.setattr(cli, "subcommands", lambda: {**real(), "ghost": "nosuchharness.server"})
    assert cli.main(["ghost", "--port", "1"]) == 2
    assert "`skylb ghost` is part of the test and benchmark harness" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert "ghost" in capsys.readouterr().out


def test_a_balancer_that_cannot_listen_says_where_and_why():
    """A port already taken, or a host that is not this machine's: exit status 1 with the address and the reason,
    not a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run("balancer", "--replica", "http://127.0.0.1:1", "--port", str(port))
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-500:]
    assert "Traceback" not in out.stderr
    out = _run("balancer", "--replica", "http://127.0.0.1:1", "--host", "host.invalid")
    assert out.returncode == 1 and "cannot listen on host.invalid" in out.stderr and "Traceback" not in out.stderr
