"""Prometheus metrics of the prefill server."""

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

PREFILL_SECONDS = Histogram("prefill_seconds", "Prefill compute time per request", buckets=LATENCY_BUCKETS)
KV_TRANSFER_SECONDS = Histogram("kv_transfer_seconds", "KV send time after the last layer's prefill",
                                buckets=LATENCY_BUCKETS)
KV_TRANSFER_BYTES = Counter("kv_transfer_bytes_total", "KV bytes sent to decode servers", ["transport"])
KV_STREAMED_BYTES = Counter("kv_streamed_bytes_total", "KV bytes handed to gRPC response streams, counted as each "
                            "chunk goes (grows during a transfer)")
REQUESTS_RUNNING = Gauge("num_requests_running", "Prefills in progress")
REQUESTS_WAITING = Gauge("num_requests_waiting", "Prefills queued")
KV_CACHE_USAGE = Gauge("kv_cache_usage_perc", "Fraction of KV pool blocks in use")
KV_FREE_BLOCKS = Gauge("kv_cache_free_blocks", "KV pool blocks a request can have right now: free, or holding a "
                       "cached prefix nobody uses")
KV_TOTAL_BLOCKS = Gauge("kv_cache_total_blocks", "KV pool blocks that requests can use")
REQUESTS_TOTAL = Counter("prefill_requests_total", "Finished prefill requests by gRPC status", ["status"])


def bind_live_gauges(free_blocks: Callable[[], int], total_blocks: int) -> None:
    """KV gauges read the pool when scraped, so they are exact whatever the worker last set."""
    KV_FREE_BLOCKS.set_function(free_blocks)
    KV_TOTAL_BLOCKS.set(total_blocks)
    KV_CACHE_USAGE.set_function(lambda: 1.0 - free_blocks() / total_blocks)
