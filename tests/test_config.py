"""Settings live in the frozen config dataclasses and reach what they set; the process set-up, not an
import, writes the environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.servers import ROOT


def test_kernel_flags_reach_every_layer() -> None:
    from decode_server.__main__ import parse_config
    from engine.ops import KernelOptions
    from serving.build_runner import build_runner

    for flags, expected in (([], KernelOptions()),
                            (["--no-skinny-gemv"], KernelOptions(skinny_gemv=False)),
                            (["--no-fused-gate-up"], KernelOptions(fused_gate_up=False)),
                            (["--no-pdl"], KernelOptions(pdl=False))):
        cfg, _ = parse_config(["--device", "cpu", "--preset", "tiny", *flags])
        model = build_runner(cfg, "decode", 1, False, 0.0).model
        assert model.kernels == expected
        assert all(layer.kernels == expected for layer in model.layers)



def test_a_kv_pool_past_the_devices_free_memory_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-gb` (or the prefill server's default on a GPU) past what the device has free after the
    weights: one line at start, not an allocator's traceback. What is free exactly is enough."""
    import engine.runner as runner
    from decode_server.__main__ import parse_config
    from serving.build_runner import build_runner
    from serving.grpc_common import StartupError

    cfg, _ = parse_config(["--device", "cpu", "--preset", "tiny", "--kv-cache-gb", "0.5"])
    monkeypatch.setattr(runner, "free_memory", lambda device: 1 << 29)
    assert build_runner(cfg, "decode", 1, False, 0.0).pool.num_slots > 0
    monkeypatch.setattr(runner, "free_memory", lambda device: (1 << 29) - 1)
    with pytest.raises(StartupError) as e:
        build_runner(cfg, "decode", 1, False, 0.0)
    assert str(e.value) == ("the KV pool of 0.5 GiB (--kv-cache-gb) does not fit: cpu has 0.5 GiB free after the "
                            "weights; pass a smaller --kv-cache-gb")


def test_a_max_model_len_past_the_models_context_is_refused_before_loading() -> None:
    """`--max-model-len` past the config's max_position_embeddings: one line, before any weight is made (the
    RoPE tables were made that long, then the length was cut to the context without a word). Unset, it is
    the server's default cut to the context; at the context, served as asked."""
    from decode_server.__main__ import parse_config
    from engine.presets import PRESETS
    from serving.build_runner import DEFAULT_MAX_MODEL_LEN, build_runner
    from serving.grpc_common import StartupError

    context = PRESETS["tiny"].max_position_embeddings
    for flags, expected in (([], min(DEFAULT_MAX_MODEL_LEN, context)), (["--max-model-len", str(context)], context)):
        cfg, _ = parse_config(["--device", "cpu", "--preset", "tiny", *flags])
        assert build_runner(cfg, "decode", 1, False, 0.0).max_model_len == expected
    cfg, _ = parse_config(["--device", "cpu", "--preset", "tiny", "--max-model-len", str(context + 1)])
    with pytest.raises(StartupError) as e:
        build_runner(cfg, "decode", 1, False, 0.0)
    assert str(e.value) == (f"--max-model-len {context + 1} is past the model's context of {context} tokens "
                            f"(max_position_embeddings); pass at most {context}")

def test_decode_flags_tls_ca_and_kv_checksum(capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.__main__ import parse_config

    cfg, _ = parse_config([])
    assert (cfg.tls_ca, cfg.kv_checksum) == (None, "on")
    cfg, _ = parse_config(["--tls-ca", "ca.pem", "--kv-checksum", "off"])
    assert (cfg.tls_ca, cfg.kv_checksum) == ("ca.pem", "off")
    with pytest.raises(SystemExit):
        parse_config(["--kv-checksum", "yes"])
    assert "--kv-checksum" in capsys.readouterr().err


def test_chunk_size_is_a_warmed_up_power_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.__main__ import parse_config

    assert parse_config(["--chunk-size", "2048"])[0].chunk_size == 2048
    with pytest.raises(SystemExit):
        parse_config(["--chunk-size", "500"])
    assert "--chunk-size must be a power of two from 16 to 8192" in capsys.readouterr().err


def test_nccl_environment_is_set_by_process_setup_not_by_import() -> None:
    script = (
        "import json, os\n"
        "for name in ('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'NCCL_NVLS_ENABLE'): os.environ.pop(name, None)\n"
        "import engine.transport.nccl\n"
        "after_import = {k: os.environ.get(k) for k in ('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'NCCL_NVLS_ENABLE')}\n"
        "os.environ['NCCL_NVLS_ENABLE'] = '1'\n"
        "from prefill_server.__main__ import parse_config\n"
        "from serving.grpc_common import setup_process\n"
        "setup_process(parse_config([]))\n"
        "after_setup = {k: os.environ.get(k) for k in ('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'NCCL_NVLS_ENABLE')}\n"
        "print(json.dumps([after_import, after_setup]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    after_import, after_setup = json.loads(proc.stdout.strip().splitlines()[-1])
    assert after_import == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": None, "NCCL_NVLS_ENABLE": None}
    # set where unset; what the operator set wins
    assert after_setup == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_NVLS_ENABLE": "1"}
