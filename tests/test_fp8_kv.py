"""`--kv-cache-dtype fp8`: e4m3 K and V (scale 1.0) in half the pool bytes, written as the model's
values rounded once, read back by attention, carried by the grpc transport between real servers,
and part of the KV layout both servers of a pair must share."""

from __future__ import annotations

import pytest
import torch

from engine.decode_batch import DecodeSeq
from engine.kv_cache import FP8_KV_MAX, to_kv_dtype
from engine.offline import generate, make_runner
from tests.conftest import rel_err
from tests.servers import assert_disaggregated_tokens, pair_and_stranger, refused_at_pairing

FP8 = torch.float8_e4m3fn
PROMPTS = [[1, 5, 9, 200, 31, 7], [(i * 37 + 11) % 290 for i in range(70)]]
STEPS = 12


def test_fp8_pool_holds_the_rounded_kv_in_half_the_bytes() -> None:
    """The same prefill into a 32-bit and an e4m3 pool: the e4m3 one holds the 32-bit values rounded
    (saturating), a quarter of the bytes a token (half of a 16-bit model's)."""
    wide = make_runner(preset="tiny")
    narrow = make_runner(preset="tiny", kv_dtype=FP8)
    assert narrow.pool.storage.dtype == FP8 and narrow.layout.dtype == "float8_e4m3fn"
    assert narrow.layout.bytes_per_token * 4 == wide.layout.bytes_per_token
    prompt = PROMPTS[1]
    for runner in (wide, narrow):
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(prompt)))
        runner.prefill(prompt, table, 0)
        assert table == list(range(1, len(table) + 1))  # both pools: the same slots
    slots = torch.arange(16, 16 + len(prompt))
    want = to_kv_dtype(wide.pool.storage[:, :, slots], FP8)
    assert torch.equal(narrow.pool.storage[:, :, slots].view(torch.uint8), want.view(torch.uint8))
    assert to_kv_dtype(torch.tensor([1e4, -1e4]), FP8).float().tolist() == [FP8_KV_MAX, -FP8_KV_MAX]


def test_decode_attention_reads_the_fp8_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step over an e4m3 pool gives the logits of a 32-bit pool holding the same rounded
    values (every KV write rounded through e4m3); the unrounded pool's logits differ."""
    from engine import attention

    prompt = PROMPTS[1]
    logits = {}
    for name in ("fp8", "rounded", "exact"):
        runner = make_runner(preset="tiny", kv_dtype=FP8 if name == "fp8" else None)
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(prompt) + 1))
        runner.prefill(prompt, table, 0)
        if name == "rounded":
            runner.pool.storage.copy_(to_kv_dtype(runner.pool.storage, FP8).float())
            store = attention.rope_and_store

            def rounding_store(*args: object, store: object = store) -> object:
                out = store(*args)  # type: ignore[operator]
                kv_layer, slots = args[4], args[5]
                kv_layer[:, slots] = to_kv_dtype(kv_layer[:, slots], FP8).float()  # type: ignore[index]
                return out

            monkeypatch.setattr(attention, "rope_and_store", rounding_store)
        logits[name] = runner.decode([DecodeSeq(42, len(prompt), table)])[0][0]
        monkeypatch.undo()
    assert rel_err(logits["fp8"], logits["rounded"]) < 1e-6 < 1e-3 < rel_err(logits["fp8"], logits["exact"])


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_fp8_kv_served_disaggregated(transport: str, server_logs: object) -> None:
    """A prefill and a decode server both with --kv-cache-dtype fp8: the KV crosses the transport
    (grpc's stream, or NIXL's WRITEs over UCX) as e4m3 and the tokens are the colocated e4m3 run's;
    a bf16-KV peer is refused at pairing."""
    from pathlib import Path

    from engine.transport.nixl import nixl_available

    if transport == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    assert isinstance(server_logs, Path)
    want = generate(make_runner(preset="tiny", kv_dtype=FP8), PROMPTS, STEPS)
    fp8 = ["--kv-cache-dtype", "fp8", "--kv-transport", transport]
    with pair_and_stranger(fp8, fp8, ["--kv-transport", transport], server_logs) as (decode, stranger):
        assert_disaggregated_tokens(decode, PROMPTS, want, STEPS)
        refused = refused_at_pairing(stranger, PROMPTS[0])
        assert "float8_e4m3fn" in refused and "--kv-cache-dtype" in refused


def test_fp8_kv_on_a_gpu_without_e4m3_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-dtype fp8` on a GPU below compute capability 8.9 stops the server in one line, before the
    model loads."""
    import serving.build_runner as build
    from serving.grpc_common import StartupError
    from serving.server_config import ServerConfig

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    monkeypatch.setattr(build, "resolve_device", lambda requested, role: torch.device(requested))
    monkeypatch.setattr(build, "load_model", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    cfg = ServerConfig(device="cuda:0", dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(StartupError, match=r"^--kv-cache-dtype fp8: cuda:0 \(NVIDIA A10\) is compute capability "
                                           r"8\.6, and FP8 \(e4m3\) runs on 8\.9 or newer \(Ada, Hopper\); drop it"):
        build.build_runner(cfg, "decode", 8, False, 0.0)
