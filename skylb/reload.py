"""Reload without restart: SIGHUP, or a change of a watched file, calls a process's reload function.

The convention of daemons (nginx, HAProxy's master, systemd's ``ExecReload=/bin/kill -HUP $MAINPID``): SIGHUP re-reads
the configuration and the key files. Files are also watched by polling, every ``poll_s`` seconds, each one's resolved
path (symlinks followed), inode, size and modification time, so a file replaced by rename, edited in place, or swapped
as Kubernetes swaps a mounted ConfigMap or Secret (the ``..data`` symlink moved to a new directory; Kubernetes
documentation, "ConfigMaps", "Mounted ConfigMaps are updated automatically") is picked up without a signal. Polling a
few ``stat`` calls is bounded and portable; inotify misses the ConfigMap swap unless it watches the directory.

The reload function decides what it can apply; it must validate everything before it changes anything, so that an
invalid file keeps the running configuration (it logs why). Requests in flight are never touched by a reload.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import structlog

__all__ = ["Reloader", "file_signature", "changed_keys", "POLL_S"]

#: Seconds between two polls of the watched files.
POLL_S = 2.0

log = structlog.get_logger("skylb.reload")


def file_signature(paths: list[str]) -> tuple:
    """What tells a change of ``paths``: per path, its resolved path, inode, size and mtime (ns), or None when it
    cannot be read (missing: a ConfigMap swap in progress, say)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((path, os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((path, None))
    return tuple(out)


def changed_keys(old: dict, new: dict, *, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two settings dumps (nested mappings compared key by key)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, prefix=f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


class Reloader:
    """Calls ``reload(reason)`` on SIGHUP (reason "sighup") and when a watched file changes ("file_changed").

    Args:
        reload: applies the files as they are now; it logs its own outcome. An exception it raises is logged as
            ``reload_failed`` and the process goes on with what it runs.
        paths: returns the files to watch (asked again after each reload, as a reload may name other files).
        poll_s: seconds between two polls; 0 turns polling off (SIGHUP only).
    """

    def __init__(self, reload: Callable[[str], None], paths: Callable[[], list[str]], *, poll_s: float = POLL_S):
        self.reload = reload
        self.paths = paths
        self.poll_s = poll_s
        self.reloads = 0
        self._signature = file_signature(paths())
        self._task: asyncio.Task | None = None
        self.started = False

    def start(self) -> None:
        """Install the SIGHUP handler and start polling (inside the running event loop)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.trigger, "sighup")
        self.started = True
        if self.poll_s > 0:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        """Remove the handler and stop polling."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def trigger(self, reason: str) -> None:
        """Reload now (synchronously: no request handler runs meanwhile, and none is touched)."""
        self.reloads += 1
        log.info("reload_started", reason=reason)
        try:
            self.reload(reason)
        except Exception as exc:  # a reload must never take the process down
            log.exception("reload_failed", reason=reason, error=str(exc))
        self._signature = file_signature(self.paths())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            signature = file_signature(self.paths())
            # A file missing for a moment (mid-swap) is not a change to act on: wait until it is back.
            if signature != self._signature and all(entry[1] is not None for entry in signature):
                self.trigger("file_changed")
