"""CPU seconds (utime+stime, clock ticks) of each skylb process at two moments; prints the deltas."""
import os, sys, time
TICK = os.sysconf("SC_CLK_TCK")
def snap():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if "skylb" not in args or "procsample" in args: continue
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[pid] = ((int(f[11]) + int(f[12])) / TICK, args)
        except OSError:
            pass
    return out
time.sleep(float(sys.argv[1])); a = snap(); t0 = time.time()
time.sleep(float(sys.argv[2])); b = snap(); t1 = time.time()
print(f"window {t1 - t0:.1f} s")
for pid, (cpu, args) in sorted(b.items(), key=lambda kv: kv[1][1]):
    if pid in a:
        words = args.split()
        role = " ".join(w for w in words[3:6])
        region = words[words.index("--region") + 1] if "--region" in words else ""
        print(f"{cpu - a[pid][0]:7.2f} s  {role} {region}")
