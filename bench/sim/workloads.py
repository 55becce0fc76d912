"""The paper's workloads, generated deterministically, plus the Mooncake trace (SkyLB paper §5.1-§5.2).

Token convention (shared with the engine model, the balancer and bench/replay/workload.py): ONE TOKEN = ONE WORD of 3
characters (the vocabulary's words and every marker: roles ``ROLE_MARKERS``, ``cx:`` context, ``qu:`` question,
``b0:`` branch, ``s1:`` step). A prompt is a list of words; the balancer sees the same words joined by single spaces
(``SimRequest.text``), so equal token prefixes are equal text prefixes for the prefix trie, and the balancer's
characters / 4 estimate (skylb/core/estimate.py ``text_tokens``) equals the engine's word count.

Closed loop (paper §5.1: "Each client issues one program at a time"): a client runs programs one after another. A
program is a set of requests with dependencies: a request is sent when its ``parent`` completed (a conversation is a
chain of turns; a Tree of Thoughts releases a node's children when the node completes, so siblings run
concurrently). The client starts its next program when every request of the current one completed. There is no
think time, as in the paper's benchmark clients.

Open loop: the Mooncake trace, replayed at its (compressed) timestamps.

Lengths (tokens; log-normal draws, clipped). Where the SkyLB paper gives none, they come from the datasets'
published statistics, fitted by moments (a log-normal with mean m and standard deviation s has
sigma^2 = ln(1 + s^2 / m^2) and median m / exp(sigma^2 / 2)); what no source gives is marked "chosen":

* Conversations (paper Fig. 4a: WildChat inputs of a few hundred tokens with a long tail, outputs of a few hundred
  tokens, also with a long tail).
  - WildChat (Zhao et al., "WildChat: 1M ChatGPT Interaction Logs in the Wild", ICLR 2024, Table 1: 2.54 turns per
    conversation; user turns 295.58 +- 1,609.18 tokens, assistant turns 441.34 +- 410.91, mean +- std): user
    turns median 53 (sigma 1.85), answers median 323 (sigma 0.79), both clipped at 4,096 (clipped means about 243
    and 440), 2.54 turns on average.
  - ChatBot Arena (the paper's dataset [67] has no length statistics; LMSYS-Chat-1M, collected on the same Chatbot
    Arena site, reports in its own paper, Zheng et al., "LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation
    Dataset", ICLR 2024, Table 1: 2.0 turns per sample, 69.5 tokens per prompt, 214.5 per response, means only;
    WildChat's Table 1 gives it with its spread, 2.02 turns, user turns 69.83 +- 143.49, responses 215.71 +-
    1,858.09):
    user turns median 31 (sigma 1.29), 2.02 turns on average; answers with the mean 215.71 and WildChat's shape
    (median 158, sigma 0.79), because LMSYS-Chat-1M's response deviation comes from a few runaway generations
    that a max_tokens limit cuts (a moment fit would give a median of 25 tokens).
  - Chosen (the datasets publish no such figures): a 64-token system prompt shared by every request (the chat
    template: the small cross-user prefix of Fig. 5a); a per-user context reused by all of that user's
    conversations (custom instructions, a pasted document: the within-user similarity of Fig. 5), median 150
    tokens for Arena and 400 for WildChat. The calibrated regime of the paper's scenarios (bench/sim/regime.yaml)
    drops the per-user context and uses Llama 3.1's 26-token system header instead (the reasons are there); 30% (Arena) and 10% (WildChat) of conversations open with one of 40
    popular prompts (Zipf-ranked), the cross-user sharing that consistent hashing cannot exploit (§3.2; the
    within-user / cross-user ratio is 2.47x for Arena and 7.6x for WildChat in Fig. 5a). Turns per conversation
    are geometric with the published mean; a conversation ends early when the next prompt plus answer would
    exceed 8,192 tokens.
* Tree of Thoughts on GSM8K (paper §5.1). The ToT paper (Yao et al., NeurIPS 2023) has no GSM8K task and publishes
  no thought lengths; the setup the paper describes (GSM8K, 2 branches, depth 4) is SGLang's
  benchmark/tree_of_thought_deep (plan, execute, reflect, final answer; each thought generated with
  ``max_tokens=256``, the plan asked "within 80 words"), so thoughts are clipped at its 256 tokens, median 120
  (sigma 0.5, chosen below that cap). Chosen: a 300-token ToT instruction with few-shot examples shared by every
  tree and a question of median 90 tokens. A node's prompt is the template, the question, then the thoughts on its
  path from the root; siblings are samples from the same prompt (they differ only in a one-token branch marker). A
  tree with ``branches`` b and ``depth`` 4 has 1 + b + b^2 + b^3 requests: 15 for b = 2, 85 for b = 4. Its hash
  key is the question id.
* Mooncake (Kimi conversation trace, 12,031 requests in one hour, average input 12,035 and output 343 tokens):
  prompts scaled by 1/8 (blocks of 64 instead of 512 tokens, so the trace's prefix sharing survives) because an
  L4's 32,768-token KV cache cannot batch 12k-token prompts; outputs kept, capped at 1,024. Sessions and regions
  are derived by bench/replay/workload.py (sessions are chains of requests that extend each other's blocks; regions
  us/eu/asia drawn 0.5/0.25/0.25 per session). The session id is the hash key.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.replay.workload import ROLE_MARKERS, VOCABULARY, Request, WorkloadConfig, read_trace, trace_workload

__all__ = [
    "SimRequest", "Program", "ClientSpec", "Workload", "ConversationShape", "TreeShape", "ARENA", "WILDCHAT", "TOT_2",
    "TOT_4", "TOT_2_LONG", "conversations", "trees", "mixed_trees", "mooncake", "replayed", "DEFAULT_TRACE",
]

#: Where the real Mooncake trace lives in this workspace (skipped cleanly when absent).
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request of a workload.

    Attributes:
        id: unique in the run. session_key: the hash-ring key (user id, question id, trace session).
        tokens: the prompt, one word per token. output_tokens: tokens the engine generates (exactly: the reply's
            own length, ended by a simulated EOS when shorter than max_tokens).
        max_tokens: the ``max_tokens`` the client asks for (at least output_tokens); what an engine that reserves
            KV for future output (SGLang) reserves by. None: the same as output_tokens.
        parent: id of the request in the same program that must complete before this one is sent (closed loop).
        think_s: closed loop: the pause between the parent's completion and this request's send, s.
        arrival_s: open loop only: when the client sends it, s after the start.
        region: open loop only: the client's region (closed-loop requests take their client's).
    """

    id: str
    session_key: str
    tokens: list[str]
    output_tokens: int
    parent: str | None = None
    max_tokens: int | None = None
    think_s: float = 0.0
    arrival_s: float | None = None
    region: str = ""
    _text: str | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The prompt as the balancer sees it: the words joined by single spaces (computed once)."""
        if self._text is None:
            self._text = " ".join(self.tokens)
        return self._text


#: A program: requests in dependency order (a request's parent comes before it).
Program = list[SimRequest]


@dataclass(frozen=True)
class ClientSpec:
    """A closed-loop client: its id, region, and ``programs(k)`` -> the k-th program it runs (deterministic).

    ``programs(k)`` returning None ends the client (a finite workload). ``start_s``: when it sends its first
    program, s; None means a uniform time in the workload's ``start_spread_s``.
    """

    id: str
    region: str
    programs: Callable[[int], Program | None]
    start_s: float | None = None


@dataclass
class Workload:
    """What the clients send: closed-loop ``clients`` or open-loop ``arrivals`` (sorted by ``arrival_s``).

    ``start_spread_s``: closed-loop clients start uniformly in [0, start_spread_s) s so they are not in lockstep.
    """

    name: str
    description: str
    clients: list[ClientSpec] = field(default_factory=list)
    arrivals: list[SimRequest] = field(default_factory=list)
    start_spread_s: float = 5.0

    def regions(self) -> list[str]:
        """Regions that send requests, in first-seen order."""
        seen: dict[str, None] = {}
        for c in self.clients:
            seen.setdefault(c.region)
        for r in self.arrivals:
            seen.setdefault(r.region)
        return list(seen)


# ------------------------------------------------------------------------------------------------- helpers


def _words(seed: str, count: int) -> list[str]:
    """``count`` words from a generator seeded by the string ``seed`` (same seed, same words, any process)."""
    return random.Random(seed).choices(VOCABULARY, k=count)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw with the given median, rounded and clipped to [lo, hi]."""
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def _zipf_rank(rng: random.Random, n: int, s: float = 1.0) -> int:
    """A rank in [0, n) with P(k) proportional to 1 / (k + 1)^s."""
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights, k=1)[0]


# ----------------------------------------------------------------------------------------------- conversations


@dataclass(frozen=True)
class ConversationShape:
    """Length distributions of a multi-turn chat dataset (tokens; defaults: ChatBot Arena, from LMSYS-Chat-1M's
    published statistics; see the module docstring for the sources)."""

    name: str
    system_tokens: int = 64
    context_median: int = 150
    context_sigma: float = 0.8
    user_median: int = 31
    user_sigma: float = 1.29
    user_max: int = 4096
    answer_median: int = 158
    answer_sigma: float = 0.79
    answer_max: int = 4096
    mean_turns: float = 2.02
    max_turns: int = 10
    popular_fraction: float = 0.3
    popular_prompts: int = 40
    max_context: int = 8192
    #: The clients' max_tokens per request (None: each asks for exactly its answer's length); an answer longer
    #: than it stops there.
    max_tokens: int | None = None


ARENA = ConversationShape("arena")
#: WildChat paper Table 1 (module docstring): user turns 295.58 +- 1,609.18, answers 441.34 +- 410.91, 2.54 turns.
WILDCHAT = ConversationShape("wildchat", context_median=400, user_median=53, user_sigma=1.85, answer_median=323,
                             answer_sigma=0.79, mean_turns=2.54, popular_fraction=0.1)


def _conversation_program(shape: ConversationShape, seed: int, user: str, k: int) -> Program:
    """The k-th conversation of ``user``: turn t's prompt extends turn t-1's prompt with its answer and a new turn."""
    rng = random.Random(f"{seed}:{shape.name}:{user}:conv{k}")
    user_rng = random.Random(f"{seed}:{shape.name}:{user}:profile")
    words = [ROLE_MARKERS["system"], *_words(f"{seed}:{shape.name}:system", shape.system_tokens)]
    if shape.context_median > 0:  # 0: no per-user context (the datasets publish none)
        words += ["cx:", *_words(f"{seed}:{shape.name}:{user}:context",
                                 _lognormal(user_rng, shape.context_median, shape.context_sigma, 8, 2000))]
    turns = 1
    while turns < shape.max_turns and rng.random() < 1.0 - 1.0 / shape.mean_turns:
        turns += 1
    program: Program = []
    parent = None
    for t in range(turns):
        if t == 0 and rng.random() < shape.popular_fraction:
            rank = _zipf_rank(rng, shape.popular_prompts)
            prompt_rng = random.Random(f"{seed}:{shape.name}:popular{rank}")
            message = _words(f"{seed}:{shape.name}:popular{rank}",
                             _lognormal(prompt_rng, shape.user_median, shape.user_sigma, 4, shape.user_max))
        else:
            message = _words(f"{seed}:{shape.name}:{user}:conv{k}:turn{t}",
                             _lognormal(rng, shape.user_median, shape.user_sigma, 4, shape.user_max))
        answer = _lognormal(rng, shape.answer_median, shape.answer_sigma, 8, shape.answer_max)
        if shape.max_tokens is not None:
            answer = min(answer, shape.max_tokens)
        if t > 0 and len(words) + 1 + len(message) + answer > shape.max_context:
            break
        words = [*words, ROLE_MARKERS["user"], *message]
        rid = f"{user}-c{k}-t{t}"
        program.append(SimRequest(rid, user, words, answer, parent=parent, max_tokens=shape.max_tokens))
        words = [*words, ROLE_MARKERS["assistant"], *_words(f"{seed}:{shape.name}:{rid}:answer", answer)]
        parent = rid
    return program


def conversations(shape: ConversationShape, clients_per_region: dict[str, int], *, seed: int = 0) -> Workload:
    """Multi-turn conversations: ``clients_per_region[r]`` users in region r, each running conversations back to back.

    Paper §5.1: ChatBot Arena, 80 conversations per region; WildChat, 40/30/30. Each client is one user (its id is
    the consistent-hashing key, as the dataset's user id / hashed IP in the paper).
    """
    clients = []
    for region, n in clients_per_region.items():
        for i in range(n):
            user = f"{shape.name}-{region}-u{i:03d}"
            clients.append(ClientSpec(user, region,
                                      lambda k, user=user: _conversation_program(shape, seed, user, k)))
    counts = "/".join(str(n) for n in clients_per_region.values())
    return Workload(f"{shape.name}", f"{shape.name} conversations, {counts} clients "
                    f"({'/'.join(clients_per_region)})", clients=clients)


# ------------------------------------------------------------------------------------------- Tree of Thoughts


@dataclass(frozen=True)
class TreeShape:
    """A Tree of Thoughts program: ``branches`` children per node over ``depth`` levels (tokens per part)."""

    branches: int = 2
    depth: int = 4
    template_tokens: int = 300
    question_median: int = 90
    question_sigma: float = 0.4
    thought_median: int = 120
    thought_sigma: float = 0.5
    thought_max: int = 256  # SGLang benchmark/tree_of_thought_deep: max_tokens=256 per thought

    @property
    def requests(self) -> int:
        """Requests per tree: 1 + b + ... + b^(depth-1)."""
        return sum(self.branches ** level for level in range(self.depth))


TOT_2 = TreeShape(branches=2)
TOT_4 = TreeShape(branches=4)
#: ToT with long thoughts (median 400 tokens, up to 1,600): memory-bound simulated L4s at the paper's 30 clients.
TOT_2_LONG = TreeShape(branches=2, thought_median=400, thought_max=1600)


def _tree_program(shape: TreeShape, seed: int, client: str, k: int) -> Program:
    """The k-th tree of ``client``: breadth-first nodes; each child's prompt = its parent's prompt + the parent's thought."""
    qid = f"{client}-q{k}"
    rng = random.Random(f"{seed}:tot:{qid}")
    question = _words(f"{seed}:tot:{qid}:question",
                      _lognormal(rng, shape.question_median, shape.question_sigma, 20, 400))
    base = [ROLE_MARKERS["system"], *_words(f"{seed}:tot:template", shape.template_tokens), "qu:", *question]
    program: Program = []
    # (request id, prompt words before the branch marker) of the nodes of the previous level
    level_nodes: list[tuple[str | None, list[str]]] = [(None, base)]
    for level in range(shape.depth):
        next_level: list[tuple[str | None, list[str]]] = []
        for parent, prefix in level_nodes:
            for b in range(1 if level == 0 else shape.branches):
                rid = f"{qid}-n{len(program)}"
                thought = _lognormal(rng, shape.thought_median, shape.thought_sigma, 16, shape.thought_max)
                program.append(SimRequest(rid, qid, [*prefix, f"b{b}:"], thought, parent=parent,
                                          max_tokens=shape.thought_max))
                words = [*prefix, f"s{level}:", *_words(f"{seed}:tot:{rid}:thought", thought)]
                next_level.append((rid, words))
        level_nodes = next_level
    return program


def trees(shape: TreeShape, clients_per_region: dict[str, int], *, seed: int = 0, name: str = "tot") -> Workload:
    """Tree of Thoughts: ``clients_per_region[r]`` clients in region r, each solving one tree (question) at a time.

    Paper §5.1: 2 branches, depth 4 (15 requests per tree), 40 clients in the US and 20 in Europe and Asia;
    §5.2 (Fig. 9): 30 clients in one region.
    """
    clients = []
    for region, n in clients_per_region.items():
        for i in range(n):
            cid = f"{name}-{region}-c{i:03d}"
            clients.append(ClientSpec(cid, region, lambda k, cid=cid: _tree_program(shape, seed, cid, k)))
    counts = "/".join(str(n) for n in clients_per_region.values())
    return Workload(name, f"Tree of Thoughts, {shape.branches} branches x depth {shape.depth} "
                    f"({shape.requests} requests per tree), {counts} clients", clients=clients)


def mixed_trees(*, seed: int = 0, big_region: str = "us", big_clients: int = 2, small_clients: int = 20,
                regions: Sequence[str] = ("us", "eu", "asia")) -> Workload:
    """Mixed Tree (paper §5.1): two US clients run 4-branch trees (85 requests each); every other region runs
    ``small_clients`` clients of 2-branch trees (15 requests each)."""
    clients = []
    for region in regions:
        shape, n = (TOT_4, big_clients) if region == big_region else (TOT_2, small_clients)
        for i in range(n):
            cid = f"mixed-{region}-c{i:03d}"
            clients.append(ClientSpec(cid, region, lambda k, cid=cid, shape=shape: _tree_program(shape, seed, cid, k)))
    return Workload("mixed_tree", f"Mixed Tree: {big_clients} clients of 4-branch trees in {big_region}, "
                    f"{small_clients} clients of 2-branch trees in each other region", clients=clients)


# ------------------------------------------------------------------------------------------------- Mooncake


def mooncake(*, seed: int = 0, path: str | Path = DEFAULT_TRACE, window_s: float = 210.0, start_s: float = 0.0,
             time_compression: float = 1.0, prompt_scale: float = 0.125, max_output: int = 1024,
             regions: Sequence[str] = ("us", "eu", "asia"),
             region_weights: dict[str, float] | None = None, max_total_tokens: int | None = None) -> Workload:
    """The Mooncake conversation trace, open loop (module docstring for the scaling); raises FileNotFoundError.

    ``window_s`` of trace time from ``start_s`` is replayed ``time_compression`` times faster. At 1 (real time) and
    prompts x1/8 the trace's 3.4 req/s load 12 simulated L4 replicas to roughly 70-80%: busy enough for queues to
    form on imbalanced replicas, without an ever-growing backlog (at 1.5x the backlog grows without bound).

    ``max_total_tokens``: the replicas' model length (prompt plus output, tokens). At real prompt lengths (``prompt_
    scale`` 1) about 7% of the trace's prompts (p99 85k, max 126k tokens) exceed an L4's KV cache; such a prompt
    keeps its first ``max_total_tokens - output`` tokens (its shared prefix survives: the trace's blocks are
    prefixes) and the workload's description counts them.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Mooncake trace not found at {path}")
    cfg = WorkloadConfig(trace=str(path), start_s=start_s, window_s=window_s, time_compression=time_compression,
                         token_scale=prompt_scale, seed=seed,
                         region_weights=region_weights or {"us": 0.5, "eu": 0.25, "asia": 0.25})
    outputs = {row.line: row.output_length for row in read_trace(path)}
    arrivals = []
    truncated = 0
    for r in trace_workload(cfg, list(regions), path):
        output = max(1, min(max_output, outputs[int(r.id.split("-")[1])]))
        tokens = r.prompt.split()
        if max_total_tokens is not None and len(tokens) + output > max_total_tokens:
            tokens = tokens[:max(1, max_total_tokens - output)]
            truncated += 1
        arrivals.append(SimRequest(r.id, r.session_id, tokens, output, arrival_s=r.arrival_s, region=r.region))
    cut = f", {truncated} prompts cut to the model length {max_total_tokens}" if truncated else ""
    return Workload("mooncake", f"Mooncake trace, {window_s:g} s from {start_s:g} s at {time_compression:g}x, "
                    f"prompts x{prompt_scale:g}: {len(arrivals)} requests{cut}", arrivals=arrivals)


def replayed(requests: Sequence[Request], *, name: str = "replayed", description: str = "") -> Workload:
    """The workload the live replayer (bench/replay/run.py) sends, for the simulator.

    Open loop (no request waits for another: a trace window): every request is sent at its ``arrival_s`` from its
    region, as bench/replay/run.py does. Closed loop: one client per session; each session's turns form one program,
    sent once: turn 0 at its ``arrival_s``, each later turn ``think_s`` after the turn it follows (``after``)
    completed. Prompts are the same words (one word per token) and the same text the live client sends. Raises
    ValueError for a closed-loop workload with a multi-turn session whose turns do not chain (more than one turn
    waits for nothing).
    """
    if requests and all(r.after is None for r in requests):
        arrivals = [SimRequest(r.id, r.session_id, r.prompt.split(), r.output_tokens, arrival_s=r.arrival_s,
                               region=r.region, _text=r.prompt) for r in sorted(requests, key=lambda r: r.arrival_s)]
        return Workload(name, description or f"{len(requests)} replayed requests, open loop", arrivals=arrivals)
    sessions: dict[str, list[Request]] = {}
    for r in requests:
        sessions.setdefault(r.session_id, []).append(r)
    clients = []
    for session, turns in sessions.items():
        turns.sort(key=lambda r: r.turn)  # a program lists a parent before its child
        roots = [r for r in turns if r.after is None]
        if len(roots) != 1:
            raise ValueError(f"session {session!r} has {len(roots)} turns that wait for no other; "
                             "replayed() takes closed-loop sessions, or an open-loop workload as a whole")
        program = [SimRequest(r.id, session, r.prompt.split(), r.output_tokens, parent=r.after,
                              think_s=r.think_s if r.after else 0.0, _text=r.prompt) for r in turns]
        clients.append(ClientSpec(session, turns[0].region, lambda k, p=program: p if k == 0 else None,
                                  start_s=roots[0].arrival_s))
    return Workload(name, description or f"{len(requests)} replayed requests in {len(sessions)} sessions",
                    clients=clients)
