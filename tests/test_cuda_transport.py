"""NCCL and CUDA IPC handoffs between real server processes. Needs GPUs (nccl: two)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc

from tests.servers import ServerProcess, free_port
from tests.test_reliability_fixtures import scrape, wait_until

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]


def needs(transport: str) -> None:
    if transport == "nccl" and GPUS < 2:
        pytest.skip("NCCL between two processes needs two GPUs")


def gpu_pair(transport: str, logs: Path, extra: list[str] | None = None) -> tuple[ServerProcess, ServerProcess]:
    common = ["--kv-transport", transport, "--max-model-len", "8192", "--kv-cache-gb", "2"]
    prefill = ServerProcess("prefill_server", common, logs, device="cuda:0").start(timeout=300)
    # --kv-checksum on: every handoff checksummed bit for bit (DATA_LOSS otherwise)
    decode = ServerProcess("decode_server", [*common, "--prefill-addr", prefill.address, "--max-batch-size", "4",
                                             "--kv-checksum", "on", *(extra or [])], logs,
                           device=f"cuda:{min(1, GPUS - 1)}")
    decode.start(timeout=300)
    return prefill, decode


def generate(address: str, prompt: list[int], mode: int, n: int = 24, timeout: float = 120) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        replies = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
            token_ids=prompt, max_new_tokens=n, ignore_eos=True, prefill_mode=mode), timeout=timeout)
        return [r.token_id for r in replies]


@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc", "grpc"])
def test_handoff_tokens_equal_colocated(transport: str, server_logs: Path) -> None:
    needs(transport)
    prefill, decode = gpu_pair(transport, server_logs)
    try:
        for length in (5, 700, 3000):
            prompt = [(i * 31 + length) % 256 for i in range(length)]
            disagg = generate(decode.address, prompt, decode_pb2.PREFILL_MODE_DISAGGREGATED)
            assert disagg == generate(decode.address, prompt, decode_pb2.PREFILL_MODE_COLOCATED)
        assert f"over {transport}" in decode.log()
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc"])
def test_prefill_killed_mid_transfer_then_restarted(transport: str, server_logs: Path) -> None:
    needs(transport)
    metrics_port = free_port()
    prefill, decode = gpu_pair(transport, server_logs, ["--prefill-timeout-s", "20", "--metrics-port",
                                                        str(metrics_port)])

    def decode_kv_idle() -> bool:
        m = scrape(metrics_port)
        return m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"] and m["num_requests_running"] == 0

    try:
        prompt = list(range(256)) * 28
        errors: list[grpc.StatusCode] = []

        def victim() -> None:
            try:
                generate(decode.address, prompt, decode_pb2.PREFILL_MODE_DISAGGREGATED)
            except grpc.RpcError as e:
                errors.append(e.code())

        thread = threading.Thread(target=victim)
        thread.start()
        time.sleep(0.05)
        prefill.kill()
        thread.join(60)
        assert not thread.is_alive()
        # the failed transfer's blocks come back to the decode server's pool
        wait_until(decode_kv_idle, timeout=10)
        # the decode server keeps serving (colocated needs no prefill server)
        assert generate(decode.address, prompt[:100], decode_pb2.PREFILL_MODE_COLOCATED)
        restarted = ServerProcess("prefill_server", ["--kv-transport", transport, "--max-model-len", "8192",
                                                     "--kv-cache-gb", "2"], server_logs, port=prefill.port,
                                  device="cuda:0").start(timeout=300)
        try:
            short = prompt[:500]
            expected = generate(decode.address, short, decode_pb2.PREFILL_MODE_COLOCATED)
            deadline = time.monotonic() + 10
            while True:  # the decode server reconnects on its own (backoff capped at a second)
                try:
                    assert generate(decode.address, short, decode_pb2.PREFILL_MODE_DISAGGREGATED) == expected
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        finally:
            restarted.stop()
        assert errors in ([], [grpc.StatusCode.UNAVAILABLE])
    finally:
        decode.stop()
        prefill.stop()
