"""What the machine did during a measurement: other processes' CPU time, load averages, replicas' pending requests.

:class:`MachineLoad` brackets a measurement window; :func:`conditions_lines` turns its summaries into a report's
"Conditions" section; :func:`process_cpu_s` reads one process's CPU time; :class:`PendingSampler` polls the
replicas' ``vllm:num_requests_waiting`` while a replay runs. Linux only (reads /proc).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

__all__ = ["BUSY_FRACTION", "MachineLoad", "conditions_lines", "process_cpu_s", "PendingSampler"]

#: Other processes' share of the machine above which a row is flagged as measured under load.
BUSY_FRACTION = 0.2


class MachineLoad:
    """What else ran on this machine during a measurement: load averages and other processes' CPU time.

    ``start()`` snapshots every process's CPU time; ``stop()`` returns ``{"loadavg_start", "loadavg_end",
    "wall_s", "others_cpu_s", "others_cpu_frac", "top_others", "steal_frac"}`` where ``others_cpu_s`` is the CPU
    time (s) used during the window by processes that existed at both snapshots, other than this one (so not by
    the processes the benchmark started, which are gone by then), ``others_cpu_frac`` that time / (wall time x CPU
    cores), ``top_others`` the three largest as "command: seconds", and ``steal_frac`` the share of the machine's
    CPU time the hypervisor gave to others (/proc/stat "steal").
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._cpu0: dict[int, tuple[str, float]] = {}
        self._load0 = ""
        self._stat0: list[int] = []

    def start(self) -> "MachineLoad":
        """Take the first snapshot; returns self."""
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_times()
        self._load0 = _loadavg()
        self._stat0 = _proc_stat()
        return self

    def stop(self) -> dict[str, Any]:
        """Take the second snapshot and return the summary (see the class docstring)."""
        wall = time.monotonic() - self._t0
        cpu1 = _cpu_times()
        me = os.getpid()
        used = {}
        for pid, (cmd, t1) in cpu1.items():
            if pid == me or pid not in self._cpu0 or self._cpu0[pid][0] != cmd:
                continue
            delta = t1 - self._cpu0[pid][1]
            if delta > 0:
                used[f"{cmd}[{pid}]"] = delta
        total = sum(used.values())
        top = sorted(used.items(), key=lambda kv: -kv[1])[:3]
        stat1 = _proc_stat()
        ticks = [b - a for a, b in zip(self._stat0, stat1)]
        steal = ticks[7] / sum(ticks) if len(ticks) > 7 and sum(ticks) > 0 else 0.0
        return {
            "loadavg_start": self._load0, "loadavg_end": _loadavg(), "wall_s": wall,
            "others_cpu_s": total, "others_cpu_frac": total / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0,
            "top_others": [f"{k}: {v:.1f} s" for k, v in top], "steal_frac": steal,
        }


def _proc_stat() -> list[int]:
    """The machine's CPU time counters (ticks: user nice system idle iowait irq softirq steal ...)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def conditions_lines(whole: dict[str, Any], windows: list[tuple[str, dict[str, Any]]], sharing: str) -> list[str]:
    """The "Conditions" section of a report: the machine, load averages, other processes' CPU use.

    ``whole``: the MachineLoad summary of the whole run; ``windows``: (label, summary) of each measurement window.
    Other processes' CPU is summed over the windows (a process that ended mid-run counts in its window only).
    """
    others = sum(w["others_cpu_s"] for _, w in windows) if windows else whole["others_cpu_s"]
    wall = sum(w["wall_s"] for _, w in windows) if windows else whole["wall_s"]
    frac = others / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
    lines = ["## Conditions", "",
             f"- Machine: {os.cpu_count()} CPU cores, no GPU; {sharing}.",
             f"- Load average (1/5/15 min) at start / end: {whole['loadavg_start']} / {whole['loadavg_end']}. "
             f"Other processes (other engineers' tests, the system) used {others:.0f} CPU-s during the "
             f"measurement windows ({100 * frac:.0f}% of the machine)."]
    if windows:
        lines.append("- Per window: " + "; ".join(
            f"{label}: load {w['loadavg_start']} -> {w['loadavg_end']}, others {100 * w['others_cpu_frac']:.0f}%"
            + (f" ({', '.join(w['top_others'][:2])})" if w["others_cpu_frac"] > BUSY_FRACTION else "")
            + (f", steal {100 * w['steal_frac']:.0f}%" if w.get("steal_frac", 0) >= 0.01 else "")
            for label, w in windows) + ".")
    return [*lines, ""]


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (command name, user + system CPU seconds) of every process readable in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # comm is in parentheses and may hold spaces; the fields after it are space-separated.
        cmd = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(entry.name)] = (cmd, (int(fields[11]) + int(fields[12])) / tick)
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (all its threads); 0.0 when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PendingSampler:
    """Polls every replica's /metrics for ``vllm:num_requests_waiting`` while a replay runs.

    Args:
        replica_urls: the replicas' base URLs. interval_s: time between two polls of all replicas, s.

    After ``stop()``: ``peak`` = per replica the largest pending count seen; ``mean_total`` = the pending
    requests summed over replicas, averaged over the polls (requests).
    """

    def __init__(self, replica_urls: Sequence[str], *, interval_s: float = 0.1):
        self.replica_urls = list(replica_urls)
        self.interval_s = interval_s
        self.peak = [0] * len(self.replica_urls)
        self._sums: list[int] = []
        self._task: asyncio.Task | None = None

    @property
    def mean_total(self) -> float:
        """Mean over polls of the summed pending requests (0.0 before any poll)."""
        return sum(self._sums) / len(self._sums) if self._sums else 0.0

    def start(self) -> None:
        """Start polling in the running event loop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                values = await asyncio.gather(*(self._one(session, u) for u in self.replica_urls))
                if all(v is not None for v in values):
                    self._sums.append(sum(values))
                for i, v in enumerate(values):
                    if v is not None:
                        self.peak[i] = max(self.peak[i], v)
                await asyncio.sleep(self.interval_s)

    @staticmethod
    async def _one(session: aiohttp.ClientSession, url: str) -> int | None:
        try:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)
