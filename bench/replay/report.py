"""What a replay measured: one record per request, and the per-region report built from the records.

The metrics follow the SkyLB paper §5: service throughput, TTFT and end-to-end latency percentiles, and the prefix
(KV cache) hit rate = cached prompt tokens / prompt tokens, here as reported by the engine in
``usage.prompt_tokens_details.cached_tokens``. Routing comes from the balancer's response headers:
``X-SkyLB-Route`` (``local`` or ``peer:<region>``) and ``X-SkyLB-Served-By`` (``<region>/<replica id>``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tabulate import tabulate

from bench.reporting.provenance import provenance, provenance_line

__all__ = [
    "RequestRecord", "percentile", "parse_route", "build_report", "format_table", "markdown_table", "write_json",
    "emit_markdown", "with_provenance"]


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one replayed request: completed (``error is None``) or failed, never both.

    Attributes:
        id, region, session_id, turn: from the workload request (region = the client's region).
        sent_s: when it was sent, s after the replay started; None if it was never sent (replay deadline).
        ttft_ms: time from sending to the first SSE chunk carrying text, ms; None if no text arrived.
        e2e_ms: time from sending to the end of the response (``[DONE]``, an error, or the timeout), ms.
        prompt_tokens: ``usage.prompt_tokens`` when reported, else the workload's prompt length (tokens).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``; None when not reported.
        completion_tokens: ``usage.completion_tokens`` when reported, else the words of text received.
        status: HTTP status of the response; None when no response arrived.
        error: why it failed (HTTP status and body, an SSE error chunk, a timeout, ...); None when completed.
        route: the ``X-SkyLB-Route`` header of the balancer the client called; None when absent.
        served_by: the ``X-SkyLB-Served-By`` header; None when absent.
        rule: the ``X-SkyLB-Rule`` header (the routing profile's plugin that chose the route); None when absent.
        response_id: the completion's ``id`` (the engine's request id, which its request log names); None when no
            chunk carried one.
    """

    id: str
    region: str
    session_id: str = ""
    turn: int = 0
    sent_s: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    route: str | None = None
    served_by: str | None = None
    response_id: str | None = None
    rule: str | None = None

    @property
    def ok(self) -> bool:
        """True when the request completed (status 2xx, no error chunk, stream finished)."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict, with ``ok`` added."""
        return asdict(self) | {"ok": self.ok}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def parse_route(route: str | None) -> str | None:
    """The peer region a request was forwarded to ("peer:eu" -> "eu"), "" for "local", None for absent/unknown."""
    if route == "local":
        return ""
    if route and route.startswith("peer:") and len(route) > 5:
        return route[5:]
    return None


def _stats(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Counts, latency percentiles (ms), throughput (per s of wall time) and hit rate of some records."""
    done = [r for r in records if r.ok]
    forwarded: dict[str, int] = {}
    local = unknown = 0
    # Routing and latency are counted over completed requests only: a failed request's latency says little.
    for r in done:
        peer = parse_route(r.route)
        if peer is None:
            unknown += 1
        elif peer == "":
            local += 1
        else:
            forwarded[peer] = forwarded.get(peer, 0) + 1
    ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
    ttft_local = [r.ttft_ms for r in done if r.ttft_ms is not None and parse_route(r.route) == ""]
    ttft_fwd = [r.ttft_ms for r in done if r.ttft_ms is not None and parse_route(r.route)]
    e2e = [r.e2e_ms for r in done if r.e2e_ms is not None]
    by_rule: dict[str, list[float]] = {}
    for r in done:
        if r.rule is not None:
            by_rule.setdefault(r.rule, []).append(r.ttft_ms)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    output = sum(r.completion_tokens or 0 for r in done)
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    return {
        "sent": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "local": local,
        "forwarded": dict(sorted(forwarded.items())),
        "forwarded_total": sum(forwarded.values()),
        "route_unknown": unknown,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p50_local_ms": percentile(ttft_local, 50),
        "ttft_p50_forwarded_ms": percentile(ttft_fwd, 50),
        "rules": {rule: {"completed": len(times), "ttft_p90_ms": percentile([t for t in times if t is not None], 90)}
                  for rule, times in sorted(by_rule.items())},
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p90_ms": percentile(e2e, 90),
        "throughput_rps": per_s(len(done)),
        "output_tokens_per_s": per_s(output),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "prefix_hit_rate": cached / prompt if prompt else None,
    }


def build_report(records: Iterable[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The report of a replay: ``{"wall_s", "regions": {region: stats}, "total": stats, "errors": {msg: n}}``.

    ``records``: one per request. ``wall_s``: the replay's wall time, s (throughputs are per second of it).
    Stats of a group: sent / completed / failed; ``local``, ``forwarded`` {peer: n}, ``forwarded_total`` and
    ``route_unknown`` (completed requests by ``X-SkyLB-Route``); ``ttft_p50_ms``, ``ttft_p90_ms``,
    ``ttft_p50_local_ms``, ``ttft_p50_forwarded_ms``, ``e2e_p50_ms``, ``e2e_p90_ms`` (ms, completed requests);
    ``rules``: {``X-SkyLB-Rule``: {"completed", "ttft_p90_ms"}} over the completed requests that carried one;
    ``throughput_rps`` (completed requests / s), ``output_tokens_per_s``; ``prompt_tokens``, ``cached_tokens``,
    ``output_tokens`` and ``prefix_hit_rate`` (cached / prompt tokens, 0..1). Values with no data are None.
    ``errors``: the 10 most frequent error messages (first 200 characters) with their counts.
    """
    records = list(records)
    by_region: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_region.setdefault(r.region, []).append(r)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = r.error[:200]
            errors[key] = errors.get(key, 0) + 1
    top = dict(sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))[:10])
    return {
        "wall_s": wall_s,
        "regions": {region: _stats(rs, wall_s) for region, rs in sorted(by_region.items())},
        "total": _stats(records, wall_s),
        "errors": top,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _row(name: str, s: dict[str, Any]) -> list[Any]:
    fwd = " ".join(f"{peer}:{n}" for peer, n in s["forwarded"].items()) or "0"
    rate = s["prefix_hit_rate"]
    rps, tps = s["throughput_rps"], s["output_tokens_per_s"]
    return [
        name, s["sent"], s["completed"], s["failed"], s["local"], fwd,
        f"{_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p90_ms'])}",
        f"{_ms(s['ttft_p50_local_ms'])} / {_ms(s['ttft_p50_forwarded_ms'])}",
        f"{_ms(s['e2e_p50_ms'])} / {_ms(s['e2e_p90_ms'])}",
        "-" if rps is None else f"{rps:.2f}",
        "-" if tps is None else f"{tps:.0f}",
        "-" if rate is None else f"{100 * rate:.1f}%",
    ]  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table: one row per client region and a total row, then the wall time, the ideal prefix
    hit rate beside the achieved one (when the report has ``ideal_prefix_hit_rate``, bench/sim/ideal.py) and the top
    errors."""
    headers = [
        "region", "sent", "ok", "failed", "local", "forwarded", "TTFT p50/p90 ms", "TTFT p50 local/fwd ms",
        "E2E p50/p90 ms", "req/s", "out tok/s", "prefix hit",
    ]  # fmt: skip
    rows = [_row(region, s) for region, s in report["regions"].items()]
    rows.append(_row("total", report["total"]))
    lines = [tabulate(rows, headers=headers, tablefmt="simple"), f"wall time {report['wall_s']:.1f} s"]
    ideal, achieved = report.get("ideal_prefix_hit_rate"), report["total"]["prefix_hit_rate"]
    if ideal is not None:
        lines.append(f"prefix hit {'-' if achieved is None else f'{100 * achieved:.1f}%'} of an ideal "
                     f"{100 * ideal:.1f}% (these requests through an infinite cache on one replica: a limit no "
                     "policy can pass)")
    rules = report["total"].get("rules")
    if rules:
        lines.append("by rule (X-SkyLB-Rule), completed / TTFT p90 ms: " + ", ".join(
            f"{rule} {s['completed']} / {_ms(s['ttft_p90_ms'])}" for rule, s in rules.items()))
    for message, n in report.get("errors", {}).items():
        lines.append(f"  {n} x {message}")
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (tabulate's ``github`` format) of already formatted cells.

    Cells are printed as given (``str()``; tabulate's number parsing is off, so "1.50" stays "1.50" and "1,000"
    stays "1,000"); a row shorter than ``headers`` is padded with empty cells. A "|" inside a cell is not escaped:
    callers replace it when the text is free-form.
    """
    rows = [[str(c) for c in row] + [""] * (len(headers) - len(row)) for row in rows]
    return tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=True)


def emit_markdown(text: str, result: dict[str, Any], *, out_md: str | None, out_json: str | None) -> None:
    """Print a benchmark's Markdown report and write it to ``out_md`` (and ``result`` as JSON to ``out_json``).

    Both carry the run's provenance (bench/reporting/provenance.py: commit, date, command, machine): ``result`` gets a
    ``"provenance"`` entry unless it has one, and its line goes under the report's title.
    """
    prov = result.setdefault("provenance", provenance())
    text = with_provenance(text, prov)
    print(text)
    if out_md:
        Path(out_md).parent.mkdir(parents=True, exist_ok=True)
        Path(out_md).write_text(text)
    if out_json:
        write_json(result, out_json)


def with_provenance(text: str, prov: dict[str, Any]) -> str:
    """``text`` with the provenance line (bench/reporting/provenance.py) after its first line (the title), unless present."""
    line = provenance_line(prov)
    if line in text:
        return text
    head, _, rest = text.partition("\n")
    rest = rest.lstrip("\n")
    return f"{head}\n\n{line}\n\n{rest}" if rest else f"{head}\n\n{line}\n"


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``report`` (any JSON-ready dict) to ``path``, indented, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path
