"""The deployment files (deploy/systemd, deploy/k8s) against the real command lines, config schema and tools.

systemd units: parsed (sections, continuation lines, Environment=, EnvironmentFile=, specifiers, $VAR and ${VAR}
as systemd expands them); every ExecStart parses with the real argument parsers (skylb's, skylb-ctl's) and names
only flags that exist; the example config loads with skylb.config.load_config; the controller and balancer command
lines start real processes on that config; the llama-server command line is skylb.llamacpp's and every flag is in
the built llama-server's --help. `systemd-analyze verify` / `security --offline` and `systemd-sysusers --root` run
when systemd's tools are installed (no running systemd is needed); they are not one of the components `make test`
installs, so without them those tests skip, under CI too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from aiohttp import web

from skylb import llamacpp
from skylb.cli import SUBCOMMANDS, build_parser
from skylb.config import DeploymentConfig, load_config
from tests.procs import free_ports

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
#: Where the units expect things on a host (deploy/systemd/README.md).
SKYLB_BIN = "/opt/skylb/bin/skylb"
LLAMA_BIN = "/usr/local/bin/llama-server"
CONFIG_PATH = "/etc/skylb/skylb.yaml"
#: A sample instance name per template unit.
INSTANCES = {"skylb-balancer@.service": "us", "llama-server@.service": "8081"}


# --- a small systemd unit reader ----------------------------------------------------------------------------------

def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file, each a list of (key, value) in order (keys may repeat, as in systemd).

    Comments (# or ;) and blank lines are skipped; a line ending in a backslash continues on the next one.
    """
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    logical, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: continuation at the end of the file"
    for line in logical:
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: dict, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}: expected one value, got {found}"
    return found[0]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile (comments and blank lines skipped, one level of quotes removed)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, val = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}: bad line {line!r}"
        env[key] = shlex.split(val)[0] if val.strip() else ""
    return env


def unit_environment(unit: dict) -> dict[str, str]:
    """Variables set by the unit's Environment= lines (later ones win, as in systemd)."""
    env = {}
    for assignments in values(unit, "Service", "Environment"):
        for item in shlex.split(assignments):
            key, sep, val = item.partition("=")
            assert sep, f"Environment= item {item!r} is not KEY=VALUE"
            env[key] = val
    return env


def expand_specifiers(text: str, instance: str | None) -> str:
    def one(m: re.Match) -> str:
        spec = m.group(1)
        if spec == "%":
            return "%"
        if spec in "iI" and instance is not None:
            return instance
        raise AssertionError(f"specifier %{spec} not handled (instance {instance!r})")
    return re.sub(r"%(.)", one, text)


def exec_argv(command: str, env: dict[str, str], instance: str | None) -> list[str]:
    """An ExecStart= line as systemd runs it: words split with shell-like quoting, %i and %% replaced, ``${VAR}``
    replaced inside a word, and a word that is exactly ``$VAR`` split at whitespace into zero or more words.

    Raises AssertionError for a variable that is not set (a typo would silently become an empty argument).
    """
    def var(name: str) -> str:
        assert name in env, f"ExecStart uses ${name}, which the unit does not set"
        return env[name]

    argv = []
    for word in shlex.split(command):
        word = expand_specifiers(word, instance)
        if m := re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word):
            argv += var(m.group(1)).split()
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: var(m.group(1)), word))
    return argv


def unit_argv(path: Path, env_files: dict[str, dict[str, str]] | None = None) -> tuple[list[str], dict[str, str]]:
    """The ExecStart argv of the unit at ``path`` (with its sample instance) and the environment it runs with:
    Environment= then the EnvironmentFile= files found in ``env_files`` (by path; optional ones may be missing)."""
    unit = parse_unit(path)
    instance = INSTANCES.get(path.name)
    env = unit_environment(unit)
    for ref in values(unit, "Service", "EnvironmentFile"):
        optional = ref.startswith("-")
        ref = expand_specifiers(ref.lstrip("-"), instance)
        if ref in (env_files or {}):
            env.update(env_files[ref])
        else:
            assert optional, f"{path.name}: EnvironmentFile {ref} is required and not provided"
    return exec_argv(value(unit, "Service", "ExecStart"), env, instance), env


def parse_with(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` that fails the test with argparse's message instead of exiting."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{shlex.join(argv)}: {err.getvalue().strip()}")


def skylb_args(argv: list[str]) -> argparse.Namespace:
    """Parse a `skylb SUBCOMMAND ...` argv with the real `skylb` parser (every unknown flag is an error), and check
    that each flag is spelt out in full (argparse would also accept an unambiguous abbreviation)."""
    assert argv and argv[0] in (SKYLB_BIN, "skylb"), argv
    args = parse_with(build_parser(argv[1]), argv[1:])
    exact = argparse.ArgumentParser(allow_abbrev=False)
    importlib.import_module(SUBCOMMANDS[argv[1]][0]).add_arguments(exact)
    for arg in argv[2:]:
        if arg.startswith("-"):
            assert arg.partition("=")[0] in exact._option_string_actions, f"{arg}: not a flag of skylb {argv[1]}"
    return args


# --- systemd ------------------------------------------------------------------------------------------------------

def test_the_units_and_files_are_all_there():
    assert {u.name for u in UNITS} == {"skylb-controller.service", "skylb-balancer@.service",
                                      "llama-server@.service"}
    for name in ("skylb.yaml", "peer-token.env", "llama-server.env", "skylb.sysusers.conf", "README.md"):
        assert (SYSTEMD / name).is_file(), name


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_structure_and_hardening(path):
    """Each unit: Unit/Service/Install sections, a single ExecStart, restart on failure, a stop timeout, an open-files
    limit, the `skylb` user with StateDirectory=skylb, and the sandbox."""
    unit = parse_unit(path)
    assert set(unit) == {"Unit", "Service", "Install"}
    assert value(unit, "Unit", "Description")
    assert "network-online.target" in value(unit, "Unit", "After").split()
    assert value(unit, "Install", "WantedBy") == "multi-user.target"
    service = dict(unit["Service"])  # single-valued keys
    assert len(values(unit, "Service", "ExecStart")) == 1
    assert service["Type"] == "exec"
    assert service["Restart"] == "on-failure"
    assert (service["User"], service["Group"]) == ("skylb", "skylb")
    assert service["StateDirectory"] == "skylb"
    assert int(service["LimitNOFILE"]) >= 65536
    assert re.fullmatch(r"\d+s", service["TimeoutStopSec"])
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectControlGroups", "RestrictNamespaces", "RestrictSUIDSGID",
                "LockPersonality"):
        assert service[key] == "yes", key
    assert service["ProtectSystem"] == "strict"
    assert service["CapabilityBoundingSet"] == ""
    assert service["SystemCallFilter"] == "@system-service"


def test_balancer_stop_timeout_covers_the_drain():
    """The balancer gives in-flight requests aiohttp's shutdown timeout (60 s) after SIGTERM; systemd must not kill
    it before."""
    from skylb.balancer import process

    assert "shutdown_timeout" not in inspect.getsource(process._serve)  # so aiohttp's default applies
    drain_s = inspect.signature(web.BaseRunner.__init__).parameters["shutdown_timeout"].default
    unit = parse_unit(SYSTEMD / "skylb-balancer@.service")
    assert int(value(unit, "Service", "TimeoutStopSec").rstrip("s")) >= drain_s + 15


def test_example_config_loads_and_fits_the_units():
    """deploy/systemd/skylb.yaml is a valid deployment config: the controller's db and every balancer's state_dir are
    inside /var/lib/skylb (StateDirectory=skylb), every region has its own advertise_url, and it sets no peer token
    (that is the EnvironmentFile's job)."""
    cfg = load_config(SYSTEMD / "skylb.yaml")
    assert cfg.controller.db.startswith("/var/lib/skylb/")
    assert cfg.controller.host == "0.0.0.0" and cfg.controller.port == 8470
    assert set(cfg.regions) == {"us", "eu", "asia"}
    urls = set()
    for region in cfg.regions:
        b = cfg.balancer_for(region)
        assert b.state_dir.startswith("/var/lib/skylb/")
        assert b.peer_token is None
        assert b.controller_url and b.controller_url.endswith(f":{cfg.controller.port}")
        assert b.advertise_url and b.advertise_url.endswith(f":{b.port}")
        urls.add(b.advertise_url)
    assert len(urls) == len(cfg.regions)


def test_controller_exec_start_parses_with_the_real_cli():
    argv, _ = unit_argv(SYSTEMD / "skylb-controller.service")
    assert argv[:2] == [SKYLB_BIN, "controller"]
    args = skylb_args(argv)
    assert args.config == CONFIG_PATH and args.db is None  # the db path is the config's, inside StateDirectory


@pytest.mark.parametrize("region", ["us", "eu", "asia"])
def test_balancer_exec_start_parses_for_every_region(region):
    """skylb-balancer@REGION: the real parser accepts the command line and REGION is a region of the config."""
    unit = parse_unit(SYSTEMD / "skylb-balancer@.service")
    env = read_env_file(SYSTEMD / "peer-token.env")
    argv = exec_argv(value(unit, "Service", "ExecStart"), env, region)
    assert argv[:2] == [SKYLB_BIN, "balancer"]
    args = skylb_args(argv)
    assert args.config == CONFIG_PATH and args.region == region
    load_config(SYSTEMD / "skylb.yaml").balancer_for(region)


def test_balancer_reads_the_peer_token_the_env_file_sets():
    """The EnvironmentFile is required and sets exactly the variable `skylb balancer` reads for the token."""
    from skylb.balancer.process import PEER_TOKEN_ENV

    unit = parse_unit(SYSTEMD / "skylb-balancer@.service")
    assert values(unit, "Service", "EnvironmentFile") == ["/etc/skylb/peer-token.env"]
    assert set(read_env_file(SYSTEMD / "peer-token.env")) == {PEER_TOKEN_ENV}


def test_llama_server_unit_runs_the_projects_command_line():
    """With the unit's defaults, ExecStart is exactly skylb.llamacpp.llama_server_command (the command line the
    llama.cpp tests run), with the port from the instance name; the env example only names the unit's variables."""
    path = SYSTEMD / "llama-server@.service"
    argv, env = unit_argv(path)
    parallel = int(env["PARALLEL"])
    assert int(env["THREADS_HTTP"]) == llamacpp.default_threads_http(parallel)
    assert env["ALIAS"] == llamacpp.model_alias(env["MODEL"])
    assert env["MODEL"].startswith("/var/lib/skylb/")
    expected = llamacpp.llama_server_command(
        int(INSTANCES[path.name]), model_path=env["MODEL"], binary=LLAMA_BIN, parallel=parallel,
        ctx_size=int(env["CTX_SIZE"]), threads=int(env["THREADS"]), host=env["HOST"], alias=env["ALIAS"],
        gpu_layers=int(env["GPU_LAYERS"]), threads_http=int(env["THREADS_HTTP"]), extra_args=env["EXTRA_ARGS"].split())
    assert argv == expected
    # EXTRA_ARGS is split into words, other variables stay one argument each
    argv, _ = unit_argv(path, {"/etc/skylb/llama-server-8081.env": {"EXTRA_ARGS": "--seed 1", "MODEL": "/m/a b.gguf"}})
    assert argv[-2:] == ["--seed", "1"] and argv[argv.index("-m") + 1] == "/m/a b.gguf"
    example = re.findall(r"^#?([A-Z_]+)=", (SYSTEMD / "llama-server.env").read_text(), re.M)
    assert example and set(example) <= set(env)


def _ci_or_skip(message: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def test_llama_server_flags_exist_in_the_built_binary():
    """Every flag of the unit's command line is in `llama-server --help` of the binary the project builds."""
    try:
        binary = llamacpp.llama_server_binary(build=False)
    except llamacpp.LlamaCppUnavailable as exc:
        _ci_or_skip(f"{exc} (`make llama-server` builds it)")
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30).stdout
    argv, _ = unit_argv(SYSTEMD / "llama-server@.service")
    flags = [a for a in argv[1:] if a.startswith("-")]
    assert flags
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{flag} not in llama-server --help"


def _localized_config(tmp_path: Path) -> tuple[Path, dict]:
    """deploy/systemd/skylb.yaml with /var/lib/skylb moved under tmp_path and every address on 127.0.0.1 (free
    ports); returns its path and the rewritten data."""
    data = yaml.safe_load((SYSTEMD / "skylb.yaml").read_text())
    state = tmp_path / "var-lib-skylb"
    controller_port, *balancer_ports = free_ports(1 + len(data["regions"]))
    data["controller"].update(host="127.0.0.1", port=controller_port,
                              db=data["controller"]["db"].replace("/var/lib/skylb", str(state)))
    data["balancer"].update(host="127.0.0.1", controller_url=f"http://127.0.0.1:{controller_port}",
                            state_dir=data["balancer"]["state_dir"].replace("/var/lib/skylb", str(state)))
    for region, port in zip(data["regions"], balancer_ports):
        data["regions"][region]["balancer"].update(port=port, advertise_url=f"http://127.0.0.1:{port}")
    path = tmp_path / "etc-skylb" / "skylb.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    DeploymentConfig.model_validate(data)
    return path, data


def _run_unit_argv(argv: list[str], config: Path) -> list[str]:
    """The unit's skylb command line run from this checkout: the installed script replaced by `python -m skylb`,
    the config path by ``config``."""
    assert argv[0] == SKYLB_BIN
    return [sys.executable, "-m", "skylb", *[str(config) if a == CONFIG_PATH else a for a in argv[1:]]]


def test_controller_and_balancer_units_start_on_the_example_config(procs, tmp_path):
    """The two SkyLB units' command lines, with their environment, run on the example config (moved to a temporary
    directory): the controller creates its SQLite file, the balancer registers at its advertise_url, keeps its
    membership in state_dir, enforces the token from peer-token.env, and exits 0 on SIGTERM."""
    config, data = _localized_config(tmp_path)
    token_file = read_env_file(SYSTEMD / "peer-token.env")
    c_argv, c_env = unit_argv(SYSTEMD / "skylb-controller.service")
    controller_url = data["balancer"]["controller_url"]
    procs.start(_run_unit_argv(c_argv, config), name="controller", env=c_env, wait_url=f"{controller_url}/healthz")
    b_argv, b_env = unit_argv(SYSTEMD / "skylb-balancer@.service", {"/etc/skylb/peer-token.env": token_file})
    url = data["regions"]["us"]["balancer"]["advertise_url"]
    balancer = procs.start(_run_unit_argv(b_argv, config), name="balancer-us", env=b_env, wait_url=f"{url}/healthz")

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        registered = requests.get(f"{controller_url}/v1/balancers", timeout=5).json()["balancers"]
        membership_file = Path(data["balancer"]["state_dir"]) / "membership-us.json"
        if registered and membership_file.exists():
            break
        time.sleep(0.1)
    assert [(b["region"], b["url"]) for b in registered] == [("us", url)]
    assert membership_file.exists()
    assert Path(data["controller"]["db"]).is_file()
    token = token_file["SKYLB_PEER_TOKEN"]
    status = f"{url}/skylb/v1/status"
    assert requests.get(status, timeout=5).status_code == 403
    assert requests.get(status, headers={"X-SkyLB-Token": token}, timeout=5).status_code == 200

    balancer.popen.send_signal(signal.SIGTERM)
    assert balancer.popen.wait(timeout=30) == 0


# --- systemd's own tools, when installed --------------------------------------------------------------------------

def _systemd_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:  # not installed by `make test`: systemd is not a component the tests start
        pytest.skip(f"{name} is not installed (it comes with the systemd package)")
    return path


def _units_with_local_binaries(tmp_path: Path) -> Path:
    """The units with the installed paths of skylb and llama-server replaced by executables that exist here (so
    `systemd-analyze verify` checks the rest instead of failing on a missing /opt/skylb)."""
    out = tmp_path / "units"
    out.mkdir()
    for unit in UNITS:
        text = unit.read_text().replace(SKYLB_BIN, sys.executable).replace(LLAMA_BIN, "/bin/true")
        (out / unit.name).write_text(text)
    return out


def test_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify`: no unknown key, bad value or missing executable in any unit (template units with
    their sample instance)."""
    tool = _systemd_tool("systemd-analyze")
    units = _units_with_local_binaries(tmp_path)
    names = [str(units / n.name.replace("@.", f"@{INSTANCES[n.name]}.") if "@." in n.name else units / n.name)
             for n in UNITS]
    out = subprocess.run([tool, "verify", "--man=no", *names], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


@pytest.mark.parametrize("name", [u.name for u in UNITS])
def test_systemd_analyze_security_rates_each_unit_ok(name, tmp_path):
    """`systemd-analyze security --offline=true`: an exposure level of at most 2.0 ("OK") for every unit."""
    tool = _systemd_tool("systemd-analyze")
    units = _units_with_local_binaries(tmp_path)
    unit = units / (name.replace("@.", f"@{INSTANCES[name]}.") if "@." in name else name)
    out = subprocess.run([tool, "security", "--offline=true", "--no-pager", str(unit)], capture_output=True,
                         text=True, timeout=60)
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    assert level, out.stdout + out.stderr
    assert float(level.group(1)) <= 2.0, out.stdout


def test_sysusers_file_creates_the_skylb_user(tmp_path):
    """`systemd-sysusers --root=DIR` creates the `skylb` system user and group from skylb.sysusers.conf."""
    tool = _systemd_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    out = subprocess.run([tool, f"--root={tmp_path}", str(SYSTEMD / "skylb.sysusers.conf")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    user = next(line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
                if line.startswith("skylb:"))
    assert user[5] == "/var/lib/skylb" and user[6].endswith("nologin")
    assert any(line.startswith("skylb:") for line in (tmp_path / "etc" / "group").read_text().splitlines())
