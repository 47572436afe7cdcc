"""Prometheus metrics of the prefill server."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

PREFILL_SECONDS = Histogram("prefill_seconds", "Prefill compute time per request", buckets=LATENCY_BUCKETS)
KV_TRANSFER_SECONDS = Histogram("kv_transfer_seconds", "KV send time after the last layer's prefill",
                                buckets=LATENCY_BUCKETS)
KV_TRANSFER_BYTES = Counter("kv_transfer_bytes_total", "KV bytes sent to decode servers", ["transport"])
REQUESTS_RUNNING = Gauge("num_requests_running", "Prefills in progress")
REQUESTS_WAITING = Gauge("num_requests_waiting", "Prefills queued")
KV_CACHE_USAGE = Gauge("kv_cache_usage_perc", "Fraction of KV pool blocks in use")
REQUESTS_TOTAL = Counter("prefill_requests_total", "Finished prefill requests by gRPC status", ["status"])
