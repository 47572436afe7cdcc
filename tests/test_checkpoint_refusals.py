"""A checkpoint the loader cannot run is refused at start, in one line naming what it is; a weight
the model does not use is refused unless it is listed as harmless. Real tiny checkpoints on disk,
real server processes exiting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import ModelLoadError, load_checkpoint
from engine.offline import generate, make_runner
from launcher.process import ServerFailed
from tests.conftest import write_tiny_checkpoint
from tests.servers import ServerProcess

PROMPT = [[1, 5, 9, 200, 31, 7]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("refusals") / "tiny-llama", seed=5, family="llama",
                                 tie_word_embeddings=False)


def copy_with(base: Path, folder: Path, config: dict[str, object] | None = None,
              extra: dict[str, torch.Tensor] | None = None) -> Path:
    """`base` copied into `folder`, with config.json fields added and tensors added to its weights."""
    folder.mkdir()
    raw = {**json.loads((base / "config.json").read_text()), **(config or {})}
    (folder / "config.json").write_text(json.dumps(raw))
    weights = load_file(base / "model.safetensors")
    save_file({**weights, **(extra or {})}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
INT4_COMPRESSED = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                       "symmetric": True, "dynamic": False}, "input_activations": None}},
    "ignore": ["lm_head"]}


@pytest.mark.parametrize(("config", "extra", "expected"), [
    ({"quantization_config": GPTQ}, {"model.layers.0.self_attn.q_proj.g_idx": torch.zeros(64, dtype=torch.int32)},
     "quant_method 'gptq' is not supported"),
    ({"quantization_config": INT4_COMPRESSED}, {}, "quant_method 'compressed-tensors'"),
    (None, {"model.layers.0.mlp.down_proj.weight_scale": torch.ones(64, 1)},
     "model.layers.0.mlp.down_proj.weight_scale in model.safetensors is a quantization tensor that config.json's "
     "quantization_config does not use"),
    (None, {"model.layers.1.self_attn.q_proj.weight_zero_point": torch.zeros(64, 1)}, "is a quantization tensor"),
    (None, {"model.layers.2.mlp.extra_proj.weight": torch.ones(4, 4)},
     "model.layers.2.mlp.extra_proj.weight in model.safetensors is not a weight of a llama model"),
])
def test_unsupported_checkpoints_are_refused_in_one_line(base: Path, tmp_path: Path, config: dict[str, object] | None,
                                                         extra: dict[str, torch.Tensor], expected: str) -> None:
    folder = copy_with(base, tmp_path / "model", config, extra)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert expected in message and "\n" not in message and str(folder) in message
    assert "use " in message  # says what to do


def test_harmless_weights_are_skipped_and_change_nothing(base: Path, tmp_path: Path) -> None:
    """A saved RoPE table (older transformers) and an lm_head that is the tied embedding's copy load;
    an lm_head that differs from the embedding it is tied to is refused."""
    want = generate(make_runner(model=str(base), max_model_len=256), PROMPT, 8)
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(3)}
    with_table = copy_with(base, tmp_path / "with-table", None, inv_freq)
    assert generate(make_runner(model=str(with_table), max_model_len=256), PROMPT, 8) == want
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    tied = copy_with(base, tmp_path / "tied", {"tie_word_embeddings": True}, {"lm_head.weight": embed.clone()})
    load_checkpoint(tied, torch.device("cpu"), torch.float32)
    untied = copy_with(base, tmp_path / "untied", {"tie_word_embeddings": True}, {"lm_head.weight": embed + 1})
    with pytest.raises(ModelLoadError, match="lm_head.weight differs from the embedding"):
        load_checkpoint(untied, torch.device("cpu"), torch.float32)


@pytest.mark.e2e
@pytest.mark.parametrize("module", ["prefill_server", "decode_server"])
def test_servers_exit_at_start_naming_the_method(module: str, base: Path, tmp_path: Path, server_logs: Path) -> None:
    folder = copy_with(base, tmp_path / "gptq", {"quantization_config": GPTQ},
                       {"model.layers.0.self_attn.q_proj.qzeros": torch.zeros(2, 8, dtype=torch.int32)})
    server = ServerProcess(module, ["--model", str(folder)], server_logs)
    with pytest.raises(ServerFailed, match="exited with 2 before it was ready"):
        server.start(timeout=120)
    lines = [line for line in server.log().splitlines() if "quant_method 'gptq' is not supported" in line]
    assert len(lines) == 1 and str(folder) in lines[0]


def test_weights_past_the_devices_free_memory_are_refused_before_they_are_made(base: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset or checkpoint whose weights the device can't hold: one line with the sizes and what to do,
    raised before any weight is made (without it a 7B preset on a 24 GB host was killed by the kernel,
    silently). The weights' bytes free exactly is enough."""
    import engine.loader as loader
    from engine.device import free_memory
    from engine.loader import build_preset

    assert (free_memory(torch.device("cpu")) or 1) > 0
    need = sum(p.numel() for p in build_preset("tiny", torch.device("cpu"), torch.float32).model.parameters()) * 4
    monkeypatch.setattr(loader, "free_memory", lambda device: need)
    build_preset("tiny", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(loader, "free_memory", lambda device: need - 1)
    with pytest.raises(ModelLoadError) as e:
        build_preset("tiny", torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert message.startswith("preset tiny: its 0.0 billion weights take 0.0 GB in float32 on cpu, which has 0.0 GB "
                              "free")
    assert message.endswith("use --preset tiny or a smaller checkpoint, or a GPU") and "\n" not in message
    monkeypatch.setattr(loader, "free_memory", lambda device: 0)
    with pytest.raises(ModelLoadError, match=f"^--model {base}: its .* on cpu, which has 0.0 GB free; use "):
        load_checkpoint(base, torch.device("cpu"), torch.float32)
