"""A follow-the-sun day from the real Mooncake trace: each region's load peaks in its own working hours.

Source: SkyLB paper §2.2 (Fig. 2: each region's load follows its local day, so regions peak at different times)
and §5.2 ("Diurnal pattern"). Built in three steps:

1. Requests: the first ``trace_s`` seconds of the Mooncake trace through ``bench.sim.workloads.mooncake`` (prompts
   scaled by 1/8, outputs capped at 1,024, as every Mooncake scenario), sessions derived by bench/replay/workload.py and
   each session drawn into one region (equal weights over the regions, seeded), so a session's turns all come from
   one region and keep their order.
2. Rate curve of a region, per hour of its local time h (local = UTC + the region's offset, bench/sim/geo.py):

       rate(h) = FLOOR + (1 - FLOOR) x cos^4(pi x (h - PEAK_H) / 24),   FLOOR = 0.1, PEAK_H = 14

   a peak at 14:00, half the peak from about 09:40 to 18:20, a night floor of 10% of the peak at 02:00; its mean
   over a day is FLOOR + (1 - FLOOR) x 3/8 = 0.4375 of the peak, so the peak is 2.29x the region's mean.
3. Re-timing: 24 h are compressed into ``day_s`` simulated seconds, starting at the UTC hour where the sum of the
   regions' rates is lowest (the day starts quiet). A request at trace time t in region r is sent at
   Lambda_r^-1(t / trace_s x Lambda_r(day_s)), Lambda_r the integral of r's rate over simulated time: a monotone
   warp, so the trace's own arrival bursts and each session's order survive, and r's rate follows its curve.

Units: seconds of simulated time unless a name says hours (``_h``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.sim.geo import REGIONS, Region
from bench.sim.workloads import SimRequest, Workload, mooncake

__all__ = ["FLOOR", "PEAK_H", "rate", "start_utc_h", "local_hour", "follow_the_sun", "peak_windows"]

FLOOR = 0.1
PEAK_H = 14.0
#: Grid steps per simulated day for the integral of the rate (fine enough that re-timing error is < 0.1%).
_GRID = 4800


def rate(local_h: float) -> float:
    """The relative request rate at local hour ``local_h`` (0-24, wraps), 1 at the peak (module docstring)."""
    return FLOOR + (1.0 - FLOOR) * math.cos(math.pi * (local_h - PEAK_H) / 24.0) ** 4


def start_utc_h(regions: Sequence[Region] = REGIONS) -> float:
    """The UTC hour (to 0.1 h) at which the sum of ``regions``' rates is lowest: where the simulated day starts."""
    hours = [h / 10 for h in range(240)]
    return min(hours, key=lambda h: sum(rate(h + r.utc_offset_h) for r in regions))


def local_hour(region: Region, t_s: float, day_s: float, start_h: float) -> float:
    """``region``'s local hour (0-24) at simulated time ``t_s`` of a day compressed into ``day_s`` seconds."""
    return (start_h + 24.0 * t_s / day_s + region.utc_offset_h) % 24.0


def _cumulative(region: Region, day_s: float, start_h: float) -> list[float]:
    """Lambda at the grid points k x day_s / _GRID (trapezoid rule), k = 0.._GRID."""
    step = day_s / _GRID
    values = [rate(local_hour(region, k * step, day_s, start_h)) for k in range(_GRID + 1)]
    out = [0.0]
    for a, b in zip(values, values[1:]):
        out.append(out[-1] + (a + b) * step / 2)
    return out


def _warp(cum: list[float], fraction: float, day_s: float) -> float:
    """Lambda^-1(fraction x Lambda(day_s)): the simulated time where that share of the day's requests was sent."""
    target = fraction * cum[-1]
    k = min(max(bisect.bisect_left(cum, target), 1), len(cum) - 1)
    lo, hi = cum[k - 1], cum[k]
    within = (target - lo) / (hi - lo) if hi > lo else 0.0
    return (k - 1 + within) * day_s / _GRID


def follow_the_sun(*, seed: int, trace: str | Path, trace_s: float, day_s: float,
                   regions: Sequence[Region] = REGIONS) -> Workload:
    """The day's requests, open loop, sorted by send time (module docstring); raises FileNotFoundError."""
    names = [r.name for r in regions]
    base = mooncake(seed=seed, path=trace, window_s=trace_s, regions=names,
                    region_weights={n: 1.0 for n in names})
    start = start_utc_h(regions)
    cums = {r.name: _cumulative(r, day_s, start) for r in regions}
    arrivals = [replace(r, arrival_s=min(_warp(cums[r.region], r.arrival_s / trace_s, day_s), day_s * (1 - 1e-9)))
                for r in base.arrivals]
    arrivals.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload("follow_the_sun", f"Mooncake trace [0, {trace_s:g} s), {len(arrivals)} requests, one day over "
                    f"{len(regions)} regions in {day_s:g} s from {start:.1f} h UTC", arrivals=arrivals)


def peak_windows(region: Region, day_s: float, start_h: float, *, level: float = 0.5) -> list[tuple[float, float]]:
    """Simulated-time intervals (s) where ``region``'s rate is at least ``level`` of its peak (its busy hours)."""
    out: list[tuple[float, float]] = []
    step = day_s / _GRID
    begin = None
    for k in range(_GRID + 1):
        busy = k < _GRID and rate(local_hour(region, k * step, day_s, start_h)) >= level
        if busy and begin is None:
            begin = k * step
        elif not busy and begin is not None:
            out.append((begin, k * step))
            begin = None
    return out
