"""Benchmarks of one part alone, no server process: kernels, the engine's steps, the event loops' work."""
