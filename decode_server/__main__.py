"""`python -m decode_server`: the front door. Continuous batching on one device; prompts are
prefilled by a prefill server (disaggregated) or here (colocated, chunked, layered, partitioned)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

from decode_server.config import DecodeConfig, DecodeFaults
from serving.build_runner import build_runner
from serving.cli_args import add_dataclass_args
from serving.cli_args import parse_config as parse_into
from serving.gc_freeze import freeze_startup_objects
from serving.grpc_common import (
    Health,
    StartupError,
    bind,
    channel_credentials,
    check_port_free,
    make_server,
    run_main,
    serve_until_signalled,
    server_ssl_context,
    setup_process,
    start_metrics,
)
from serving.prefix_metrics import register_prefix_cache_metrics

log = logging.getLogger("decode_server")
SERVICE = "pd.v1.Decode"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m decode_server", description=__doc__)
    add_dataclass_args(parser, DecodeConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> tuple[DecodeConfig, argparse.Namespace]:
    return parse_into(build_parser(), DecodeConfig, argv)


def prefill_addresses(spec: str) -> list[str]:
    return [a.strip() for a in spec.split(",") if a.strip()]


async def serve(cfg: DecodeConfig, faults: DecodeFaults) -> int:
    from decode_server import metrics
    from decode_server.admission import Admission
    from decode_server.core import DecodeCore
    from decode_server.http_api import OpenAIApi
    from decode_server.prefill_client import PrefillRouter
    from decode_server.request_parser import RequestParser
    from decode_server.scheduler import BatchScheduler
    from decode_server.service import DecodeService, add_to_server
    from decode_server.sm_split import open_partitions
    from decode_server.step_trace import StepTrace
    from engine.prefix_cache import PrefixCache
    from serving.gc_freeze import GcPauses
    from serving.loop_lag import LoopLagProbe

    started = time.perf_counter()
    check_port_free(cfg, [(cfg.http_port, "--http-port")])
    health = Health([SERVICE])
    await health.set(False)
    runner = await asyncio.to_thread(build_runner, cfg, "decode", cfg.max_batch_size, cfg.cuda_graphs, 10.0)
    tokenizer = runner.tokenizer
    loop = asyncio.get_running_loop()
    cache = PrefixCache(runner.pool.allocator, runner.layout.block_size, enabled=cfg.prefix_cache)
    admission = Admission(runner.pool, cfg.max_queued_requests, cfg.max_waiting_tokens, loop, cache)
    partitions, prefill_sms = open_partitions(cfg, runner.device)
    if cfg.partitioned_short_first and partitions is None:
        raise StartupError("--partitioned-short-first: this device has no green contexts, so partitioned prompts "
                           "are prefilled as layered ones, in turn; drop the flag")
    trace = StepTrace(cfg.step_trace) if cfg.step_trace else None
    scheduler = BatchScheduler(runner, admission, cfg.max_batch_size, cfg.layer_slice_tokens,
                               die_after_steps=faults.engine_die_after_steps, partitions=partitions,
                               prefill_sms=prefill_sms, warm_up=cfg.warms_up(runner.device.type),
                               overlap_steps=cfg.overlap_steps, trace=trace,
                               partitioned_short_first=cfg.partitioned_short_first)
    if faults.engine_die_after_steps is not None:
        log.warning("fault injection: the engine dies after %d decode steps", faults.engine_die_after_steps)
    router = None
    if cfg.prefill_addr:
        creds = channel_credentials(cfg.tls_ca, cfg.tls_client_cert, cfg.tls_client_key)
        router = PrefillRouter(prefill_addresses(cfg.prefill_addr), runner, cfg.kv_transport,
                               cfg.prefill_timeout_s, creds, verify_kv=cfg.kv_checksum == "on")
    eos_ids = frozenset(runner.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
    loop_lag = gc_pauses = None
    if cfg.loop_lag_probe_ms:
        loop_lag = LoopLagProbe(loop, cfg.loop_lag_probe_ms / 1e3, observe=metrics.LOOP_LAG.observe)
        gc_pauses = GcPauses()
    core = DecodeCore(cfg, scheduler, router, eos_ids, loop_lag, gc_pauses)
    parser = RequestParser(cfg, tokenizer, runner.max_model_len, runner.config.vocab_size,
                           scheduler.check_prefill_sms)
    service = DecodeService(core, parser)
    http = (OpenAIApi(core, parser, served_model_name(cfg, runner.config.name), cfg.http_timeout_s,
                      cfg.ignore_unknown_fields, cfg.http_max_body_bytes) if cfg.http_port else None)
    metrics.bind_live_gauges(lambda: cache.num_available, cache.num_blocks, lambda: len(scheduler.running),
                             core.num_waiting)
    register_prefix_cache_metrics(cache)
    fatal = asyncio.Event()
    scheduler.on_failure.append(lambda: loop.call_soon_threadsafe(fatal.set))
    server = make_server(lambda s: add_to_server(service, s), [SERVICE], health)
    port = bind(server, cfg)
    await health.listen_plaintext(cfg)
    start_metrics(cfg)
    scheduler.start()
    if router is not None and cfg.warms_up(runner.device.type):
        await router.warm_up()
    # what start-up made stays out of the collector's full passes; before the probes, which would count its pass
    freeze_startup_objects()
    if loop_lag is not None:
        loop_lag.start()
    if gc_pauses is not None:
        gc_pauses.start()
    if http is not None:
        await http.start(cfg.host, cfg.http_port, server_ssl_context(cfg))
    await server.start()
    await health.set(True)
    log.info("decode server SERVING on %s:%d (%s, %s, mode %s%s)%s; started in %.1fs", cfg.host, port, runner.device,
             runner.config.name, cfg.default_mode, f", prefill at {cfg.prefill_addr}" if cfg.prefill_addr else "",
             f"; OpenAI API at http{'s' if cfg.tls_cert else ''}://{cfg.host}:{cfg.http_port}/v1 as model "
             f"{http.model_name!r}" if http is not None else "", time.perf_counter() - started)

    code = await serve_until_signalled(server, health, cfg.drain_timeout_s, on_stop=scheduler.stop, fatal=fatal,
                                       on_drain=core.start_draining, in_flight=lambda: len(core.in_flight))
    if http is not None:
        await http.stop()
    if loop_lag is not None:
        loop_lag.stop()
    if gc_pauses is not None:
        gc_pauses.stop()
    if router is not None:
        await router.close()
    if trace is not None:
        trace.close()
    return code


def served_model_name(cfg: DecodeConfig, loaded_name: str) -> str:
    """--served-model-name, else the checkpoint folder's name, else the preset's."""
    if cfg.served_model_name:
        return cfg.served_model_name
    return Path(cfg.model).resolve().name if cfg.model else loaded_name


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config(argv)
    setup_process(cfg)
    run_main(lambda: serve(cfg, DecodeFaults.from_env()))


if __name__ == "__main__":
    main()
