"""Starting what the benchmarks and tests run: SkyLB's processes, the local deployment, real engines."""
