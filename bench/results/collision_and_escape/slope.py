"""Variant: prefer_peer weighs token-derived seconds (local estimate, peer's wait and prefill) by K against the round trip."""
import sys, os
from skylb.core.plugins import prefer_peer as pp
K = float(os.environ.get("K", "0.6"))
orig_cost = pp.PreferFasterPeer.peer_cost_s
def peer_cost_s(self, request, peer, ratio, replica=None):
    c = orig_cost(self, request, peer, ratio, replica)
    if c is None or peer.rtt_s is None:
        return c
    return peer.rtt_s + K * (c - peer.rtt_s)
pp.PreferFasterPeer.peer_cost_s = peer_cost_s
orig_cheaper = pp.PreferFasterPeer.cheaper_peer
def cheaper_peer(self, c, local_s, replica, *, holders_only=False):
    return orig_cheaper(self, c, K * local_s, replica, holders_only=holders_only)
pp.PreferFasterPeer.cheaper_peer = cheaper_peer
orig_may = pp.PreferFasterPeer._may_beat
from bench.sim import ab
sys.exit(ab.main())
