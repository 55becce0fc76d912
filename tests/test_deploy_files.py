"""The deployment files (deploy/systemd, deploy/k8s) against the real command lines, config schema and tools.

systemd units: parsed (sections, continuation lines, Environment=, EnvironmentFile=, specifiers, $VAR and ${VAR}
as systemd expands them); every ExecStart parses with the real argument parsers and names only flags that exist;
the example config loads with skylb.config.load_config; the controller and balancer command lines start real
processes on that config; the llama-server command line is bench.launch.llamacpp's and every flag is in the built
llama-server's --help. `systemd-analyze verify` / `security --offline` and `systemd-sysusers --root` run when
systemd's tools are installed (no running systemd is needed); they are not one of the components `make test`
installs, so without them those tests skip, under CI too.

Kubernetes manifests: validated offline against the Kubernetes OpenAPI schemas bundled in kubernetes-validate
(strict: unknown fields are errors), then checked for what a schema cannot see: selectors, Service ports, mounted
objects, the ConfigMap's config against skylb's schema and the Services' names, container args against the real
parser, and real processes (SkyLB from the manifests' args, a 3-member etcd cluster from the StatefulSet's flags).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import os
import re
import shlex
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import requests
import yaml

from bench.launch import llamacpp
from skylb.cli import SUBCOMMANDS, build_parser
from skylb.config import DeploymentConfig, load_config
from tests.procs import free_ports
from tests.system import require_binary, skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
#: Where the units expect things on a host (deploy/systemd/README.md).
SKYLB_BIN = "/opt/skylb/bin/skylb"
LLAMA_BIN = "/usr/local/bin/llama-server"
CONFIG_PATH = "/etc/skylb/skylb.yaml"
#: A sample instance name per template unit.
INSTANCES = {"skylb-balancer@.service": "us-1", "llama-server@.service": "8081"}
#: The host name the tests give systemd's %l and %H specifiers.
HOSTNAME = "host-a"
#: The balancer instances deploy/systemd ships settings for: two siblings of region us on one host.
BALANCER_INSTANCES = ("us-1", "us-2")


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
        if spec in "lH":
            return HOSTNAME
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


def unit_argv(path: Path, env_files: dict[str, dict[str, str]] | None = None, *,
              instance: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The ExecStart argv of the unit at ``path`` (as ``instance``, default its sample instance) and the environment
    it runs with: Environment= then the EnvironmentFile= files found in ``env_files`` (by path; optional ones may be
    missing)."""
    unit = parse_unit(path)
    instance = instance or INSTANCES.get(path.name)
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
    for name in ("skylb.yaml", "peer-token.env", "admin-token.env", "llama-server.env", "skylb.sysusers.conf",
                 "README.md", *(f"skylb-balancer-{i}.env" for i in BALANCER_INSTANCES)):
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


@pytest.mark.parametrize("name", ["skylb-controller.service", "skylb-balancer@.service"])
def test_skylb_units_reload_with_sighup(name):
    """`systemctl reload` sends SIGHUP to the main process, which re-reads its config and key files
    (skylb/reload.py)."""
    assert values(parse_unit(SYSTEMD / name), "Service", "ExecReload") == ["/bin/kill -HUP $MAINPID"]


def test_balancer_stop_timeout_covers_the_drain():
    """After SIGTERM the balancer drains for drain_timeout_s, then ends what is left (bounded); systemd must not kill
    it before."""
    from skylb.balancer import process

    cfg = load_config(SYSTEMD / "skylb.yaml")
    drain_s = max(process.stop_time_bound_s(cfg.balancer_for(region)) for region in cfg.regions)
    unit = parse_unit(SYSTEMD / "skylb-balancer@.service")
    assert int(value(unit, "Service", "TimeoutStopSec").rstrip("s")) >= drain_s + 15


def test_example_config_loads_and_fits_the_units():
    """deploy/systemd/skylb.yaml is a valid deployment config: the controller's db and every balancer's state_dir are
    inside /var/lib/skylb (StateDirectory=skylb), it sets no peer token (that is the EnvironmentFile's job) and no
    balancer address (each instance's settings file has its own: one port each on a host, a URL on that port)."""
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
        assert b.advertise_url is None and b.balancer_id is None
    ports = set()
    for instance in BALANCER_INSTANCES:
        env = read_env_file(SYSTEMD / f"skylb-balancer-{instance}.env")
        assert set(env) == {"REGION", "PORT", "ADVERTISE_URL"} and env["REGION"] in cfg.regions
        assert env["ADVERTISE_URL"].endswith(f":{env['PORT']}")
        ports.add(env["PORT"])
        urls.add(env["ADVERTISE_URL"])
    assert len(ports) == len(urls) == len(BALANCER_INSTANCES)


#: The tokens README.md's install step puts in place of the placeholders (`openssl rand -hex 32`), once per run.
_INSTALLED = {"SKYLB_PEER_TOKEN": secrets.token_hex(32), "SKYLB_ADMIN_TOKEN": secrets.token_hex(32)}


def installed_env_file(name: str) -> dict[str, str]:
    """deploy/systemd/NAME as README.md installs it: each placeholder token replaced by a generated one."""
    return {k: _INSTALLED[k] if v.startswith("replace-with-") else v
            for k, v in read_env_file(SYSTEMD / name).items()}


def controller_env_files() -> dict[str, dict[str, str]]:
    """The controller unit's EnvironmentFiles as installed (README.md)."""
    return {"/etc/skylb/admin-token.env": installed_env_file("admin-token.env"),
            "/etc/skylb/peer-token.env": installed_env_file("peer-token.env")}


def test_controller_exec_start_parses_with_the_real_cli():
    argv, _ = unit_argv(SYSTEMD / "skylb-controller.service", controller_env_files())
    assert argv[:2] == [SKYLB_BIN, "controller"]
    args = skylb_args(argv)
    assert args.config == CONFIG_PATH and args.db is None  # the db path is the config's, inside StateDirectory


def balancer_env_files(instance: str, settings: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The balancer unit's EnvironmentFiles for ``instance`` as installed (README.md), its settings file replaced
    by ``settings`` when given."""
    return {"/etc/skylb/peer-token.env": installed_env_file("peer-token.env"),
            f"/etc/skylb/skylb-balancer-{instance}.env":
                settings or read_env_file(SYSTEMD / f"skylb-balancer-{instance}.env")}


@pytest.mark.parametrize("instance", BALANCER_INSTANCES)
def test_balancer_exec_start_parses_for_every_instance(instance):
    """skylb-balancer@INSTANCE: the real parser accepts the command line; its region, port and URL are its settings
    file's, its id the host's short name and the instance (unique among the host's siblings and across hosts)."""
    argv, env = unit_argv(SYSTEMD / "skylb-balancer@.service", balancer_env_files(instance), instance=instance)
    assert argv[:2] == [SKYLB_BIN, "balancer"]
    args = skylb_args(argv)
    assert args.config == CONFIG_PATH and args.region == env["REGION"] and args.port == int(env["PORT"])
    assert args.advertise_url == env["ADVERTISE_URL"] and args.balancer_id == f"{HOSTNAME}-{instance}"
    load_config(SYSTEMD / "skylb.yaml").balancer_for(args.region)


def test_balancer_reads_the_peer_token_the_env_file_sets():
    """The EnvironmentFile is required and sets exactly the variable `skylb balancer` reads for the token."""
    from skylb.balancer.process import PEER_TOKEN_ENV

    unit = parse_unit(SYSTEMD / "skylb-balancer@.service")
    assert values(unit, "Service", "EnvironmentFile") == ["/etc/skylb/peer-token.env",
                                                          "/etc/skylb/skylb-balancer-%i.env"]
    assert set(read_env_file(SYSTEMD / "peer-token.env")) == {PEER_TOKEN_ENV}


def test_controller_reads_the_admin_and_peer_tokens_the_env_files_set():
    """Secure by default: the controller unit requires both files (no '-' prefix), which set exactly the variables
    `skylb controller` reads for the admin token and the balancers' heartbeat token."""
    from skylb.tokens import ADMIN_TOKEN_ENV, PEER_TOKEN_ENV

    unit = parse_unit(SYSTEMD / "skylb-controller.service")
    assert values(unit, "Service", "EnvironmentFile") == ["/etc/skylb/admin-token.env", "/etc/skylb/peer-token.env"]
    assert set(read_env_file(SYSTEMD / "admin-token.env")) == {ADMIN_TOKEN_ENV}
    _, env = unit_argv(SYSTEMD / "skylb-controller.service", controller_env_files())
    assert env[ADMIN_TOKEN_ENV] and env[PEER_TOKEN_ENV]
    with pytest.raises(AssertionError, match="required"):  # a missing file stops the unit, it never runs open
        unit_argv(SYSTEMD / "skylb-controller.service", {"/etc/skylb/peer-token.env": {}})


def test_llama_server_unit_runs_the_projects_command_line():
    """With the unit's defaults, ExecStart is exactly bench.launch.llamacpp.llama_server_command (the command line the
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


def test_llama_server_flags_exist_in_the_built_binary():
    """Every flag of the unit's command line is in `llama-server --help` of the binary the project builds."""
    try:
        binary = llamacpp.llama_server_binary(build=False)
    except llamacpp.LlamaCppUnavailable as exc:
        skip_or_fail(f"{exc} (`make llama-server` builds it)")
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30).stdout
    argv, _ = unit_argv(SYSTEMD / "llama-server@.service")
    flags = [a for a in argv[1:] if a.startswith("-")]
    assert flags
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{flag} not in llama-server --help"


def _localized_config(tmp_path: Path) -> tuple[Path, dict]:
    """deploy/systemd/skylb.yaml with /var/lib/skylb moved under tmp_path and the controller on 127.0.0.1 (a free
    port); returns its path and the rewritten data."""
    data = yaml.safe_load((SYSTEMD / "skylb.yaml").read_text())
    state = tmp_path / "var-lib-skylb"
    controller_port = free_ports(1)[0]
    data["controller"].update(host="127.0.0.1", port=controller_port,
                              db=data["controller"]["db"].replace("/var/lib/skylb", str(state)))
    data["balancer"].update(host="127.0.0.1", controller_url=f"http://127.0.0.1:{controller_port}",
                            state_dir=data["balancer"]["state_dir"].replace("/var/lib/skylb", str(state)))
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
    """The SkyLB units' command lines, with their environment, run on the example config (moved to a temporary
    directory): the controller creates its SQLite file; two instances of the balancer unit (us-1 and us-2, siblings
    on one host, each its own port) register at their URLs under their ids, keep their membership in state_dir
    (one file each) and enforce the token from peer-token.env; the controller the admin token from
    admin-token.env; a replica added is owned by one of them; a balancer exits 0 on SIGTERM."""
    config, data = _localized_config(tmp_path)
    token = installed_env_file("peer-token.env")["SKYLB_PEER_TOKEN"]
    c_argv, c_env = unit_argv(SYSTEMD / "skylb-controller.service", controller_env_files())
    controller_url = data["balancer"]["controller_url"]
    procs.start(_run_unit_argv(c_argv, config), name="controller", env=c_env, wait_url=f"{controller_url}/healthz")
    urls, balancers = {}, {}
    for instance, port in zip(BALANCER_INSTANCES, free_ports(len(BALANCER_INSTANCES))):
        settings = {**read_env_file(SYSTEMD / f"skylb-balancer-{instance}.env"), "PORT": str(port),
                    "ADVERTISE_URL": f"http://127.0.0.1:{port}"}
        b_argv, b_env = unit_argv(SYSTEMD / "skylb-balancer@.service", balancer_env_files(instance, settings),
                                  instance=instance)
        urls[instance] = settings["ADVERTISE_URL"]
        balancers[instance] = procs.start(_run_unit_argv(b_argv, config), name=f"balancer-{instance}", env=b_env,
                                          wait_url=f"{urls[instance]}/healthz")

    state = Path(data["balancer"]["state_dir"])
    files = [state / f"membership-us-{HOSTNAME}-{instance}.json" for instance in BALANCER_INSTANCES]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        registered = requests.get(f"{controller_url}/v1/balancers", timeout=5).json()["balancers"]
        if len(registered) == 2 and all(f.exists() for f in files):
            break
        time.sleep(0.1)
    assert {(b["region"], b["url"], b["id"]) for b in registered} == {
        ("us", urls[i], f"{HOSTNAME}-{i}") for i in BALANCER_INSTANCES}
    assert all(f.exists() for f in files)
    assert Path(data["controller"]["db"]).is_file()
    status = f"{urls['us-1']}/skylb/v1/status"
    assert requests.get(status, timeout=5).status_code == 403
    assert requests.get(status, headers={"X-SkyLB-Token": token}, timeout=5).status_code == 200
    replica = {"region": "us", "url": "http://127.0.0.1:9"}
    assert requests.post(f"{controller_url}/v1/replicas", json=replica, timeout=5).status_code == 401
    admin = {"Authorization": f"Bearer {c_env['SKYLB_ADMIN_TOKEN']}"}
    assert requests.post(f"{controller_url}/v1/replicas", json=replica, headers=admin, timeout=5).status_code == 201
    owners = requests.get(f"{controller_url}/v1/owners", timeout=5).json()["owners"]
    assert [o["replica"] for o in owners] == ["us-1"] and owners[0]["balancer"] in urls.values()

    balancers["us-1"].popen.send_signal(signal.SIGTERM)
    assert balancers["us-1"].popen.wait(timeout=30) == 0


def test_units_refuse_to_start_with_the_placeholder_tokens(tmp_path):
    """Skipping the install step that generates the tokens stops both units (exit 2, the reason on stderr, never
    the value) instead of running with a secret everybody knows."""
    config, _ = _localized_config(tmp_path)
    raw = {"/etc/skylb/admin-token.env": read_env_file(SYSTEMD / "admin-token.env"),
           "/etc/skylb/peer-token.env": read_env_file(SYSTEMD / "peer-token.env")}
    raw["/etc/skylb/skylb-balancer-us-1.env"] = read_env_file(SYSTEMD / "skylb-balancer-us-1.env")
    for unit in ("skylb-controller.service", "skylb-balancer@.service"):
        argv, env = unit_argv(SYSTEMD / unit, raw)
        done = subprocess.run(_run_unit_argv(argv, config), env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 2 and "placeholder" in done.stderr, (unit, done.stderr)
        assert "replace-with-" not in done.stderr


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


# --- Kubernetes ---------------------------------------------------------------------------------------------------

K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "skylb"
CLUSTER_DOMAIN = "svc.cluster.local"
REGIONS = ("us", "eu", "asia")
#: The oldest Kubernetes minor the manifests are checked against, and kubernetes-validate's newest.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}


def pod_spec(doc: dict) -> dict | None:
    """The pod spec of a Pod, Deployment or StatefulSet; None for other kinds."""
    if doc["kind"] == "Pod":
        return doc["spec"]
    return doc["spec"]["template"]["spec"] if doc["kind"] in WORKLOAD_KINDS else None


def k8s_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def k8s_documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in k8s_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_object(kind: str, name: str) -> dict:
    found = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(workload: dict, name: str | None = None) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def configmap_config(tmp_path: Path) -> tuple[DeploymentConfig, dict]:
    """The skylb.yaml of ConfigMap skylb-config, loaded with skylb's own loader, and as plain data."""
    text = k8s_object("ConfigMap", "skylb-config")["data"]["skylb.yaml"]
    path = tmp_path / "configmap-skylb.yaml"
    path.write_text(text)
    return load_config(path), yaml.safe_load(text)


def test_the_manifests_are_all_there():
    names = {str(p.relative_to(K8S)) for p in k8s_files()}
    assert names == {"00-namespace.yaml", "10-configmap.yaml", "20-controller.yaml", "30-balancer-us.yaml",
                     "30-balancer-eu.yaml", "30-balancer-asia.yaml", "etcd/etcd.yaml",
                     "examples/llama-models.yaml", "examples/llama-server-us.yaml"}
    for name in ("README.md", "Dockerfile", "Dockerfile.dockerignore"):
        assert (K8S / name).is_file(), name


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schema(path, version, no_network):
    """Every object, against the Kubernetes OpenAPI schemas bundled in kubernetes-validate, strict (an unknown or
    misspelt field is an error), offline (the network is blocked while it runs)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {where}: {exc.message}")


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (the validator must work offline)."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] or kwargs}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize("mutate, message", [
    (lambda c, d: c.update(argz=[]), "'argz' was unexpected"),
    (lambda c, d: c["readinessProbe"].update(periodSecond=5), "'periodSecond' was unexpected"),
    (lambda c, d: c["ports"][0].update(containerPort="http"), "is not of type 'integer'"),
    (lambda c, d: d["spec"].update(replicas="one"), "is not of type 'integer'"),
    (lambda c, d: d["spec"]["template"]["spec"].pop("containers"), "'containers' is a required property"),
], ids=["unknown-field", "nested-typo", "wrong-type", "wrong-type-top", "missing-required"])
def test_the_validator_rejects_broken_manifests(mutate, message, no_network):
    """Negative control: the same validation rejects a balancer Deployment with one mistake."""
    doc = copy.deepcopy(k8s_object("Deployment", "skylb-balancer-us"))
    mutate(container(doc), doc)
    with pytest.raises(kubernetes_validate.ValidationError, match=re.escape(message)):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_labels_namespaces_and_selectors_are_consistent():
    """Every object is in the skylb namespace and labelled part-of skylb; each workload's selector matches its pod
    labels; each Service selects exactly one workload, and its target ports are named ports of that workload."""
    docs = [d for _, d in k8s_documents()]
    workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    for d in docs:
        meta = d["metadata"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "skylb", meta["name"]
        if d["kind"] != "Namespace":
            assert meta["namespace"] == NAMESPACE, meta["name"]
    for w in workloads:
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), w["metadata"]["name"]
        assert w["metadata"]["labels"] == pod_labels, w["metadata"]["name"]
        for c in w["spec"]["template"]["spec"]["containers"]:
            port_names = {p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in port_names, (w["metadata"]["name"], probe)
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [w for w in workloads
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {len(selected)} workloads"
        ports = {p["name"]: p["containerPort"] for c in selected[0]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selected = [w for w in workloads
                    if pdb["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1
        if "minAvailable" in pdb["spec"]:  # a quorum (etcd): a majority stays up
            assert pdb["spec"]["minAvailable"] > selected[0]["spec"]["replicas"] // 2
        else:  # siblings (balancers): one at a time, and never the last
            assert 1 == pdb["spec"]["maxUnavailable"] < selected[0]["spec"]["replicas"]


def test_volumes_refer_to_objects_that_exist():
    """ConfigMaps and PersistentVolumeClaims that pods mount are defined in the manifests (the Secret
    skylb-peer-token is created by the command in README.md); every mount names a volume of its pod."""
    docs = [d for _, d in k8s_documents()]
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    readme = (K8S / "README.md").read_text()
    for w in (d for d in docs if pod_spec(d) is not None):
        spec = pod_spec(w)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes.update({t["metadata"]["name"]: {"template": True} for t in w["spec"].get("volumeClaimTemplates", [])})
        for v in volumes.values():
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in defined
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in defined
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (w["metadata"]["name"], mount)
            for env in c.get("env", []):
                if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                    assert f"create secret generic {ref['name']} --from-literal={ref['key']}=" in readme


def test_configmap_config_fits_the_services_and_mounts(tmp_path):
    """The ConfigMap's skylb.yaml loads with skylb.config.load_config; its regions are the three balancer
    Deployments; each balancer pod registers at its own pod address and port under its pod name (its args), and its
    Service targets that port; listen ports are the containers' ports; controller_url is the controller Service;
    the SQLite file is on the controller's PVC and each balancer's state_dir on a writable volume; --config points
    into the ConfigMap's mount."""
    cfg, _ = configmap_config(tmp_path)
    assert tuple(cfg.regions) == REGIONS
    controller = k8s_object("Deployment", "skylb-controller")
    c = container(controller)
    assert cfg.controller.host == "0.0.0.0"
    assert cfg.controller.port == c["ports"][0]["containerPort"]
    svc = k8s_object("Service", "skylb-controller")
    controller_dns = f"http://skylb-controller.{NAMESPACE}.{CLUSTER_DOMAIN}:{svc['spec']['ports'][0]['port']}"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert Path(cfg.controller.db).parent.as_posix() in mounts
    data_volume = next(v for v in controller["spec"]["template"]["spec"]["volumes"]
                       if v["name"] == mounts[str(Path(cfg.controller.db).parent)]["name"])
    assert data_volume["persistentVolumeClaim"]["claimName"] == "skylb-controller-data"
    for region in REGIONS:
        b = cfg.balancer_for(region)
        deployment = k8s_object("Deployment", f"skylb-balancer-{region}")
        service = k8s_object("Service", f"skylb-balancer-{region}")
        bc = container(deployment)
        assert b.host == "0.0.0.0" and b.port == bc["ports"][0]["containerPort"]
        assert service["spec"]["ports"][0]["targetPort"] == bc["ports"][0]["name"]
        # Each sibling registers at its own pod address and port, under its pod name (args; ConfigMap has none).
        args = bc["args"]
        assert b.advertise_url is None and b.balancer_id is None
        assert args[args.index("--advertise-url") + 1] == f"http://$(POD_IP):{bc['ports'][0]['containerPort']}"
        assert args[args.index("--balancer-id") + 1] == "$(POD_NAME)"
        assert b.controller_url == controller_dns
        assert b.peer_token is None  # from the Secret
        writable = {m["mountPath"] for m in bc["volumeMounts"] if not m.get("readOnly")}
        assert b.state_dir in writable
    for w in (controller, *(k8s_object("Deployment", f"skylb-balancer-{r}") for r in REGIONS)):
        wc = container(w)
        config_path = Path(wc["args"][wc["args"].index("--config") + 1])
        mount = next(m for m in wc["volumeMounts"] if m["mountPath"] == str(config_path.parent))
        assert mount["readOnly"] is True
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "skylb-config"
        assert config_path.name in k8s_object("ConfigMap", "skylb-config")["data"]


def test_skylb_container_args_parse_with_the_real_cli(tmp_path):
    """The image's entrypoint is `skylb`; each container's args parse with the real parser; balancers get their
    region and the peer token from the Secret in the variable `skylb balancer` reads."""
    from skylb.balancer.process import PEER_TOKEN_ENV

    assert 'ENTRYPOINT ["skylb"]' in (K8S / "Dockerfile").read_text()
    cfg, _ = configmap_config(tmp_path)
    args = skylb_args(["skylb", *container(k8s_object("Deployment", "skylb-controller"))["args"]])
    assert args.command == "controller"
    for region in REGIONS:
        c = container(k8s_object("Deployment", f"skylb-balancer-{region}"))
        args = skylb_args(["skylb", *c["args"]])
        assert args.command == "balancer" and args.region == region
        cfg.balancer_for(region)
        assert [e["name"] for e in c["env"]] == [PEER_TOKEN_ENV, "POD_IP", "POD_NAME"]
        assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"][1:]] == ["status.podIP", "metadata.name"]
    controller_env = container(k8s_object("Deployment", "skylb-controller"))["env"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in controller_env} == {
        "SKYLB_ADMIN_TOKEN": "skylb-admin-token", PEER_TOKEN_ENV: "skylb-peer-token"}


def test_each_region_runs_two_sibling_balancers_that_a_disruption_cannot_take_together():
    """Each region's Deployment runs 2 balancers, prefers them on different nodes (anti-affinity on its own pods'
    labels, by hostname), and its PodDisruptionBudget lets one go at a time; readiness is the balancer's /readyz,
    a route the real balancer serves without credentials."""
    from skylb.balancer.auth import _OPEN_PATHS
    from skylb.balancer.status import ROUTES

    assert "/readyz" in {r.path for r in ROUTES} and "/readyz" in _OPEN_PATHS
    for region in REGIONS:
        d = k8s_object("Deployment", f"skylb-balancer-{region}")
        assert d["spec"]["replicas"] == 2
        (term,) = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        pdb = k8s_object("PodDisruptionBudget", f"skylb-balancer-{region}")
        assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"] == d["spec"]["selector"]
        assert container(d)["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_three_balancer_files_differ_only_in_the_region():
    us = (K8S / "30-balancer-us.yaml").read_text()
    for region in ("eu", "asia"):
        expected = list(yaml.safe_load_all(re.sub(r"\bus\b", region, us)))
        assert list(yaml.safe_load_all((K8S / f"30-balancer-{region}.yaml").read_text())) == expected


def test_balancer_pods_have_time_to_drain(tmp_path):
    """terminationGracePeriodSeconds covers the preStop sleep plus the balancer's drain after SIGTERM
    (drain_timeout_s and the bounded end of what is left), and a rolling update starts the new pod before the old one
    stops."""
    from skylb.balancer import process

    cfg, _ = configmap_config(tmp_path)
    for region in REGIONS:
        drain_s = process.stop_time_bound_s(cfg.balancer_for(region))
        d = k8s_object("Deployment", f"skylb-balancer-{region}")
        c = container(d)
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain_s + 15
        assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    controller = k8s_object("Deployment", "skylb-controller")
    assert controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == "Recreate"


def test_pods_run_unprivileged_as_the_images_user():
    dockerfile = (K8S / "Dockerfile").read_text()
    uid = int(re.search(r"^USER (\d+)", dockerfile, re.M).group(1))
    for _, d in k8s_documents():
        pod = pod_spec(d)
        if pod is None:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        if pod["containers"][0]["image"].startswith("skylb:"):
            assert pod["securityContext"]["runAsUser"] == uid
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "limits" in c["resources"] and "requests" in c["resources"]


def test_the_image_installs_the_packages_the_project_declares():
    """The Dockerfile copies every package directory pyproject.toml's package search includes and no other, and the
    build context (Dockerfile.dockerignore) lets exactly those through."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    dockerfile = (K8S / "Dockerfile").read_text()
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), package
        assert f"!{package}/" in ignore
    # ... and nothing the wheel leaves out (the harness in bench/ is not part of the image).
    assert set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.M)) == packages
    assert {line[1:].rstrip("/") for line in ignore if line.startswith("!") and line.endswith("/")} == packages
    assert "!pyproject.toml" in ignore and "!README.md" in ignore  # pyproject's readme


def test_skylb_pods_start_from_the_manifests(procs, tmp_path):
    """The controller's and a balancer's container args, with the ConfigMap's config (paths and addresses moved to
    this machine) and the Secret's token in the environment, start real processes; the balancer registers."""
    _, data = configmap_config(tmp_path)
    state = tmp_path / "state"
    controller_port, balancer_port = free_ports(2)
    data["controller"].update(host="127.0.0.1", port=controller_port, db=str(state / "controller.sqlite"))
    data["balancer"].update(host="127.0.0.1", controller_url=f"http://127.0.0.1:{controller_port}",
                            state_dir=str(state / "balancer"))
    data["regions"]["us"]["balancer"] = {"port": balancer_port}
    config = tmp_path / "skylb.yaml"
    config.write_text(yaml.safe_dump(data))

    def argv(workload: str) -> list[str]:
        args = container(k8s_object("Deployment", workload))["args"]
        # What Kubernetes does with $(POD_IP) and $(POD_NAME), and the port moved to this machine.
        pod = {"/etc/skylb/skylb.yaml": str(config), "http://$(POD_IP):8080": f"http://127.0.0.1:{balancer_port}",
               "$(POD_NAME)": "skylb-balancer-us-7d9f-x2k4p"}
        return [sys.executable, "-m", "skylb", *[pod.get(a, a) for a in args]]

    controller_url = f"http://127.0.0.1:{controller_port}"
    procs.start(argv("skylb-controller"), name="controller", wait_url=f"{controller_url}/healthz",
                env={"SKYLB_ADMIN_TOKEN": "admin-from-the-secret-8e41c0d7f3",
                     "SKYLB_PEER_TOKEN": "peer-from-the-secret-2a9f63b5c81"})
    url = f"http://127.0.0.1:{balancer_port}"
    procs.start(argv("skylb-balancer-us"), name="balancer-us",
                env={"SKYLB_PEER_TOKEN": "peer-from-the-secret-2a9f63b5c81"},
                wait_url=f"{url}/healthz")
    deadline = time.monotonic() + 15
    while not (registered := requests.get(f"{controller_url}/v1/balancers", timeout=5).json()["balancers"]):
        assert time.monotonic() < deadline, "the balancer did not register"
        time.sleep(0.1)
    assert [(b["region"], b["url"], b["id"]) for b in registered] == [("us", url, "skylb-balancer-us-7d9f-x2k4p")]
    assert requests.get(f"{url}/readyz", timeout=5).status_code == 503  # no replica or peer yet: not ready
    assert requests.get(f"{url}/skylb/v1/status", timeout=5).status_code == 403
    assert requests.get(f"{url}/skylb/v1/status", headers={"X-SkyLB-Token": "peer-from-the-secret-2a9f63b5c81"},
                        timeout=5).status_code == 200
    replica = {"region": "us", "url": "http://127.0.0.1:9"}
    assert requests.post(f"{controller_url}/v1/replicas", json=replica, timeout=5).status_code == 401
    assert requests.post(f"{controller_url}/v1/replicas", json=replica, timeout=5,
                         headers={"Authorization": "Bearer admin-from-the-secret-8e41c0d7f3"}).status_code == 201


# --- etcd ---------------------------------------------------------------------------------------------------------

def etcd_flags() -> dict[str, str]:
    c = container(k8s_object("StatefulSet", "etcd"))
    assert c["command"] == ["/usr/local/bin/etcd"]
    flags = {}
    for arg in c["args"]:
        name, sep, val = arg.partition("=")
        assert sep and name.startswith("--") and name not in flags, arg
        flags[name] = val
    return flags


def test_etcd_initial_cluster_names_every_member_by_its_pod_dns_name():
    """--initial-cluster lists etcd-0 .. etcd-(replicas-1) at <pod>.<headless service>.<namespace>.svc, the peer
    port; each member advertises its own entry; the headless Service publishes not-ready members."""
    sts = k8s_object("StatefulSet", "etcd")
    replicas, service = sts["spec"]["replicas"], sts["spec"]["serviceName"]
    assert replicas == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = k8s_object("Service", service)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    ports = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}
    flags = etcd_flags()
    dns = f"$(POD_NAME).{service}.{NAMESPACE}.{CLUSTER_DOMAIN}"
    assert flags["--name"] == "$(POD_NAME)"
    assert flags["--initial-advertise-peer-urls"] == f"http://{dns}:{ports['peer']}"
    assert flags["--advertise-client-urls"] == f"http://{dns}:{ports['client']}"
    assert flags["--initial-cluster"] == ",".join(
        f"{sts['metadata']['name']}-{i}=http://{sts['metadata']['name']}-{i}.{service}.{NAMESPACE}.{CLUSTER_DOMAIN}:"
        f"{ports['peer']}" for i in range(replicas))
    assert container(sts)["image"].startswith("quay.io/coreos/etcd:v3.5.")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(sts)["env"]}
    assert env == {"POD_NAME": "metadata.name"}


def test_etcd_flags_exist_and_form_a_cluster(procs, tmp_path):
    """The manifest's etcd flags, with each pod's DNS name mapped to 127.0.0.1 and a port of its own, start three
    real etcd members that form one cluster (etcd itself checks that every member's advertised peer URL is its
    --initial-cluster entry) and answer /health on the metrics port, which the probes use. Debian's etcd is 3.4,
    the image 3.5: the flags used exist in both."""
    etcd = require_binary("etcd")
    flags = etcd_flags()
    help_text = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30)
    for name in flags:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text.stdout + help_text.stderr), name
    sts = k8s_object("StatefulSet", "etcd")
    named = {p["containerPort"]: p["name"] for p in container(sts)["ports"]}
    members = [f"etcd-{i}" for i in range(sts["spec"]["replicas"])]
    ports = {m: dict(zip(named, free_ports(len(named)))) for m in members}

    def localize(text: str, member: str) -> str:
        def url(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            owner = member if host == "0.0.0.0" else host.split(".")[0]
            return f"http://127.0.0.1:{ports[owner][port]}"
        text = text.replace("$(POD_NAME)", member)
        return re.sub(r"http://([\w.-]+):(\d+)", url, text)

    metrics_port = next(p for p, n in named.items() if n == "metrics")
    for member in members:
        args = [localize(f"{k}={v}", member) for k, v in flags.items() if k != "--data-dir"]
        args.append(f"--data-dir={tmp_path / member}")
        procs.start([etcd, *args], name=member, env={"ETCD_UNSUPPORTED_ARCH": ""})
    deadline = time.monotonic() + 60
    for member in members:
        health = f"http://127.0.0.1:{ports[member][metrics_port]}/health"
        while True:
            try:
                resp = requests.get(health, timeout=2)
                if resp.status_code == 200 and resp.json().get("health") == "true":
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"{member} not healthy; log:\n" + \
                next(p for p in procs.procs if p.name == member).log()[-3000:]
            time.sleep(0.2)
    client = f"http://127.0.0.1:{ports['etcd-0'][next(p for p, n in named.items() if n == 'client')]}"
    members_seen = requests.post(f"{client}/v3/cluster/member/list", json={}, timeout=5).json()["members"]
    assert sorted(m["name"] for m in members_seen) == members


# --- the llama.cpp example ----------------------------------------------------------------------------------------

def test_llama_server_example_runs_the_projects_command_line():
    """The example StatefulSet's args are bench.launch.llamacpp.llama_server_command's (without the binary: the image's
    entrypoint is llama-server) on the container's port, and each pod has its own DNS name (headless Service)."""
    sts = k8s_object("StatefulSet", "llama-us")
    c = container(sts)
    args = c["args"]
    get = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    parallel = int(get("-np"))
    expected = llamacpp.llama_server_command(
        c["ports"][0]["containerPort"], model_path=get("-m"), binary="llama-server", parallel=parallel,
        ctx_size=int(get("-c")), threads=int(get("-t")), host="0.0.0.0", gpu_layers=int(get("-ngl")))
    assert args == expected[1:]
    assert get("--alias") == llamacpp.model_alias(get("-m"))
    assert int(get("--threads-http")) == llamacpp.default_threads_http(parallel)
    mount = next(m for m in c["volumeMounts"] if get("-m").startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    assert k8s_object("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_ha_controller_snippet_matches_etcd_and_the_config_schema():
    """README.md's etcd config for the controller names the etcd pods' client URLs and validates against the
    controller's config schema."""
    from skylb.config import ControllerConfig

    readme = (K8S / "README.md").read_text()
    block = re.search(r"```yaml\n(# controller on etcd.*?)```", readme, re.S)
    assert block, "README.md lost the HA controller snippet"
    snippet = yaml.safe_load(block.group(1))["controller"]
    sts = k8s_object("StatefulSet", "etcd")
    client_port = next(p["containerPort"] for p in container(sts)["ports"] if p["name"] == "client")
    assert snippet["etcd"]["endpoints"] == [
        f"http://etcd-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.{CLUSTER_DOMAIN}:{client_port}"
        for i in range(sts["spec"]["replicas"])]
    assert ControllerConfig.model_validate(snippet).store == "etcd"


# --- the READMEs --------------------------------------------------------------------------------------------------

def readme_ctl_commands() -> list[tuple[str, list[str]]]:
    """Every `skylb-ctl ...` command in the code blocks of deploy/systemd/README.md and deploy/k8s/README.md, as
    argv (continuation lines joined; $(...) replaced by a placeholder word; the command ends at ; && | or &)."""
    commands = []
    for readme in (SYSTEMD / "README.md", K8S / "README.md"):
        for block in re.findall(r"```\n(.*?)```", readme.read_text(), re.S):
            text = re.sub(r"\$\([^)]*\)", "X", block.replace("\\\n", " "))
            for line in text.splitlines():
                if "skylb-ctl " not in line:
                    continue
                words = shlex.split(line[line.index("skylb-ctl "):], comments=True)
                end = next((i for i, w in enumerate(words) if w in (";", "&&", "|", "&", "done")), len(words))
                commands.append((f"{readme.parent.name}/README.md", words[:end]))
    return commands


def test_readme_skylb_ctl_commands_parse_with_the_real_cli():
    from controller.ctl import build_parser as ctl_parser

    commands = readme_ctl_commands()
    assert len(commands) >= 4
    for where, argv in commands:
        assert argv[0] == "skylb-ctl", (where, argv)
        parse_with(ctl_parser(), [a.rstrip(";") for a in argv[1:]])
