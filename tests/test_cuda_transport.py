"""NCCL, CUDA IPC and NIXL handoffs between real server processes. Needs GPUs (nccl: two)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc

from engine.transport.nixl import nixl_available
from tests.servers import ServerProcess, free_port
from tests.test_reliability_fixtures import scrape, wait_until

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.e2e, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]


def needs(transport: str) -> None:
    if transport == "nccl" and GPUS < 2:
        pytest.skip("NCCL between two processes needs two GPUs")
    if transport == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")


def gpu_pair(transport: str, logs: Path, extra: list[str] | None = None,
             prefix_cache: bool = True) -> tuple[ServerProcess, ServerProcess]:
    common = ["--kv-transport", transport, "--max-model-len", "8192", "--kv-cache-gb", "2",
              *([] if prefix_cache else ["--no-prefix-cache"])]
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


@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc", "grpc", "nixl"])
def test_handoff_tokens_equal_colocated(transport: str, server_logs: Path) -> None:
    """Without the prefix cache: with it, the colocated request would find the disaggregated one's blocks and
    prefill only its last block after a cached prefix, which rounds differently in bf16 (results.md)."""
    needs(transport)
    prefill, decode = gpu_pair(transport, server_logs, prefix_cache=False)
    try:
        for length in (5, 700, 3000):
            prompt = [(i * 31 + length) % 256 for i in range(length)]
            disagg = generate(decode.address, prompt, decode_pb2.PREFILL_MODE_DISAGGREGATED)
            assert disagg == generate(decode.address, prompt, decode_pb2.PREFILL_MODE_COLOCATED)
        assert f"over {transport}" in decode.log()
        assert "prefill CUDA graphs" in prefill.log()  # the 5-token prompt replayed them on both sides
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc", "nixl"])
def test_prefill_killed_mid_transfer_then_restarted(transport: str, server_logs: Path) -> None:
    """Without the prefix cache, for the reason above: the disaggregated request after the restart
    would find the colocated one's blocks."""
    needs(transport)
    metrics_port = free_port()
    prefill, decode = gpu_pair(transport, server_logs, ["--prefill-timeout-s", "20", "--metrics-port",
                                                        str(metrics_port)], prefix_cache=False)

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


@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc", "grpc", "nixl"])
def test_a_conversation_hands_over_only_the_uncached_kv(transport: str, server_logs: Path) -> None:
    """Later turns of a conversation, disaggregated, with both prefix caches: the decode server holds
    the history and the prefill server sends only the KV after it (checksummed bit for bit on both
    sides), its later turns replayed as prefill graphs. In float32 (nccl, grpc) the tokens equal a
    cache-less server's; cuda-ipc moves 2-byte KV, where the cached prefix's rounding may part greedy
    tokens (bench.micro.mode_parity), so there only the handoff is checked."""
    needs(transport)
    dtype = "bfloat16" if transport == "cuda-ipc" else "float32"
    common = ["--preset", "tiny", "--dtype", dtype, "--kv-transport", transport, "--kv-cache-gb", "1"]
    prefill = ServerProcess("prefill_server", common, server_logs, device="cuda:0").start(timeout=300)
    decode = ServerProcess("decode_server", [*common, "--prefill-addr", prefill.address, "--kv-checksum", "on"],
                           server_logs, device=f"cuda:{min(1, GPUS - 1)}").start(timeout=300)
    reference = ServerProcess("decode_server", [*common, "--no-prefix-cache", "--mode", "colocated"], server_logs,
                              device="cuda:0").start(timeout=300)
    try:
        history = [(i * 7 + 3) % 256 for i in range(700)]
        with grpc.insecure_channel(decode.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            for turn in range(3):
                replies = list(stub.Generate(decode_pb2.GenerateRequest(
                    token_ids=history, max_new_tokens=20, ignore_eos=True,
                    prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=120))
                answer, timing = [r.token_id for r in replies], replies[-1].timing
                if turn:
                    assert timing.cached_tokens >= len(history) - 20 - 50 - 16, turn
                    sent = len(history) - timing.cached_tokens
                    assert timing.kv_bytes == sent * 4 * 2 * 2 * 16 * (2 if dtype == "bfloat16" else 4)
                if dtype == "float32":
                    assert answer == generate(reference.address, history, decode_pb2.PREFILL_MODE_COLOCATED, 20)
                history = history + answer + [(i * 13 + turn) % 256 for i in range(50)]
        assert "prefill CUDA graphs" in prefill.log()  # later turns (about 70 tokens) replayed them there
    finally:
        for server in (reference, decode, prefill):
            server.stop()
