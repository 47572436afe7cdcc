"""`python -m prefill_server`: one device, one model copy, prefill jobs over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from engine.transport.grpc_wire import add_prefill_servicer
from prefill_server.config import PrefillConfig, PrefillFaults
from serving.build_runner import build_runner
from serving.cli_args import add_dataclass_args
from serving.cli_args import parse_config as parse_into
from serving.gc_freeze import freeze_startup_objects
from serving.grpc_common import (
    Health,
    StartupError,
    bind,
    check_port_free,
    make_server,
    run_main,
    serve_until_signalled,
    setup_process,
    start_metrics,
)
from serving.prefix_metrics import register_prefix_cache_metrics

log = logging.getLogger("prefill_server")
SERVICE = "pd.v1.Prefill"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prefill_server", description=__doc__)
    add_dataclass_args(parser, PrefillConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> PrefillConfig:
    return parse_into(build_parser(), PrefillConfig, argv)[0]


async def serve(cfg: PrefillConfig, faults: PrefillFaults) -> int:
    from engine.prefix_cache import PrefixCache
    from prefill_server import metrics
    from prefill_server.service import PrefillService
    from prefill_server.worker import PrefillWorker

    started = time.perf_counter()
    check_port_free(cfg)
    health = Health([SERVICE])
    await health.set(False)
    runner = await asyncio.to_thread(
        build_runner, cfg, "prefill", 1, False, 4.0,
        cfg.kv_gb_default(on_gpu=cfg.device != "cpu" and _cuda_available()), cfg.cuda_graphs)
    cache = PrefixCache(runner.pool.allocator, runner.layout.block_size, enabled=cfg.prefix_cache)
    worker = PrefillWorker(runner, cache, warm_up=cfg.warms_up(runner.device.type))
    service = PrefillService(cfg, runner, worker, faults)
    if faults.layer_delay_s:
        log.warning("fault injection: every prefill layer is delayed by %.3fs", faults.layer_delay_s)
    if faults.corrupt_kv:
        log.warning("fault injection: one bit of every prompt's KV flips once it is sent")
    metrics.bind_live_gauges(lambda: cache.num_available, cache.num_blocks)
    register_prefix_cache_metrics(cache)
    server = make_server(lambda s: add_prefill_servicer(service, s), [SERVICE], health)
    port = bind(server, cfg)
    await health.listen_plaintext(cfg)
    start_metrics(cfg)
    worker.start()
    freeze_startup_objects()  # last: what start-up made stays out of the collector's full passes
    await server.start()
    await health.set(True)
    log.info("prefill server SERVING on %s:%d (%s, %s); started in %.1fs", cfg.host, port, runner.device,
             runner.config.name, time.perf_counter() - started)
    return await serve_until_signalled(server, health, cfg.drain_timeout_s, on_stop=worker.stop,
                                       on_drain=service.start_draining, in_flight=lambda: service.in_flight)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    setup_process(cfg)
    run_main(lambda: serve(cfg, PrefillFaults.from_env()))


if __name__ == "__main__":
    try:
        main()
    except StartupError as e:  # pragma: no cover - run_main already reports these
        raise SystemExit(f"error: {e}") from e
