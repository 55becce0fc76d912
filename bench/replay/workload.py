"""Workloads to replay: a Mooncake trace turned into text, sessions and regions, or synthetic conversations.

Token convention (shared with the engine emulator, the simulator and the balancer): ONE TOKEN = ONE
WHITESPACE-SEPARATED WORD OF 3 CHARACTERS. A prompt of ``prompt_tokens`` tokens is a string of exactly that many
words joined by single spaces, so the emulator counts prompt and cached tokens without a tokenizer, and the
balancer's characters / 4 estimate (skylb/core/estimate.py ``text_tokens``) gives the same number (:data:`VOCABULARY`).

Mooncake trace (format: shared/traces/NOTICE.md; DESIGN.md "Workloads"): each line has ``timestamp`` (ms),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (ids of the prompt's 512-token blocks). The trace
has no text, users or regions, so they are derived here:

* Text: block ``i`` of a prompt is ``block_words`` words drawn from ``random.Random(f"block-{id}")`` over a fixed
  vocabulary, so equal ids at equal positions give equal text and the trace's prefix sharing survives. The last
  block is cut (or, after rounding, stretched) so the word count equals the (scaled) ``input_length``; a cut block
  is a prefix of the full block, because the words come from the same seeded sequence.
* Sessions: request B continues the session of an earlier request A when A's *full* blocks (A's last block is
  dropped when it is partial, i.e. input_length < len(hash_ids) * 512) are a prefix of B's hash_ids and that
  shared prefix is at least 2 blocks long. Block 0 alone does not count: it is the system prompt nearly every
  request shares. Among several such A, the one sharing the most blocks wins (ties: the latest). A request with
  no such A starts a new session. Sessions are derived over the whole trace up to the end of the window, so a
  window that starts mid-conversation keeps the conversation's session id.
* Regions: each session is assigned to one region, drawn with ``region_weights`` from a generator seeded by
  ``(seed, session id)``; every request of the session goes to that region.

Synthetic conversations (no trace): see :func:`synthetic_workload`. Closed-loop clients running the trace's
sessions one request at a time (bench/replay/run.py ``replay_sessions``): see :func:`trace_sessions`.

What to replay comes from the ``workload`` section of the deployment YAML: :class:`WorkloadConfig` validates it
(unknown keys are errors), :func:`workload_settings` reads it from a loaded config.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skylb.config import ConfigError, DeploymentConfig

__all__ = [
    "WorkloadConfig",
    "workload_settings",
    "Request",
    "TraceRow",
    "TraceError",
    "TRACE_BLOCK_TOKENS",
    "VOCABULARY",
    "ROLE_MARKERS",
    "block_text",
    "prompt_from_blocks",
    "read_trace",
    "derive_sessions",
    "region_weights",
    "assign_region",
    "trace_workload",
    "trace_sessions",
    "synthetic_workload",
    "load_workload",
    "describe",
]

log = structlog.get_logger(__name__)


class WorkloadConfig(BaseModel):
    """What `skylb local` and `skylb replay` replay: a Mooncake trace (when found) or the synthetic multi-turn
    generator. The ``workload`` section of the deployment YAML; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    trace: str | None = "../shared/traces/mooncake_conversation_trace.jsonl"
    #: Replay only trace requests with start_s <= timestamp < start_s + window_s (trace time, s).
    start_s: float = Field(0.0, ge=0)
    window_s: float = Field(60.0, gt=0)
    #: Trace time is divided by this (2 = twice as fast).
    time_compression: float = Field(1.0, gt=0)
    #: Scales prompt and output lengths (1 = as in the trace).
    token_scale: float = Field(1.0, gt=0)
    max_requests: int | None = Field(None, gt=0)
    region_weights: dict[str, float] = Field(default_factory=lambda: {"us": 0.5, "eu": 0.25, "asia": 0.25})
    seed: int = 0
    #: Synthetic generator: conversations per region and turns per conversation.
    synthetic_conversations: int = Field(24, gt=0)
    synthetic_turns: int = Field(4, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)


def workload_settings(cfg: DeploymentConfig, *, source: str | Path | None = None) -> WorkloadConfig:
    """The ``workload`` section of a loaded deployment config as a :class:`WorkloadConfig` (defaults when absent).

    Raises ConfigError naming the file (``source``, when given) and each bad key, as skylb.config.load_config does
    for the other sections: "config F: workload.trce: Extra inputs are not permitted".
    """
    try:
        return WorkloadConfig.model_validate(cfg.workload)
    except ValidationError as exc:
        where = f"config {source}: " if source is not None else ""
        raise ConfigError(where + "; ".join(f"workload.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                            for e in exc.errors())) from exc

#: Tokens per hash block in the Mooncake trace (NOTICE.md).
TRACE_BLOCK_TOKENS = 512

#: Short words for generated text: one word is one token. Every word is 3 characters, so a prompt of n words
#: joined by single spaces has 4n - 1 characters and the balancer's estimate (skylb/core/estimate.py
#: ``text_tokens``: characters / 4, rounded up) is exactly n, the emulator's count (bench/emulator/model.py
#: ``text_tokens``: whitespace-separated words): the balancer, the simulator and the engine count one number.
#: Role markers (:data:`ROLE_MARKERS`) are 3-character words too. Changing this list changes every prompt's text
#: (cached prefixes and recorded results depend on it): results recorded before the change are not comparable
#: text for text, though their token counts are.
VOCABULARY: tuple[str, ...] = tuple(
    """
    ace act add age ago aid aim air all and ant any ape arc are ark arm art ash ask ate awe axe bad bag ban bar bat
    bay bed bee beg bet bid big bin bit bow box boy bud bug bun bus but buy cab can cap car cat cow cry cub cup cut
    dad day den dew did die dig dim dip doe dog dot dry due dug dye ear eat egg ego elf elk elm end era eve eye fan
    far fat fax fed fee few fig fin fir fit fix fly foe fog for fox fry fun fur gap gas gel gem get gig gin god got
    gum gun gut guy gym had ham has hat hay hen her hid him hip his hit hog hop hot how hub hue hug hum hut ice icy
    ill ink inn ion ivy jam jar jaw jet job jog joy jug key kid kin kit lab lad lap law lay led leg let lid lie lip
    lit log lot low mad man map mat may men met mix mob mop mud mug nap net new nod nor not now nut oak oar oat odd
    off oil old one opt orb ore our out owl own pad pal pan paw pay pea pen pet pie pig pin pit pod pot pro pub pun
    pup put rag ram ran rat raw ray red rib rid rig rim rip rob rod row rub rug rum run rye sad sap sat saw say sea
    see set sew shy sin sip sir sit six ski sky sly sob sod son sow soy spa spy sum sun tab tag tan tap tar tax tea
    ten tie tin tip toe ton top toy try tub tug two urn use van vat vet via vow wag war was wax way web wed wet who
    why wig win wit won wow yak yam yes yet you zip zoo
    """.split()
)
#: The one-token marker that opens a message of each role in a generated conversation (3 characters, as the words).
ROLE_MARKERS: dict[str, str] = {"system": "sy:", "user": "me:", "assistant": "ai:"}

_WORD_LIMIT_PER_CALL = 50_000_000  # words; a sanity bound so a corrupt length cannot exhaust memory


class TraceError(ValueError):
    """A trace file is missing or a line is malformed; the message names the file and the 1-based line number."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload, as the replayer sends it.

    Attributes:
        id: unique id ("trace-000042" = line 42 of the trace; "syn-us-003-t1" = synthetic conversation us/3, turn 1).
        arrival_s: when to send it, s after the replay starts. For a closed-loop turn (``after`` set) it is only a
            lower bound: the turn is sent ``think_s`` after the turn ``after`` completed.
        region: the client region; the request goes to this region's balancer.
        session_id: the conversation it belongs to (sent as ``X-Session-ID`` and OpenAI ``user``).
        prompt_tokens: prompt length in tokens (= words, see the module docstring).
        output_tokens: tokens to generate (sent as ``max_tokens`` with ``ignore_eos``).
        hash_ids: the trace's block ids (empty for synthetic requests).
        turn: 0-based position of the request in its session.
        after: id of the request that must complete before this one is sent (closed loop), or None (open loop).
        think_s: pause after ``after`` completed before sending, s.
        block_words: words per hash block after ``token_scale`` (512 at scale 1).
        text: the prompt text when stored (synthetic); None means it is generated from ``hash_ids`` on demand,
            which keeps a long trace (12k requests x 12k tokens) out of memory.
    """

    id: str
    arrival_s: float
    region: str
    session_id: str
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    turn: int = 0
    after: str | None = None
    think_s: float = 0.0
    block_words: int = TRACE_BLOCK_TOKENS
    text: str | None = None

    @property
    def prompt(self) -> str:
        """The prompt text: exactly ``prompt_tokens`` words (generated from ``hash_ids`` when not stored)."""
        if self.text is not None:
            return self.text
        return prompt_from_blocks(self.hash_ids, self.prompt_tokens, self.block_words)


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One validated line of a Mooncake trace (units as in the file: ms and tokens)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=4096)
def block_text(block_id: int, words: int) -> str:
    """The text of one hash block: ``words`` words drawn from a generator seeded by ``f"block-{block_id}"``.

    Deterministic across processes (string seeds are hashed with SHA-512, not Python's salted hash). Fewer words
    give a prefix of more words, since ``choices`` draws them one after another. Cached: ~2.5 kB per 512-word block,
    so the cache holds at most ~10 MB.
    """
    if words <= 0:
        return ""
    return " ".join(random.Random(f"block-{block_id}").choices(VOCABULARY, k=words))


def prompt_from_blocks(hash_ids: Sequence[int], total_words: int, block_words: int) -> str:
    """Prompt text of ``total_words`` words (tokens) from hash blocks of ``block_words`` words each.

    Every block but the last contributes ``block_words`` words; the last one takes what is left (fewer when the
    trace's last block is partial, more when rounding after ``token_scale`` left a few extra words). Blocks not
    needed to reach ``total_words`` are dropped.
    """
    if total_words > _WORD_LIMIT_PER_CALL:
        raise ValueError(f"prompt of {total_words} words is beyond the sanity limit {_WORD_LIMIT_PER_CALL}")
    parts: list[str] = []
    remaining = total_words
    for i, block_id in enumerate(hash_ids):
        if remaining <= 0:
            break
        take = remaining if i == len(hash_ids) - 1 else min(block_words, remaining)
        parts.append(block_text(block_id, take))
        remaining -= take
    return " ".join(parts)


def _words(seed: str, count: int) -> list[str]:
    """``count`` words from a generator seeded by ``seed`` (synthetic text)."""
    return random.Random(seed).choices(VOCABULARY, k=count)


# --------------------------------------------------------------------------------------------------------- trace


def read_trace(path: str | Path) -> list[TraceRow]:
    """Read and validate every line of a Mooncake trace (blank lines are skipped).

    Raises TraceError naming ``path`` and the line number for a line that is not a JSON object with
    ``timestamp`` >= 0 (ms), ``input_length`` >= 1 and ``output_length`` >= 0 (integers, tokens) and ``hash_ids``
    (a non-empty list of integers).
    """
    path = Path(path)
    rows: list[TraceRow] = []
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from exc
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            rows.append(_parse_line(line, path, line_no))
    return rows


def _parse_line(line: str, path: Path, line_no: int) -> TraceRow:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise TraceError(f"{where}: missing key {key!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0 (ms), got {ts!r}")
    for key, low in (("input_length", 1), ("output_length", 0)):
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TraceError(f"{where}: {key} must be an integer >= {low} (tokens), got {value!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of integers")
    return TraceRow(line_no, float(ts), obj["input_length"], obj["output_length"], tuple(ids))


def _full_blocks(row: TraceRow) -> tuple[int, ...]:
    """The row's hash ids without its last block when that block is partial (it will not be extended as is)."""
    if row.input_length < len(row.hash_ids) * TRACE_BLOCK_TOKENS:
        return row.hash_ids[:-1]
    return row.hash_ids


def derive_sessions(rows: Sequence[TraceRow]) -> list[str]:
    """Session id of each row (same order): "trace-s<line of the session's first request>".

    Rule (module docstring): row B joins the session of the earlier row A whose full blocks are the longest prefix
    (>= 2 blocks) of B's hash_ids. Each row's full-block sequence is indexed by a rolling hash of its prefix, so
    a lookup costs O(len(hash_ids)) and the index holds one entry per row; candidates are verified exactly, so a
    hash collision cannot join unrelated rows.
    """
    index: dict[int, int] = {}  # rolling prefix key of a row's full blocks -> index of the latest such row
    sessions: list[str] = []
    for i, row in enumerate(rows):
        parent = None
        keys = _prefix_keys(row.hash_ids)
        for length in range(len(keys), 1, -1):  # longest shared prefix first; length >= 2 blocks
            j = index.get(keys[length - 1])
            if j is not None and _full_blocks(rows[j]) == row.hash_ids[:length]:
                parent = j
                break
        sessions.append(sessions[parent] if parent is not None else f"trace-s{row.line:06d}")
        full = _full_blocks(row)
        if len(full) >= 2:
            index[_prefix_keys(full)[-1]] = i
    return sessions


def _prefix_keys(ids: Sequence[int]) -> list[int]:
    """keys[k] identifies ids[:k+1] (a rolling hash; equal prefixes give equal keys)."""
    keys, key = [], 0
    for x in ids:
        key = hash((key, x))
        keys.append(key)
    return keys


# ------------------------------------------------------------------------------------------------------- regions


def region_weights(weights: dict[str, float], regions: Sequence[str]) -> list[tuple[str, float]]:
    """(region, weight) for each of ``regions`` in order: configured weights, 0 for regions not configured.

    Weights of regions not in ``regions`` are ignored. When no listed region has a positive weight, every region
    gets weight 1. Raises ValueError for an empty region list or a negative weight.
    """
    if not regions:
        raise ValueError("at least one region is needed")
    pairs = [(r, float(weights.get(r, 0.0))) for r in regions]
    for r, w in pairs:
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"region weight of {r!r} must be a finite number >= 0, got {w}")
    if sum(w for _, w in pairs) <= 0:
        return [(r, 1.0) for r in regions]
    return pairs


def assign_region(session_id: str, weighted: Sequence[tuple[str, float]], seed: int) -> str:
    """The region of a session: a draw with the given weights, seeded by ``(seed, session_id)``.

    Seeding per session (not one sequence over all sessions) keeps a session's region the same whatever window or
    ``max_requests`` selects.
    """
    total = sum(w for _, w in weighted)
    u = random.Random(f"{seed}:region:{session_id}").random() * total
    for region, w in weighted:
        if u < w:
            return region
        u -= w
    return next(r for r, w in reversed(weighted) if w > 0)  # float rounding at the top end


# -------------------------------------------------------------------------------------------------- the builders


def _scaled(tokens: int, scale: float) -> int:
    """Tokens after token_scale, at least 1."""
    return max(1, round(tokens * scale))


def trace_workload(cfg: WorkloadConfig, regions: Sequence[str], path: str | Path) -> list[Request]:
    """Requests of the trace at ``path`` in the window of ``cfg``, sorted by arrival.

    Window: rows with ``start_s <= timestamp / 1000 < start_s + window_s`` (trace time, s); arrival_s =
    (timestamp / 1000 - start_s) / time_compression; then the first ``max_requests`` by arrival. Lengths are
    scaled by ``token_scale`` (prompt and output tokens and the block size, at least 1 each).
    """
    weighted = region_weights(cfg.region_weights, regions)
    end_s = cfg.start_s + cfg.window_s
    rows = [r for r in read_trace(path) if r.timestamp_ms / 1000.0 < end_s]
    sessions = derive_sessions(rows)
    block_words = _scaled(TRACE_BLOCK_TOKENS, cfg.token_scale)
    turns: dict[str, int] = {}
    region_of: dict[str, str] = {}
    out: list[Request] = []
    for row, session in zip(rows, sessions):
        turn = turns.get(session, 0)  # turns count from the session's first request in the trace, not the window
        turns[session] = turn + 1
        t_s = row.timestamp_ms / 1000.0
        if t_s < cfg.start_s:
            continue
        if session not in region_of:
            region_of[session] = assign_region(session, weighted, cfg.seed)
        out.append(
            Request(
                id=f"trace-{row.line:06d}",
                arrival_s=(t_s - cfg.start_s) / cfg.time_compression,
                region=region_of[session],
                session_id=session,
                prompt_tokens=_scaled(row.input_length, cfg.token_scale),
                output_tokens=_scaled(row.output_length, cfg.token_scale),
                hash_ids=row.hash_ids,
                turn=turn,
                block_words=block_words,
            )
        )
    out.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn, r.id))
    return out[: cfg.max_requests] if cfg.max_requests else out


#: Synthetic generator constants (tokens before token_scale; s). Sizes are in the range of chat datasets such as
#: ShareGPT/WildChat: short user turns, answers of a few hundred tokens, a shared system prompt.
SYSTEM_PROMPT_TOKENS = 256
USER_TOKENS = (32, 160)
ANSWER_TOKENS = (64, 256)
START_SPREAD_S = 5.0
THINK_S = (0.2, 1.0)


def synthetic_workload(cfg: WorkloadConfig, regions: Sequence[str]) -> list[Request]:
    """Multi-turn conversations, closed loop per conversation (DESIGN.md "Workloads"; paper §5.1 multi-turn).

    Conversations: ``synthetic_conversations * len(regions)`` in all, split by the region weights (at least 1 per
    region with a positive weight), so with equal weights each region gets ``synthetic_conversations``; with
    the default 0.5/0.25/0.25 and 24 it is 36/18/18. Each has ``synthetic_turns`` turns. Turn k's prompt is the
    shared system prompt, then every earlier (user message, answer placeholder) pair, then a new user message, so
    turn k extends turn k-1's prompt. The placeholder stands for the answer (as many words as that turn's
    ``output_tokens``); it is generated here, not taken from the server, to keep prompts deterministic. Turn 0
    starts uniformly in [0, START_SPREAD_S) s; turn k > 0 is sent THINK_S after turn k-1 completed. Seeded.
    """
    weighted = region_weights(cfg.region_weights, regions)
    total_w = sum(w for _, w in weighted)
    total_conversations = cfg.synthetic_conversations * len(regions)
    scale = cfg.token_scale
    system = _words(f"{cfg.seed}:system", _scaled(SYSTEM_PROMPT_TOKENS, scale))
    out: list[Request] = []
    for region, w in weighted:
        if w <= 0:
            continue
        count = max(1, round(total_conversations * w / total_w))
        for k in range(count):
            session = f"syn-{region}-{k:03d}"
            rng = random.Random(f"{cfg.seed}:{session}")
            start = rng.uniform(0.0, START_SPREAD_S)
            words = [ROLE_MARKERS["system"], *system]
            previous: str | None = None
            for turn in range(cfg.synthetic_turns):
                user = _words(f"{cfg.seed}:{session}:{turn}:user", _scaled(rng.randint(*USER_TOKENS), scale))
                words += [ROLE_MARKERS["user"], *user]
                output = _scaled(rng.randint(*ANSWER_TOKENS), scale)
                rid = f"{session}-t{turn}"
                out.append(
                    Request(
                        id=rid,
                        arrival_s=start,
                        region=region,
                        session_id=session,
                        prompt_tokens=len(words),
                        output_tokens=output,
                        turn=turn,
                        after=previous,
                        think_s=rng.uniform(*THINK_S) if previous else 0.0,
                        text=" ".join(words),
                    )
                )
                words += [ROLE_MARKERS["assistant"], *_words(f"{cfg.seed}:{session}:{turn}:answer", output)]
                previous = rid
    out.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn, r.id))
    return out[: cfg.max_requests] if cfg.max_requests else out


@functools.lru_cache(maxsize=2)
def _sessions_of_trace(path: str) -> tuple[tuple[TraceRow, ...], tuple[str, ...]]:
    """The rows of the trace at ``path`` and each row's session (:func:`derive_sessions` over the whole trace);
    cached, since a benchmark builds a workload per run from the same file."""
    rows = read_trace(path)
    return tuple(rows), tuple(derive_sessions(rows))


def trace_session_count(path: str | Path) -> int:
    """How many sessions :func:`trace_sessions` can start from in the trace at ``path`` (TraceError as there)."""
    return len(set(_sessions_of_trace(str(Path(path).resolve()))[1]))


def trace_sessions(path: str | Path, regions: Sequence[str], *, weights: dict[str, float], seed: int,
                   token_scale: float, requests: int, first_session: int = 0,
                   max_turns: int | None = None) -> list[list[Request]]:
    """Whole sessions of a Mooncake trace, for closed-loop clients (bench/replay/run.py ``replay_sessions``).

    Sessions are derived over the whole trace (:func:`derive_sessions`) and taken in the order of their first
    request, from the ``first_session``-th (0-based) on, until they hold at least ``requests`` requests; at the
    trace's end they go on from its first session (fewer only when the whole trace holds fewer). A session keeps
    its first ``max_turns`` requests (None: all): a 40-turn session would keep one client busy long after the
    others finished. Each session goes to one region, drawn with ``weights`` and seeded by ``(seed, session id)``
    (:func:`assign_region`). Lengths are scaled by ``token_scale`` as in
    :func:`trace_workload`. The trace's timestamps are not used: turn k+1 of a session is sent when turn k ended, and
    its ``think_s`` (uniform in :data:`THINK_S`, seeded by ``(seed, request id)``) stands for the user's pause; the
    trace's own pauses within a session (about 2 minutes at the median) would leave a closed loop idle.
    ``arrival_s`` is 0 and ``after`` names the session's previous request.

    Raises TraceError for a missing or malformed trace and ValueError for bad weights, a ``requests`` below 1, or a
    ``first_session`` beyond the trace's sessions.
    """
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    rows, session_of = _sessions_of_trace(str(Path(path).resolve()))
    by_session: dict[str, list[TraceRow]] = {}
    for row, session in zip(rows, session_of):
        by_session.setdefault(session, []).append(row)  # insertion order: the order of first requests
    if not 0 <= first_session < len(by_session):
        raise ValueError(f"first_session {first_session} is outside the trace's {len(by_session)} sessions")
    weighted = region_weights(weights, regions)
    block_words = _scaled(TRACE_BLOCK_TOKENS, token_scale)
    out: list[list[Request]] = []
    total = 0
    order = list(by_session.items())
    for session, turns in order[first_session:] + order[:first_session]:
        region = assign_region(session, weighted, seed)
        chain: list[Request] = []
        for turn, row in enumerate(turns[:max_turns] if max_turns else turns):
            rid = f"trace-{row.line:06d}"
            chain.append(Request(
                id=rid, arrival_s=0.0, region=region, session_id=session,
                prompt_tokens=_scaled(row.input_length, token_scale),
                output_tokens=_scaled(row.output_length, token_scale), hash_ids=row.hash_ids, turn=turn,
                after=chain[-1].id if chain else None,
                think_s=random.Random(f"{seed}:think:{rid}").uniform(*THINK_S), block_words=block_words))
        out.append(chain)
        total += len(chain)
        if total >= requests:
            break
    return out


def load_workload(cfg: WorkloadConfig, regions: Sequence[str], *, base_dir: str | Path | None = None) -> list[Request]:
    """The workload to replay: the trace when ``cfg.trace`` names an existing file, else synthetic conversations.

    A relative ``cfg.trace`` is tried against the working directory, then against ``base_dir`` (the config file's
    folder). Logs one ``workload_loaded`` event saying which source was used. Raises TraceError for a malformed
    trace and ValueError for bad region weights.
    """
    path = _find_trace(cfg.trace, base_dir)
    if path is not None:
        requests = trace_workload(cfg, regions, path)
        log.info("workload_loaded", source="trace", trace=str(path), summary=describe(requests))
        return requests
    if cfg.trace:
        log.warning("trace_not_found", trace=cfg.trace, fallback="synthetic")
    requests = synthetic_workload(cfg, regions)
    log.info("workload_loaded", source="synthetic", summary=describe(requests))
    return requests


def _find_trace(trace: str | None, base_dir: str | Path | None) -> Path | None:
    if not trace:
        return None
    candidates = [Path(trace)]
    if base_dir is not None and not Path(trace).is_absolute():
        candidates.append(Path(base_dir) / trace)
    return next((p for p in candidates if p.is_file()), None)


def describe(requests: Iterable[Request]) -> str:
    """One line about a workload: source, requests, sessions, requests per region, span of arrivals (s)."""
    requests = list(requests)
    if not requests:
        return "empty workload (0 requests)"
    source = "synthetic" if requests[0].text is not None else "trace"
    per_region: dict[str, int] = {}
    for r in requests:
        per_region[r.region] = per_region.get(r.region, 0) + 1
    sessions = len({r.session_id for r in requests})
    regions = ", ".join(f"{k} {v}" for k, v in sorted(per_region.items()))
    span = max(r.arrival_s for r in requests)
    return f"{source}: {len(requests)} requests in {sessions} sessions ({regions}); arrivals over {span:.1f} s"
