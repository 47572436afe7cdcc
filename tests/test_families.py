"""Every supported family (Llama 3.x, Qwen2/2.5, Qwen3, Mistral) against transformers' own model on
a tiny random checkpoint it wrote: in this process (colocated) and through a real prefill server and
decode server (disaggregated). Also the config layouts, the refusals, and the KV layout check."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc

from engine.loader import ModelLoadError, load_checkpoint, read_config
from engine.model_config import FAMILIES, ModelConfig
from engine.offline import generate, make_runner
from tests.conftest import write_tiny_checkpoint, write_tokenizer
from tests.servers import ServerProcess

PROMPTS = [[1, 5, 9, 200, 31, 7], [(i * 37 + 11) % 290 for i in range(130)]]
STEPS = 16


def hf_greedy(folder: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # No end-of-sequence at all (as ignore_eos): min_new_tokens would instead mask EOS out of the
    # logits, and a step whose argmax is EOS would then pick another token.
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tokenizer(write_tiny_checkpoint(root / f"tiny-{family}", seed=3, family=family))
            for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {family: hf_greedy(folder, PROMPTS, STEPS) for family, folder in checkpoints.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_colocated_greedy_equals_transformers(family: str, checkpoints: dict[str, Path],
                                              references: dict[str, list[list[int]]]) -> None:
    runner = make_runner(model=str(checkpoints[family]), max_model_len=512)
    assert runner.config.family == family
    assert generate(runner, PROMPTS, STEPS) == references[family]
    assert [generate(runner, [p], STEPS, chunk_size=48)[0] for p in PROMPTS] == references[family]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_pair(request: pytest.FixtureRequest, checkpoints: dict[str, Path],
                server_logs: Path) -> Iterator[tuple[str, ServerProcess, ServerProcess]]:
    family, folder = request.param, str(checkpoints[request.param])
    prefill = ServerProcess("prefill_server", ["--model", folder, "--max-model-len", "512"], server_logs).start()
    try:
        decode = ServerProcess("decode_server", ["--model", folder, "--max-model-len", "512", "--prefill-addr",
                                                 prefill.address], server_logs).start()
    except Exception:
        prefill.stop()
        raise
    yield family, decode, prefill
    decode.stop()
    prefill.stop()


def stream(address: str, request: decode_pb2.GenerateRequest) -> list[decode_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(decode_pb2_grpc.DecodeStub(ch).Generate(request, timeout=60))


def test_disaggregated_greedy_equals_transformers(family_pair: tuple[str, ServerProcess, ServerProcess],
                                                  checkpoints: dict[str, Path],
                                                  references: dict[str, list[list[int]]]) -> None:
    """Prefill on the prefill server, KV shipped, decode on the decode server; then text in and out
    through the checkpoint's own tokenizer."""
    family, decode, _ = family_pair
    for prompt, want in zip(PROMPTS, references[family], strict=True):
        replies = stream(decode.address, decode_pb2.GenerateRequest(
            token_ids=prompt, max_new_tokens=STEPS, ignore_eos=True,
            prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED))
        assert [r.token_id for r in replies] == want
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(checkpoints[family])
    replies = stream(decode.address, decode_pb2.GenerateRequest(
        prompt="漢字かな 😀", max_new_tokens=STEPS, ignore_eos=True,
        prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED))
    text = "".join(r.text for r in replies)
    assert "\ufffd" not in text or "\ufffd" in tokenizer.decode([r.token_id for r in replies])
    assert text == tokenizer.decode([r.token_id for r in replies]).rstrip("\ufffd")


def test_sharded_checkpoint_loads_as_one(checkpoints: dict[str, Path], references: dict[str, list[list[int]]],
                                         tmp_path: Path) -> None:
    """save_pretrained's shards with their index: the same weights, the same tokens."""
    folder = write_tiny_checkpoint(tmp_path / "sharded", seed=3, family="qwen3", max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    runner = make_runner(model=str(folder), max_model_len=512)
    assert generate(runner, PROMPTS, STEPS) == references["qwen3"]


@pytest.mark.e2e
def test_servers_of_different_families_refuse_to_pair(checkpoints: dict[str, Path], server_logs: Path) -> None:
    """A Qwen3 decode server and a Llama prefill server: the handshake refuses with
    FAILED_PRECONDITION, naming the model on each side."""
    prefill = ServerProcess("prefill_server", ["--model", str(checkpoints["llama"])], server_logs).start()
    decode = ServerProcess("decode_server", ["--model", str(checkpoints["qwen3"]), "--prefill-addr",
                                             prefill.address], server_logs)
    try:
        decode.start()
        with pytest.raises(grpc.RpcError) as e:
            stream(decode.address, decode_pb2.GenerateRequest(
                token_ids=[1, 2, 3], max_new_tokens=2, prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        details = e.value.details()  # type: ignore[attr-defined]
        assert "prefill server 'tiny-llama-llama-" in details and "decode server 'tiny-qwen3-qwen3-" in details
    finally:
        decode.stop()
        prefill.stop()


def test_fingerprint_covers_each_family_difference() -> None:
    from dataclasses import replace

    from engine.model_config import Llama3RopeScaling
    from engine.presets import TINY as base

    variants = [replace(base, qkv_bias=False), replace(base, qk_norm=True, qkv_bias=False, family="qwen3"),
                replace(base, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64)), replace(base, head_dim=32),
                replace(base, tie_word_embeddings=True), replace(base, rope_theta=5e5)]
    prints = {v.fingerprint() for v in [base, *variants]}
    assert len(prints) == len(variants) + 1
    assert replace(base, eos_token_ids=(1, 2)).fingerprint() == base.fingerprint()  # not a KV difference


def test_v4_and_v5_config_layouts_read_the_same(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """transformers v5 writes `rope_parameters`; v4 wrote `rope_theta` + `rope_scaling` (its type
    under `rope_type`, or `type` before that). Both files, and both attribute sets, are one config."""
    v5 = read_config(checkpoints["llama"])
    assert v5.rope_scaling is not None and v5.rope_theta == 500000.0
    raw = json.loads((checkpoints["llama"] / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    folder = tmp_path / v5.name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    assert read_config(folder) == v5
    as_v4_object = SimpleNamespace(**{**raw, "rope_scaling": {**rope, "rope_type": "llama3"}})
    assert ModelConfig.from_hf(as_v4_object, name=v5.name) == v5
    default_rope = SimpleNamespace(**{**raw, "rope_scaling": None, "rope_theta": 1234.0})
    assert ModelConfig.from_hf(default_rope).rope_scaling is None
    assert ModelConfig.from_hf(default_rope).rope_theta == 1234.0


def test_llama3_rope_frequencies_equal_transformers() -> None:
    """Our Llama 3 inverse frequencies are transformers' own, at the 8B preset's settings, and
    differ from unscaled RoPE (so the scaling really is applied)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.decoder import RotaryTable, llama3_inv_freq
    from engine.presets import LLAMA3_8B

    cfg, scaling = LLAMA3_8B, LLAMA3_8B.rope_scaling
    assert scaling is not None
    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
                     max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters=dict(rope_type="llama3", rope_theta=cfg.rope_theta, factor=scaling.factor,
                                          low_freq_factor=scaling.low_freq_factor,
                                          high_freq_factor=scaling.high_freq_factor,
                                          original_max_position_embeddings=scaling.original_max_position_embeddings))
    want, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    assert attention_scaling == 1.0
    assert torch.allclose(llama3_inv_freq(plain, scaling), want, rtol=1e-6)
    assert not torch.allclose(plain, want)
    table = RotaryTable(cfg.head_dim, cfg.rope_theta, 64, scaling)
    table.reset()
    assert torch.allclose(table.cos[63, :cfg.head_dim // 2], torch.cos(63 * want), atol=1e-5)


def test_llama3_8b_preset_has_the_real_parameter_count() -> None:
    """Llama 3.1 8B has 8,030,261,248 parameters; the preset's shape builds exactly that many."""
    from engine.model import DecoderModel
    from engine.model.decoder import DecoderLayer
    from engine.ops import ALL_KERNELS
    from engine.presets import PRESETS

    with torch.device("meta"):
        model = DecoderModel(PRESETS["llama3-8b"], ALL_KERNELS, max_positions=16)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer) and layer.qkv.bias is None and layer.q_norm is None


@pytest.mark.parametrize(("case", "expected"), [
    ("missing folder", "no such folder"),
    ("no config.json", "no config.json in it"),
    ("gpt2", "model_type 'gpt2' is not supported; use a checkpoint of one of: llama, mistral, qwen2, qwen3"),
    ("sliding window", "sliding_window is 4096: sliding-window attention is not supported"),
    ("yarn", "RoPE type 'yarn' is not supported"),
    ("not json", "config.json is not a JSON object"),
])
def test_refusals_are_one_line_saying_what_to_do(case: str, expected: str, checkpoints: dict[str, Path],
                                                 tmp_path: Path) -> None:
    folder = tmp_path / "model"
    if case != "missing folder":
        folder.mkdir()
    raw = json.loads((checkpoints["mistral"] / "config.json").read_text())
    changes: dict[str, dict[str, object]] = {"gpt2": {"model_type": "gpt2"}, "sliding window": {"sliding_window": 4096},
               "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                            "original_max_position_embeddings": 128}}}
    if case in changes:
        (folder / "config.json").write_text(json.dumps({**raw, **changes[case]}))
    if case == "not json":
        (folder / "config.json").write_text("{model_type: llama")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert expected in message and "\n" not in message and str(folder) in message
    assert any(hint in message for hint in ("pass a", "use a checkpoint"))
