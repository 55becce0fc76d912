"""Live benchmarks: SkyLB and the balancers deployed instead, as real processes on this machine."""
