"""Scratch: drop local candidates whose free KV cannot hold the request's prompt (env XP_KVROOM=1)."""
import os
from skylb.core import router as R
from skylb.core.estimate import prompt_tokens
orig = R.Router._local_candidates
MODE = os.environ.get("XP_KVROOM", "")
def fits(r, tokens):
    cap, usage = r.kv_capacity_tokens, r.kv_usage
    if cap is None or usage is None or tokens > cap * 0.9:
        return True
    running = (r.running or 0) + len(r.dispatch_times)
    if max(running, r.outstanding) == 0:
        return True
    return tokens <= cap * (1.0 - usage) - r.backlog_tokens
def patched(self, request, now):
    local, free, serving = orig(self, request, now)
    if MODE:
        n = prompt_tokens(request)
        local = [r for r in local if fits(r, n)]
        free = [r for r in free if fits(r, n)]
    return local, free, serving
R.Router._local_candidates = patched
