"""`ProcGroup.skylb` starts a process as `python -m skylb` would, whether it forks it from the preloaded server
(bench/launch/forkstart.py, the suite's default) or exec's it (SKYLB_TEST_EXEC=1): its own environment, working directory,
log, process group and exit status."""

from __future__ import annotations

import os
import secrets
import signal

import requests

from bench.launch import forkstart
from tests.procs import free_port


def test_a_started_skylb_gets_its_environment_directory_log_group_and_exit_status(procs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the controller's default database is relative to its working directory
    token = secrets.token_urlsafe(32)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.skylb("controller", "--port", str(port), name="controller", wait_url=f"{url}/healthz",
                       env={"SKYLB_ADMIN_TOKEN": token})
    assert isinstance(proc.popen, forkstart.ForkedPopen) == forkstart.enabled()
    assert os.getpgid(proc.popen.pid) == proc.popen.pid  # its own group: teardown's killpg reaches its children
    assert (tmp_path / ".skylb-run" / "controller.sqlite").exists()
    # The admin token from its environment guards writes: none is 401, the right one reaches the (unknown) replica.
    assert requests.delete(f"{url}/v1/replicas/nobody", timeout=5).status_code == 401
    assert requests.delete(f"{url}/v1/replicas/nobody", headers={"Authorization": f"Bearer {token}"},
                           timeout=5).status_code == 404
    assert "controller_started" in proc.log()
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0 and proc.popen.poll() == 0
    assert "controller_stopped" in proc.log()

    usage = procs.skylb("controller", "--port", "not-a-port", name="usage")
    assert usage.popen.wait(timeout=10) == 2 and "invalid int value: 'not-a-port'" in usage.log()  # stderr too
    killed = procs.skylb("emulator", "--engine", "vllm", "--model", "m", "--port", str(free_port()), name="killed")
    killed.kill()
    assert killed.popen.returncode == -signal.SIGKILL
