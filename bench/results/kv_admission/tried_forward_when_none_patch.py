"""Scratch over the real KVAdmission: when no local replica admits the request and a peer has room, no local
candidate (the request is forwarded); with no peer with room, all local candidates stay."""
from skylb.core import router as R
orig = R.Router._local_candidates
def patched(self, request, now):
    local, free, serving = orig(self, request, now)
    adm = self.policy.admission
    if adm is not None and local and not any(adm.admits(request, r) for r in local) and request.may_forward:
        if any(self.peer_available(p, now, request.model, request.api) for p in self.peers.values()):
            return [], [], serving
    return local, free, serving
R.Router._local_candidates = patched
