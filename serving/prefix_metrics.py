"""Prometheus samples of a server's prefix cache, read from the cache itself when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.prefix_cache import PrefixCache


class PrefixCacheCollector(Collector):
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.cache.stats()
        yield CounterMetricFamily("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=s.queried_tokens)
        yield CounterMetricFamily("prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache held",
                                  value=s.hit_tokens)
        yield GaugeMetricFamily("prefix_cache_blocks", "KV blocks holding cached prefixes, in use or not",
                                value=s.cached_blocks)
        yield GaugeMetricFamily("prefix_cache_used_blocks", "Cached KV blocks some request is using",
                                value=s.used_blocks)


def register_prefix_cache_metrics(cache: PrefixCache) -> None:
    REGISTRY.register(PrefixCacheCollector(cache))
