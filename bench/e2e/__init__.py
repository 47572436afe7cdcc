"""End-to-end benchmarks: real prefill and decode server processes, driven by the clients."""
