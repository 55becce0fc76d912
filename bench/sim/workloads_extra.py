"""The robustness matrix's own workloads (bench/sim/matrix.py): many tenants behind long shared prefixes, tool
agents, and review analysis for replicas of different speeds. Deterministic: the same seed gives the same requests
in any process.

Token convention as in bench/sim/workloads.py: one token is one 3-character word, so equal token prefixes are equal
text prefixes for the balancer's prefix trie. Lengths in tokens, times in seconds, rates in requests (or sessions)
per second. Clients are spread over regions us/eu/asia 0.5/0.25/0.25, the skew the Mooncake replayer uses
(bench/replay/workload.py ``WorkloadConfig.region_weights``), so the US is the busy region in every workload of the
matrix. Where no source gives a figure it is marked "chosen".

* :func:`multi_tenant`, after llm-d's precise-prefix-cache benchmark (llm-d blog "KV-Cache Wins You Can See",
  llm-d.ai/blog/kvcache-wins-you-can-see, 2025: 150 enterprise customers, each with a 6,000-token system prompt,
  5 concurrent users per customer, 1,200-token queries, load ramped from 3 to 60 QPS on 8 vLLM pods). Here: 150
  tenants, each with its own shared prefix (identical text for every request of the tenant), 5 users per tenant
  (the hash key), a question per request, Poisson arrivals (open loop), tenants uniform, each tenant in one region.
  Lengths are scaled by ``prompt_scale`` (default 1/8: prefix 750, question 150), as the Mooncake scenario scales
  its prompts, because of the simulated L4's KV cache (SGLang's 36,044 tokens, bench/emulator/model.py): at full
  length the 150 prefixes (900,000 tokens) exceed the 12 replicas' pooled KV (432,000 tokens), so no routing could
  keep them, and one request (7,200 tokens) would hold a fifth of a replica. At 1/8 the prefixes (112,500 tokens)
  fit the pooled cache but not one replica's: the regime of the benchmark, where routing decides the hit rate.
  Outputs: uniform 100-300 tokens (chosen; the blog gives none, "short").
* :func:`tool_agents`: tool-calling agents. A handful of agents (5, chosen), each with a system prompt plus tool
  schemas of 3,000-6,000 tokens (uniform per agent, chosen: "several thousand"; τ-bench, Yao et al. 2024,
  arXiv 2406.12045, gives its agents a policy document and 13-15 API tools per domain). Sessions arrive as a
  Poisson process (open loop) and each picks an agent; turn 0 is the agent prefix plus a user message (log-normal
  median 60, sigma 0.8, chosen); each later turn appends the previous call (the model's output) and a tool result
  or user reply (median 150, sigma 0.8, up to 2,000, chosen). Outputs are short tool calls or replies (median 60,
  sigma 0.6, 16-400, chosen). Inside a session a turn waits for the previous answer plus the tool's run time
  (uniform 0.2-2 s, chosen), as an agent must; turns per session are geometric with mean 12 (chosen), at most 30
  (τ-bench's cap of 30 agent actions per task), and a session ends early before its context passes 16,384 tokens
  (:data:`MAX_CONTEXT`). The session id is the hash key.
* :func:`reviews`: the workload of bench/live/heterogeneous.py (a stand-in for OllamaRouter's review analysis,
  ../shared/seeds/000_b071411eabc9df88.txt §5.5-§5.7, which is not public): a review of 200-1,200 characters
  (40-240 tokens at 5 characters per token, uniform) followed by a 12-token instruction, outputs uniform 100-300
  tokens, at a constant arrival rate (k6's constant-arrival-rate executor, as in the seed). No shared prefix: what
  matters is where each request runs, on replicas of different speeds (bench/sim/matrix.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.sim.workloads import ClientSpec, SimRequest, Workload, _lognormal, _words
from bench.replay.workload import ROLE_MARKERS

__all__ = ["REGION_WEIGHTS", "TENANTS", "USERS_PER_TENANT", "multi_tenant", "tool_agents", "reviews",
           "mean_turns"]

#: Clients per region (the Mooncake replayer's default skew, bench/replay/workload.py).
REGION_WEIGHTS = {"us": 0.5, "eu": 0.25, "asia": 0.25}
#: llm-d's benchmark: 150 customers, 5 concurrent users each.
TENANTS = 150
USERS_PER_TENANT = 5
#: Tool agents: agents, turns per session (mean, cap).
AGENTS = 5
MEAN_TURNS = 12.0
MAX_TURNS = 30
#: A session ends early when its next prompt plus output would pass this many tokens (chosen: half an L4's SGLang
#: KV cache of 36,044 tokens, so one session never fills a replica; the conversations' cap is 8,192).
MAX_CONTEXT = 16384


def _region(rng: random.Random, regions: Sequence[str]) -> str:
    """A region drawn with :data:`REGION_WEIGHTS` (regions not in it weigh nothing)."""
    return rng.choices(list(regions), weights=[REGION_WEIGHTS.get(r, 0.0) for r in regions], k=1)[0]


def _poisson_times(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` per second over [0, duration_s)."""
    out, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        out.append(t)
    return out


def multi_tenant(*, seed: int = 0, rate_rps: float, duration_s: float, prompt_scale: float = 0.125,
                 tenants: int = TENANTS, regions: Sequence[str] = ("us", "eu", "asia"),
                 abroad: float = 0.0) -> Workload:
    """Tenants behind long shared prefixes (module docstring), open loop: Poisson arrivals at ``rate_rps`` for
    ``duration_s`` s. Every request of tenant i starts with the same prefix text (6,000 x ``prompt_scale`` tokens),
    then its own question (1,200 x ``prompt_scale``); outputs 100-300 tokens. A tenant's requests come from its home
    region, but for a share ``abroad`` (0-1) of them, each from one of the other regions drawn evenly (a tenant whose
    users are on several continents); 0 draws nothing more, so the workload is the same as without it."""
    rng = random.Random(f"{seed}:multi_tenant")
    prefix_len, question_len = max(1, round(6000 * prompt_scale)), max(1, round(1200 * prompt_scale))
    homes = [_region(rng, regions) for _ in range(tenants)]
    prefixes = [[ROLE_MARKERS["system"], *_words(f"{seed}:tenant{i}:prefix", prefix_len - 1)] for i in range(tenants)]
    arrivals = []
    for n, t in enumerate(_poisson_times(rng, rate_rps, duration_s)):
        i = rng.randrange(tenants)
        user = f"tenant{i:03d}-u{rng.randrange(USERS_PER_TENANT)}"
        question = [ROLE_MARKERS["user"], *_words(f"{seed}:mt{n}:question", question_len - 1)]
        region = homes[i]
        if abroad and rng.random() < abroad:
            region = rng.choice([r for r in regions if r != region])
        arrivals.append(SimRequest(f"mt{n}", user, [*prefixes[i], *question], rng.randint(100, 300), arrival_s=t,
                                   region=region))
    return Workload("multi_tenant", f"{tenants} tenants, prefix {prefix_len} + question {question_len} tokens, "
                    f"Poisson {rate_rps:.2f} req/s for {duration_s:g} s: {len(arrivals)} requests", arrivals=arrivals)


def _agent_prefixes(seed: int, agents: int, scale: float) -> list[list[str]]:
    """Each agent's system prompt plus tool schemas: 3,000-6,000 tokens x ``scale`` (uniform per agent)."""
    rng = random.Random(f"{seed}:agents")
    return [[ROLE_MARKERS["system"], *_words(f"{seed}:agent{a}:tools", max(1, round(rng.randint(3000, 6000) * scale)))]
            for a in range(agents)]


def _session(seed: int, sid: str, prefix: list[str], scale: float) -> list[SimRequest]:
    """One agent session: turn t's prompt extends turn t-1's with its output and a tool result (module docstring)."""
    rng = random.Random(f"{seed}:{sid}")
    turns = 1
    while turns < MAX_TURNS and rng.random() < 1.0 - 1.0 / MEAN_TURNS:
        turns += 1
    words = [*prefix, ROLE_MARKERS["user"], *_words(f"{seed}:{sid}:ask", max(1, round(
        _lognormal(rng, 60, 0.8, 4, 1000) * scale)))]
    program, parent = [], None
    for t in range(turns):
        out = _lognormal(rng, 60, 0.6, 16, 400)
        if t > 0 and len(words) + out > MAX_CONTEXT:
            break
        rid = f"{sid}-t{t}"
        program.append(SimRequest(rid, sid, words, out, parent=parent,
                                  think_s=rng.uniform(0.2, 2.0) if parent else 0.0))
        result = max(1, round(_lognormal(rng, 150, 0.8, 8, 2000) * scale))
        words = [*words, ROLE_MARKERS["assistant"], *_words(f"{seed}:{rid}:call", out), "tl:",
                 *_words(f"{seed}:{rid}:result", result)]
        parent = rid
    return program


def tool_agents(*, seed: int = 0, sessions_per_s: float, duration_s: float, prompt_scale: float = 1.0,
                agents: int = AGENTS, regions: Sequence[str] = ("us", "eu", "asia")) -> Workload:
    """Tool-agent sessions (module docstring): sessions start as a Poisson process of ``sessions_per_s`` for
    ``duration_s`` s; each is a client whose turns wait for the previous answer plus the tool's run time.
    ``prompt_scale`` scales the prompt parts (agent prefixes, messages, tool results), not the outputs."""
    rng = random.Random(f"{seed}:tool_agents")
    prefixes = _agent_prefixes(seed, agents, prompt_scale)
    clients = []
    for n, t in enumerate(_poisson_times(rng, sessions_per_s, duration_s)):
        sid, agent, region = f"ag{n}", rng.randrange(agents), _region(rng, regions)
        program = _session(seed, sid, prefixes[agent], prompt_scale)
        clients.append(ClientSpec(sid, region, lambda k, p=program: p if k == 0 else None, start_s=t))
    return Workload("tool_agent", f"{agents} tool agents, Poisson {sessions_per_s:.3f} sessions/s for "
                    f"{duration_s:g} s: {len(clients)} sessions", clients=clients)


def mean_turns(workload: Workload) -> float:
    """Requests per session of a :func:`tool_agents` workload (its first program per client)."""
    counts = [len(c.programs(0) or []) for c in workload.clients]
    return sum(counts) / len(counts) if counts else 0.0


_INSTRUCTION = 12


def reviews(*, seed: int = 0, rate_rps: float, duration_s: float,
            regions: Sequence[str] = ("us", "eu", "asia")) -> Workload:
    """Review analysis at a constant arrival rate (module docstring): one request every 1 / ``rate_rps`` s for
    ``duration_s`` s (the first after a seeded phase), a 40-240-token review then a shared 12-token instruction,
    outputs 100-300 tokens."""
    rng = random.Random(f"{seed}:reviews")
    instruction = _words("reviews:instruction", _INSTRUCTION)
    arrivals, t, n = [], rng.uniform(0.0, 1.0 / rate_rps) if rate_rps > 0 else duration_s, 0
    while t < duration_s:
        review = _words(f"{seed}:review{n}", rng.randint(40, 240))
        arrivals.append(SimRequest(f"rv{n}", f"rv{n}", [ROLE_MARKERS["user"], *review, *instruction],
                                   rng.randint(100, 300), arrival_s=t, region=_region(rng, regions)))
        n += 1
        t += 1.0 / rate_rps
    return Workload("reviews", f"review analysis, {rate_rps:.2f} req/s for {duration_s:g} s: {len(arrivals)} "
                    "requests", arrivals=arrivals)
