"""A Mooncake-format trace of tool-agent-like sessions, generated: a held-out stand-in for traces the project does not
have (none of its defaults was chosen on it).

Shape (chosen; Mooncake's published tool-agent trace is not available here): ``agents`` agents, each with a shared
system prompt and tool schemas of 3-14 blocks of 512 tokens, picked Zipf-like; sessions start as a Poisson process
(``session_rate`` per s); a session opens with ``unique`` new blocks, runs 1 turn (share ``single``) or 2-12 turns
3-25 s apart, each turn adding ``grow`` new blocks (a tool result, the next message), at most 60 blocks; outputs
log-normal (median 120 tokens), capped at 1,024. Rows: timestamp (ms), input_length, output_length, hash_ids.

``python -m bench.sim.synth_trace OUT [key=value ...]``, e.g. ``session_rate=2.5 agents=200 'unique=(4,20)'
'grow=(2,6)' single=0.8 seed=3`` (the "low reuse" variant of bench/results/predicted_ttft.md).
"""

import json, random, sys
def main(path: str, seed=7, hours=1.0, session_rate=0.45, agents=24, unique=(1,3), grow=(1,2), single=0.3):
    """Write the trace to ``path`` and print its request count and mean input length (tokens)."""
    rng = random.Random(seed)
    next_id = 0
    def new_ids(n):
        nonlocal next_id
        ids = list(range(next_id, next_id + n)); next_id += n; return ids
    agent_prefix = [new_ids(rng.randint(3, 14)) for _ in range(agents)]
    weights = [1.0 / (i + 1) for i in range(agents)]
    rows = []
    t = 0.0
    end = hours * 3600
    while t < end:
        t += rng.expovariate(session_rate)
        a = rng.choices(range(agents), weights)[0]
        blocks = agent_prefix[a] + new_ids(rng.randint(*unique))
        turns = 1 if rng.random() < single else rng.randint(2, 12)
        ts = t
        for k in range(turns):
            out = int(min(1024, rng.lognormvariate(4.8, 0.8)))
            rows.append({"timestamp": int(ts * 1000), "input_length": len(blocks) * 512 - rng.randint(0, 500),
                         "output_length": out, "hash_ids": list(blocks)})
            blocks = blocks + new_ids(rng.randint(*grow))
            ts += rng.uniform(3, 25)
            if len(blocks) > 60: break
    rows.sort(key=lambda r: r["timestamp"])
    rows = [r for r in rows if r["timestamp"] < end * 1000]
    with open(path, "w") as f:
        for r in rows: f.write(json.dumps(r) + "\n")
    print(len(rows), "requests", sum(r["input_length"] for r in rows) / len(rows), "avg input")
if __name__ == "__main__":
    import ast
    main(sys.argv[1], **{k: ast.literal_eval(v) for k, v in (a.split("=") for a in sys.argv[2:])})
