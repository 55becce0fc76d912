"""Scratch: a region advertises to its peers only the replicas with KV usage below XP_PEER_KV (the status)."""
import os
from skylb.core import router as R
LIM = float(os.environ.get("XP_PEER_KV", "1.1"))
orig_status = R.Router.status
def status(self, now):
    orig_avail = self.available_replicas
    def avail(now2):
        return [r for r in orig_avail(now2) if r.kv_usage is None or r.kv_usage < LIM]
    self.available_replicas = avail
    try:
        return orig_status(self, now)
    finally:
        del self.available_replicas
R.Router.status = status
