"""`skylb local`: the whole deployment as real processes, a replay, the report, and a clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.procs import alive_in_groups
from tests.system import require_binary


def _config(tmp_path: Path) -> Path:
    """A small deployment that overloads us (one replica, two slots) so it must forward to eu."""
    cfg = {
        "balancer": {"probe_interval_ms": 50},
        "regions": {"us": {"replicas": 1}, "eu": {"replicas": 2}},
        "emulator": {"time_scale": 0.05, "extra_args": ["--max-num-seqs", "2"]},
        "latency": {"rtt_ms": {"us-eu": 80}},
        "workload": {"trace": None, "region_weights": {"us": 0.8, "eu": 0.2}, "synthetic_conversations": 8,
                     "synthetic_turns": 2, "request_timeout_s": 60},
    }
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _smallest_config(tmp_path: Path) -> Path:
    """The quickest deployment to start: one region, one emulated replica (controller, emulator, latency proxy,
    balancer), replaying one short request."""
    cfg = {"balancer": {"probe_interval_ms": 50}, "regions": {"us": {"replicas": 1}}, "emulator": {"time_scale": 0.05},
           "workload": {"trace": None, "synthetic_conversations": 1, "synthetic_turns": 1, "request_timeout_s": 30}}
    path = tmp_path / "smallest.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped by its parent.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids(run_dir: Path) -> list[int]:
    return [int(line.split()[0]) for line in (run_dir / "pids").read_text().splitlines()]


def test_local_deployment_replays_forwards_and_stops_everything(tmp_path):
    """A local run serves every request, forwards us overflow to eu, writes the report, leaves no process."""
    run_dir = tmp_path / "run"
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "skylb", "local", "--config", str(_config(tmp_path)),
                           "--run-dir", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    total = doc["report"]["total"]
    assert total["sent"] == total["completed"] > 0 and total["failed"] == 0
    assert doc["report"]["regions"]["us"]["forwarded"].get("eu", 0) > 0
    assert "[ok] forwarded TTFT includes the round trip" in proc.stdout
    pids = _pids(run_dir)
    assert len(pids) == 6  # controller, 2 emulators, latency proxy, 2 balancers
    assert not [p for p in pids if _alive(p)]


def test_what_local_prints_says_where_the_pages_are_and_its_ctl_line_runs_as_pasted(tmp_path, monkeypatch):
    """The printed skylb-ctl line runs from a shell whose PATH lacks the venv (not activated); the page lines give
    the controller's and each balancer's page address and the token files whose content the login form wants."""
    from bench.launch.local import Deployment
    from skylb.config import load_config

    # The line is printed for the launcher's own shell: here one without the venv, also when the shell that runs the
    # tests has it activated (the line would then say a bare `skylb-ctl`, right there and not found here).
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    deployment = Deployment(load_config(_smallest_config(tmp_path)), tmp_path / "run")
    deployment.controller_url, deployment.balancer_urls = "http://127.0.0.1:1", {"us": "http://127.0.0.1:2"}
    out = subprocess.run(deployment.ctl_command("--help"), shell=True, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "usage: skylb-ctl" in out.stdout, out.stderr
    controller, balancers = deployment.page_lines()
    assert "http://127.0.0.1:1/" in controller and str(tmp_path / "run" / "admin-token") in controller
    assert "us=http://127.0.0.1:2/" in balancers and str(tmp_path / "run" / "peer-token") in balancers


def test_local_stops_every_process_on_ctrl_c(tmp_path):
    """Ctrl-C (SIGINT) on the launcher stops every process it started, also when an impatient user presses it
    again 0.3 s later: no traceback on stderr or stdout, nothing left running in any process group it started."""
    run_dir = tmp_path / "run"
    stderr = open(tmp_path / "stderr", "w+")  # a file: never a full pipe while stdout is read
    # As from a terminal: SIGINT at its default. A suite started in the background by a shell without job control
    # (`make test &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored, so Ctrl-C would do
    # nothing there, as for any background job.
    launcher = subprocess.Popen([sys.executable, "-m", "skylb", "local", "--config", str(_smallest_config(tmp_path)),
                                 "--run-dir", str(run_dir), "--keep-running", "--max-requests", "1"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, printed = time.monotonic() + 120, []
        for line in launcher.stdout:  # bounded by the deadline and by the launcher's own output
            printed.append(line)
            if "deployment is up" in line or time.monotonic() > deadline:
                break
        assert any("status pages of the balancers" in line for line in printed), printed
        pids = _pids(run_dir)
        assert len(pids) == 4 and all(_alive(p) for p in pids)  # controller, emulator, latency proxy, balancer
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.3)
        launcher.send_signal(signal.SIGINT)
        # communicate() reads the rest of the output while waiting: the launcher never blocks on a full pipe.
        try:
            rest, _ = launcher.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            launcher.send_signal(signal.SIGUSR1)  # the launcher prints its threads' stacks (faulthandler)
            try:
                rest, _ = launcher.communicate(timeout=5)
            except subprocess.TimeoutExpired as exc:
                rest = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
            stderr.seek(0)
            pytest.fail(f"skylb local did not stop within 90 s of Ctrl-C; its output:\n{rest[-3000:]}\n"
                        f"its stderr and stacks:\n{stderr.read()[-6000:]}")
        stderr.seek(0)
        errors = stderr.read()
        assert launcher.returncode == 130, errors[-3000:]
        assert "Traceback" not in errors and "Traceback" not in rest, errors[-3000:]
        assert rest.rstrip().endswith("[skylb local] every process stopped"), rest[-1000:]
        time.sleep(0.2)
        assert not [p for p in pids if _alive(p)]
        assert alive_in_groups(set(pids)) == []  # each process led its own group: its children too
    finally:
        stderr.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_region_that_only_took_overflow_counts_as_serving():
    """"Every region served" counts where requests were served: asia sent nothing but served forwarded requests;
    a region whose replicas served nothing fails the check."""
    from skylb.config import load_config
    from bench.launch.demo import deployment_checks

    cfg = load_config(None)
    records = [{"region": "us", "route": "local", "error": None, "ttft_ms": 50.0},
               {"region": "us", "route": "peer:asia", "error": None, "ttft_ms": 400.0},
               {"region": "eu", "route": "local", "error": None, "ttft_ms": 40.0}]
    doc = {"records": records, "report": {"total": {"sent": 3, "completed": 3, "failed": 0}}}
    checks = {name: (ok, evidence) for name, ok, evidence in deployment_checks(doc, cfg)}
    ok, evidence = checks["every region served requests"]
    assert ok and "us 1, eu 1, asia 1" in evidence and "sent from: us 2, eu 1, asia 0" in evidence
    doc["records"] = records[:1] + records[2:]
    assert not dict((n, ok) for n, ok, _ in deployment_checks(doc, cfg))["every region served requests"]


def test_workload_typo_is_a_config_error_before_anything_starts(tmp_path):
    """A misspelt key in the workload section fails `skylb local` with exit status 2, naming the file and the key."""
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"workload": {"trace": None, "window": 10}}))
    proc = subprocess.run([sys.executable, "-m", "skylb", "local", "--config", str(path),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "typo.yaml: workload.window: Extra inputs are not permitted" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_local_dns_clients_resolve_their_own_balancer(tmp_path):
    """`skylb local --dns`: named answers the service name per region (eu clients -> 127.0.0.11, us -> .12), every
    request goes through the name from its region's source address and completes, a request served locally was
    served by its own region's balancer, the controller's config carries the views' keys, nothing outlives it."""
    require_binary("named")
    run_dir = tmp_path / "run"
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "skylb", "local", "--dns", "--config", str(_config(tmp_path)),
                           "--run-dir", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if "resolves to each region's balancer" in x)
    assert line.strip().startswith("[ok] llm.skylb.test. resolves"), line
    # region i (config order, here eu then us) resolves from 127.0.(11+i).1 to its balancer 127.0.0.(11+i)
    assert set(re.findall(r"(\w+) clients \(127\.0\.(\d+)\.1\) -> 127\.0\.0\.(\d+)", line)) == {
        ("eu", "11", "11"), ("us", "12", "12")}
    doc = json.loads(out.read_text())
    assert set(doc["balancers"].values()) == {doc["balancers"]["us"]}
    assert doc["balancers"]["us"].startswith("http://llm.skylb.test:")
    total = doc["report"]["total"]
    assert total["sent"] == total["completed"] > 0 and total["failed"] == 0
    local = [r for r in doc["records"] if r["route"] == "local"]
    assert local and all(r["served_by"].split("/")[0] == r["region"] for r in local)
    dns = yaml.safe_load((run_dir / "config.yaml").read_text())["controller"]["dns"]
    assert set(dns["keys"]) == {"us", "eu"} and dns["name"] == "llm.skylb.test."
    pids = _pids(run_dir)
    assert len(pids) == 7  # named, controller, 2 emulators, latency proxy, 2 balancers
    assert not [p for p in pids if _alive(p)]
