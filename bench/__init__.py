"""Benchmarks: `python bench/<name>.py` for the single-file ones; `python -m bench.stages`
and `python -m bench.peers.run` (from the repository root) for those that share code
with bench/peers."""
