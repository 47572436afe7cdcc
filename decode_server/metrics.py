"""Prometheus metrics of the decode server, named as serving users know them."""

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)

TTFT = Histogram("time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request (server side)",
                buckets=LATENCY_BUCKETS)
E2E = Histogram("e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS)
QUEUE_TIME = Histogram("request_queue_time_seconds", "Arrival to admission (KV blocks reserved)",
                       buckets=LATENCY_BUCKETS)
PREFILL_SECONDS = Histogram("prefill_seconds", "Prefill compute per request (remote or local)",
                            buckets=LATENCY_BUCKETS)
KV_TRANSFER_SECONDS = Histogram("kv_transfer_seconds", "Remote prefill start to KV in this server's pool, "
                                "less the prefill server's queue, compute and checksum", buckets=LATENCY_BUCKETS)
KV_TRANSFER_BYTES = Counter("kv_transfer_bytes_total", "KV bytes received from prefill servers", ["transport"])
REQUESTS_RUNNING = Gauge("num_requests_running", "Sequences in the decode batch")
REQUESTS_WAITING = Gauge("num_requests_waiting", "Requests accepted but not yet decoding: waiting for KV blocks, "
                         "in prefill (remote or local), or waiting for a batch slot")
KV_CACHE_USAGE = Gauge("kv_cache_usage_perc", "Fraction of KV pool blocks in use")
KV_FREE_BLOCKS = Gauge("kv_cache_free_blocks", "KV pool blocks free right now")
KV_TOTAL_BLOCKS = Gauge("kv_cache_total_blocks", "KV pool blocks that requests can use")
REQUEST_SUCCESS = Counter("request_success_total", "Finished requests by finish reason", ["finish_reason"])
REQUEST_FAILURE = Counter("request_failure_total", "Failed requests by gRPC status code", ["code"])
LOOP_LAG = Histogram("event_loop_lag_seconds", "How long a callback handed to the event loop from another thread "
                     "waited to run (--loop-lag-probe-ms)",
                     buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
DECODE_STEP = Histogram("decode_step_seconds", "One batched decode step", buckets=LATENCY_BUCKETS)


def bind_live_gauges(free_blocks: Callable[[], int], total_blocks: int, running: Callable[[], int],
                     waiting: Callable[[], int]) -> None:
    """The gauges read the live state when scraped, so they are exact even while the engine idles."""
    KV_FREE_BLOCKS.set_function(free_blocks)
    KV_TOTAL_BLOCKS.set(total_blocks)
    KV_CACHE_USAGE.set_function(lambda: 1.0 - free_blocks() / total_blocks)
    REQUESTS_RUNNING.set_function(running)
    REQUESTS_WAITING.set_function(waiting)
