"""The cluster planner: N prefill x M decode servers under a seeded load, simulated on the CPU from the
costs the benchmarks recorded in bench/results (`python -m planner`)."""
