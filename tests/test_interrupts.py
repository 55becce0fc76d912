"""A command that starts processes (bench/launch/procs.py's ProcGroup under bench/launch/interrupts.py, as `skylb local` and the
live `skylb bench` runs) stops all of them whatever signals arrive: a second Ctrl-C 0.3 s after the first, or SIGINT
after SIGTERM, lands in the middle of the stop and neither prints a traceback nor leaves a process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import alive_in_groups

ROOT = Path(__file__).resolve().parents[1]

#: A launcher as the commands are: it starts children until interrupted. Each child takes 0.3 s to stop after
#: SIGTERM (a shell trap), so the whole stop lasts seconds and the second signal arrives during it.
LAUNCHER = """
import sys, time
from pathlib import Path
from bench.launch import interrupts
from bench.launch.procs import ProcGroup

CHILD = ["sh", "-c", "trap 'sleep 0.3; exit 0' TERM; while :; do sleep 0.05; done"]
try:
    interrupts.stop_on_signals()
    with ProcGroup(Path(sys.argv[1]), pid_file=Path(sys.argv[2])) as group:
        for i in range(60):
            group.start(CHILD, name=f"child-{i}")
            if i == 5:
                print("started", flush=True)
            time.sleep(0.05)
        time.sleep(60)
except KeyboardInterrupt:
    interrupts.stopping()
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["sigint-twice", "sigterm-then-sigint"])
def test_a_second_signal_during_the_stop_leaves_no_process_and_no_traceback(tmp_path, first):
    """The first signal ends the run; SIGINT 0.3 s later arrives while the children are being stopped: exit 130,
    no traceback, every child started is recorded and none is left (by process group)."""
    pid_file = tmp_path / "pids"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"), str(pid_file)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's
    try:
        assert launcher.stdout.readline().strip() == "started"
        launcher.send_signal(first)
        time.sleep(0.3)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
        pgids = {int(line.split()[0]) for line in pid_file.read_text().splitlines()}
        assert launcher.returncode == 130 and "interrupted" in out, (launcher.returncode, out, err)
        assert "Traceback" not in err, err
        assert len(pgids) >= 6 and len(pgids) == len(list((tmp_path / "logs").glob("child-*.log")))
        time.sleep(0.1)
        assert alive_in_groups(pgids) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pgid in {int(line.split()[0]) for line in pid_file.read_text().splitlines()} if pid_file.exists() else ():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_once_stopping_the_signals_are_ignored_by_the_operating_system():
    """After ``stopping()`` SIGINT and SIGTERM are ignored at the operating system's level, not only by the handler:
    Python puts its own handlers back to the default while the interpreter exits, so a second Ctrl-C landing then
    (after a stop of well under 0.3 s) ended `skylb local` by SIGINT instead of with status 130."""
    from bench.launch import interrupts
    before = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
    try:
        interrupts.stop_on_signals()
        assert all(signal.getsignal(signum) is not signal.SIG_IGN for signum in interrupts.SIGNALS)
        interrupts.stopping()
        assert all(signal.getsignal(signum) is signal.SIG_IGN for signum in interrupts.SIGNALS)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        interrupts._owner.update(pid=None, ending=False)
