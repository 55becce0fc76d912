"""Compare two files of `bench.sim.ab` lines: per cell, the mean P90 TTFT (s), throughput (req/s) and forwarded share
over the seeds, their ratios (second file / first), and the geometric means over the cells present in both.

Usage: python compare.py BASE.txt VARIANT.txt ("<<": P90 over 1.05x or throughput under 0.99x; ">>": the reverse).
"""
import re, sys, math, collections
def load(f):
    d = collections.defaultdict(list)
    for line in open(f):
        m = re.match(r"(\S+)\s+\S+\s+s(\d+)\s+p90=\s*([\d.]+).*thr=\s*([\d.]+).*hit=\s*([\d.]+)%.*fwd=\s*([\d.]+)%", line)
        if m:
            d[m.group(1)].append((float(m.group(3)), float(m.group(4)), float(m.group(5)), float(m.group(6))))
    return d
a, b = load(sys.argv[1]), load(sys.argv[2])
lp, lt = [], []
for cell in a:
    if cell not in b: continue
    pa = sum(x[0] for x in a[cell]) / len(a[cell]); pb = sum(x[0] for x in b[cell]) / len(b[cell])
    ta = sum(x[1] for x in a[cell]) / len(a[cell]); tb = sum(x[1] for x in b[cell]) / len(b[cell])
    fa = sum(x[3] for x in a[cell]) / len(a[cell]); fb = sum(x[3] for x in b[cell]) / len(b[cell])
    lp.append(math.log(pb / pa)); lt.append(math.log(tb / ta))
    flag = " <<" if pb / pa > 1.05 or tb / ta < 0.99 else (" >>" if pb / pa < 0.95 or tb / ta > 1.01 else "")
    print(f"{cell:24s} p90 {pa:7.2f} -> {pb:7.2f} ({pb/pa:5.2f}x)  thr {ta:6.2f} -> {tb:6.2f} ({tb/ta:6.3f})  fwd {fa:4.1f} -> {fb:4.1f}{flag}")
print(f"cells {len(lp)}  P90 geomean {math.exp(sum(lp)/len(lp)):.3f}  thr geomean {math.exp(sum(lt)/len(lt)):.4f}")
