"""Print how far the acceptance lines of the routing and KV-event work can be reached at all, from the committed
result files (no simulation, no live run): run from the repository root,
``python bench/results/acceptance_reach/reach.py``.

* The robustness matrix (bench/results/matrix.json and the validation and first-come-engine splits): per split, the
  default's missed check-1 cells and the rules that meet check 1 alone there (``check1_rules``: systems by name,
  the oracle's candidate rules as "Oracle/<policy>", bench/sim/matrix_report.py); per check-2 cell, the oracle's P90
  and throughput over the best single balancer's.
* The KV-event benchmarks (bench/results/kv_routing.json, simulated; kv_live.json, live): at the load where the
  trie's P90 TTFT first exceeds 2 s, every system's P90 and throughput, the requests sent and completed, and the
  ceiling on throughput an open-loop replay allows (every request sent, answered the moment it is sent).
"""
import collections
import json
from pathlib import Path

R = Path("bench/results")


def matrix(path: Path) -> None:
    d = json.loads(path.read_text())
    print(f"== {path} (split {d['split']}, seeds {d['seeds']}, runs at {str(d['provenance']['commit'])[:7]})")
    missed = [c for c in d["cells"] if not c["check1"]]
    kinds = collections.Counter()
    for c in missed:
        rules = c["check1_rules"]
        kind = "none" if not rules else "deployable" if any("/" not in r for r in rules) else "oracle only"
        kinds[kind] += 1
        print(f"  check 1 missed {c['workload']}@{c['load']:g}x: met alone by {', '.join(rules) or 'no rule'} ({kind})")
    print(f"  missed {len(missed)} of {len(d['cells'])}: {dict(kinds)}")
    for c in d["cells"]:
        if c["check2"] is not None:
            print(f"  check 2 {c['workload']}@{c['load']:g}x: default {c['single_p90_ratio']:.2f}x P90 /"
                  f" {c['single_tput_ratio']:.3f}x req/s; oracle {c['oracle_single_p90_ratio']:.2f}x /"
                  f" {c['oracle_single_tput_ratio']:.3f}x (line: <= 0.5x and >= 1.12x)")


def kv_sim() -> None:
    rows = collections.defaultdict(dict)
    for r in json.loads((R / "kv_routing.json").read_text()):
        rows[r["scenario"]][r["system"]] = r
    for cell, systems in rows.items():
        if systems["SkyLB"]["ttft_p90"] > 2.0:
            trie = systems["SkyLB"]
            print(f"== kv_routing.json (simulated, seed {trie['seed']}): the trie's P90 first above 2 s at {cell}")
            for name, r in systems.items():
                print(f"  {name:9} P90 {r['ttft_p90']:.2f} s ({r['ttft_p90'] / trie['ttft_p90']:.2f}x the trie's), "
                      f"{r['throughput_rps']:.3f} req/s ({r['throughput_rps'] / trie['throughput_rps']:.3f}x), "
                      f"{r['completed']} of {r['sent']} completed, hit {r['hit_rate']:.3f} "
                      f"(KV-bounded ideal {r['ideal_kv_hit_rate']:.3f})")
            return


def kv_live() -> None:
    d = json.loads((R / "kv_live.json").read_text())
    duration = d["setup"].get("duration_s", 60)
    runs = collections.defaultdict(dict)
    for row in d["rows"]:
        runs[(row["rate_rps"], row["seed"])][row["system"]] = row["figures"]
    for (rate, seed), systems in sorted(runs.items()):
        trie = systems["skylb"]
        if trie["ttft_p90_ms"] > 2000:
            ceiling = trie["sent"] / duration
            print(f"== kv_live.json (live): the trie's P90 above 2 s at {rate:g} req/s, seed {seed}: {trie['sent']} "
                  f"requests in {duration:g} s, so at most {ceiling:.2f} req/s ({ceiling / trie['throughput_rps']:.2f}x "
                  "the trie's) even if each were answered the moment it was sent")
            for name, f in systems.items():
                print(f"  {name:18} P90 {f['ttft_p90_ms']:.0f} ms, {f['throughput_rps']:.3f} req/s "
                      f"({f['throughput_rps'] / trie['throughput_rps']:.3f}x), {f['completed']} of {f['sent']}")


if __name__ == "__main__":
    for p in (R / "matrix.json", R / "matrix-val" / "matrix.json", R / "matrix-fcfs" / "matrix.json"):
        matrix(p)
    kv_sim()
    kv_live()
