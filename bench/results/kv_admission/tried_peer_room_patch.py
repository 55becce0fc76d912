"""Scratch: a balancer tells its peers the most free KV tokens among its replicas with room (and whether they reserve
output); a peer is offered a request only when that room admits it (uncached: the whole prompt, the sender cannot
know the peer's cache). XP_PEERROOM=1."""
import os
from skylb.core import router as R
from skylb.core.estimate import prompt_tokens
ON = os.environ.get("XP_PEERROOM") == "1"
orig_status, orig_observe, orig_place, orig_avail = R.Router.status, R.Router.observe_peer, R.Router._place, R.Router.peer_available
def status(self, now):
    st = orig_status(self, now)
    frees = [(r.kv_capacity_tokens * (1 - r.kv_usage) - r.backlog_tokens, r.output_reserve_tokens)
             for r in self.available_replicas(now) if r.kv_capacity_tokens and r.kv_usage is not None]
    object.__setattr__(st, "_kv_room", max(frees) if frees else None)
    return st
def observe_peer(self, region, *, now, status, error=None, rtt_s=None):
    if status is not None:
        self.__dict__.setdefault("_peer_room", {})[region] = getattr(status, "_kv_room", None)
    return orig_observe(self, region, now=now, status=status, error=error, rtt_s=rtt_s)
def _place(self, request, now):
    self.__dict__["_cur"] = request
    try:
        return orig_place(self, request, now)
    finally:
        self.__dict__["_cur"] = None
def peer_available(self, peer, now, model="", api="openai"):
    ok = orig_avail(self, peer, now, model, api)
    req = self.__dict__.get("_cur")
    if not ok or not ON or req is None:
        return ok
    room = self.__dict__.get("_peer_room", {}).get(peer.region)
    if room is None:
        return ok
    free, clip = room
    reserve = min(req.max_tokens or clip, clip) if clip else 0
    return prompt_tokens(req) + reserve <= free
R.Router.status, R.Router.observe_peer, R.Router._place, R.Router.peer_available = status, observe_peer, _place, peer_available
