"""Scratch: sticky re-homing of prefix groups from an overloaded region (monkeypatch of PushToPrefixHolder.decide).

When a cache hit is about to be pushed into a full local holder and this region's load per replica (requests in its
engines plus its queue, over its replicas) is above RH_RATIO x the least loaded reachable peer's + RH_SLACK, the
request's prefix group (its prompt up to the holder's match, in 256-char steps) is re-homed to that peer: this
request and the group's later pushes go there while that peer's load stays at most this region's + RH_SLACK.
"""
import os, sys, zlib
sys.path.insert(0, os.getcwd())
from skylb.core.plugins.push_to_holder import PushToPrefixHolder
from skylb.core.state import ReplicaState

RATIO = float(os.environ.get("RH_RATIO", "1.2"))
SLACK = float(os.environ.get("RH_SLACK", "4"))
STEP = int(os.environ.get("RH_STEP", "256"))
STATS = os.environ.get("RH_STATS") == "1"
_decide = PushToPrefixHolder.decide
_homes = {}
_count = {"moved": 0, "stuck": 0, "dropped": 0}


def _peer_load(p):
    if p.load_per_replica is None or not p.replicas:
        return None
    return p.load_per_replica + (p.queue_len + p.sent_since_probe) / p.replicas


def decide(self, c, picked):
    verdict = _decide(self, c, picked)
    if not isinstance(verdict, ReplicaState) or not c.request.may_forward:
        return verdict
    peers = [(l, p) for p in c.reachable if (l := _peer_load(p)) is not None]
    if not peers:
        return verdict
    everyone = [*c.local, *c.busy]
    local = (sum(r.in_engine for r in everyone) + c.queued) / len(everyone)
    m = self.locality.match_among(c.request, {r.id for r in everyone})
    text = c.request.text
    cut = int(m.ratio * len(text)) // STEP * STEP
    if cut <= 0:
        return verdict
    key = zlib.crc32(text[:cut].encode())
    homes = _homes.setdefault(id(self), {})
    region = homes.get(key)
    if region is not None:
        for l, p in peers:
            if p.region == region:
                if l <= local + SLACK:
                    _count["stuck"] += 1
                    return p
                break
        del homes[key]
        _count["dropped"] += 1
    l, best = min(peers, key=lambda lp: lp[0])
    if local > RATIO * l + SLACK:
        homes[key] = best.region
        _count["moved"] += 1
        return best
    return verdict


PushToPrefixHolder.decide = decide

if __name__ == "__main__":
    import atexit
    if STATS:
        atexit.register(lambda: print(_count, file=sys.stderr))
    from bench.sim import ab
    sys.argv = [sys.argv[0], *sys.argv[1:]]
    sys.exit(ab.main())
