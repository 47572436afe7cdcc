"""FP8 checkpoints as llm-compressor (compressed-tensors) and transformers' `fp8` write them load
through the one decoder and decode to the greedy tokens of the same weights dequantized, run by
transformers itself; `--quantization fp8` and the FP8 preset quantize per output channel at load.
On the CPU the weights are dequantized at load (the reference path the GPU kernels are tested against)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.fp8 import FP8, Fp8Linear, dequantize, to_per_channel
from engine.fp8_formats import Fp8Format, read_format
from engine.loader import ModelLoadError, build_preset, load_checkpoint
from engine.offline import generate, make_runner
from tests.conftest import write_tiny_checkpoint
from tests.servers import (
    ServerProcess,
    assert_disaggregated_tokens,
    pair_and_stranger,
    refused_at_pairing,
    served_pair,
)

PROMPTS = [[1, 5, 9, 200, 31, 7], [(i * 37 + 11) % 290 for i in range(70)]]
STEPS = 12
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
         "o_proj": "o_proj", "down_proj": "down"}
E4M3_MAX = 448.0
STATIC = ("FP8", "autofp8-static")  # the schemes with a static input scale a module


def _group(scheme: str) -> dict[str, object]:
    """compressed-tensors' preset schemes as llm-compressor writes them into config.json."""
    weights: dict[str, object] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                  "group_size": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
                                  "strategy": {"FP8_DYNAMIC": "channel", "FP8": "tensor", "FP8_BLOCK": "block"}[scheme],
                                  "block_structure": [128, 128] if scheme == "FP8_BLOCK" else None}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": scheme != "FP8", "group_size": None,
              "actorder": None, "observer": "minmax" if scheme == "FP8" else None, "observer_kwargs": {},
              "strategy": {"FP8_DYNAMIC": "token", "FP8": "tensor", "FP8_BLOCK": "group"}[scheme],
              "block_structure": None}
    if scheme == "FP8_BLOCK":
        inputs["group_size"] = 128
    return {"format": "float-quantized", "targets": ["Linear"], "weights": weights, "input_activations": inputs,
            "output_activations": None}


def quantization_config(scheme: str) -> dict[str, object]:
    if scheme == "hf-fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if scheme.startswith("autofp8-"):  # AutoFP8's save_quantized_model
        return {"quant_method": "fp8", "activation_scheme": scheme.removeprefix("autofp8-"),
                "ignored_layers": ["lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": _group(scheme)}, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "version": "0.10.2"}


def quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale tensor as the tool stores it, the dequantized float32 values)."""
    if scheme in ("FP8_BLOCK", "hf-fp8"):
        n, k = w.shape
        padded = torch.zeros(math.ceil(n / 128) * 128, math.ceil(k / 128) * 128)
        padded[:n, :k] = w
        blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    elif scheme == "FP8_DYNAMIC":
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)  # [N, 1], the model's dtype
        full = scale.float().expand_as(w)
    else:  # one scale: [1] as llm-compressor stores it, 0-d as AutoFP8 does
        scale = (w.abs().amax() / E4M3_MAX).reshape(() if scheme.startswith("autofp8-") else 1)
        full = scale.expand_as(w)
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale, q.float() * full


def save_with_reference(folder: Path, config: dict[str, object], tensors: dict[str, torch.Tensor],
                        reference: dict[str, torch.Tensor], note: tuple[str, object]) -> Path:
    """`folder` with `config` as its config.json and `tensors`, and beside it `folder`-dequantized: the
    config without its quantization, the `reference` tensors, and a JSON file (`note`: name, contents)
    that the reference's run reads."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    dequantized = folder.with_name(folder.name + "-dequantized")
    dequantized.mkdir()
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    (dequantized / "config.json").write_text(json.dumps(plain))
    save_file(reference, dequantized / "model.safetensors", metadata={"format": "pt"})
    (dequantized / note[0]).write_text(json.dumps(note[1]))
    return folder


def write_fp8(base: Path, folder: Path, scheme: str) -> tuple[Path, Path]:
    """`base`'s decoder projections in FP8 as the tool writes them, and the same values dequantized
    into a float32 checkpoint (the reference), with static input scales where the scheme has them."""
    weights, reference = load_file(base / "model.safetensors"), {}
    out: dict[str, torch.Tensor] = {}
    input_scales: dict[str, float] = {}
    for name, w in weights.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in FUSED:
            out[name] = reference[name] = w
            continue
        q, scale, deq = quantize(w, scheme)
        out[name], reference[name] = q, deq
        out[f"{module}.{'weight_scale_inv' if scheme == 'hf-fp8' else 'weight_scale'}"] = scale
        if scheme in STATIC:  # calibrated per module: a range of activations, some of them clipped
            input_scales[module] = 2.0 / E4M3_MAX * (1 + 0.1 * (len(input_scales) % 5))
            out[f"{module}.input_scale"] = torch.tensor([input_scales[module]])
    raw = json.loads((base / "config.json").read_text())
    save_with_reference(folder, {**raw, "quantization_config": quantization_config(scheme)}, out, reference,
                        ("input_scales.json", input_scales))
    return folder, folder.with_name(folder.name + "-dequantized")


def reference_greedy(folder: Path) -> list[list[int]]:
    """transformers on the dequantized weights; a static scheme's activations quantized before each
    projection with its fused group's largest input scale (the loader's choice, as vLLM's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    scales = json.loads((folder / "input_scales.json").read_text())
    fused: dict[tuple[str, str], float] = {}
    for module, s in scales.items():
        key = (module.rsplit(".", 2)[0], FUSED[module.rsplit(".", 1)[-1]])
        fused[key] = max(fused.get(key, 0.0), s)
    for module in scales:
        s = fused[(module.rsplit(".", 2)[0], FUSED[module.rsplit(".", 1)[-1]])]

        def hook(_: torch.nn.Module, args: tuple[torch.Tensor], s: float = s) -> tuple[torch.Tensor]:
            return ((args[0] / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).float() * s,)

        model.get_submodule(module).register_forward_pre_hook(hook)
    return [model.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family (Llama 3 with tied embeddings, Qwen2's qkv bias, Qwen3, Mistral), wide enough for two
    128-column blocks (one partial)."""
    root = tmp_path_factory.mktemp("fp8")
    return {family: write_tiny_checkpoint(root / f"tiny-{family}", seed=7, family=family, hidden_size=192,
                                          intermediate_size=320) for family in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.mark.parametrize(("scheme", "family"), [("FP8_DYNAMIC", "llama"), ("FP8", "llama"), ("FP8_BLOCK", "qwen3"),
                                                ("hf-fp8", "qwen3"), ("FP8_DYNAMIC", "qwen2"), ("FP8", "qwen2"),
                                                ("FP8_BLOCK", "mistral"), ("autofp8-static", "llama"),
                                                ("autofp8-dynamic", "mistral")])
def test_fp8_checkpoint_decodes_as_its_dequantized_weights(scheme: str, family: str, bases: dict[str, Path],
                                                           tmp_path: Path) -> None:
    folder, dequantized = write_fp8(bases[family], tmp_path / f"{family}-{scheme}", scheme)
    want = reference_greedy(dequantized)
    runner = make_runner(model=str(folder), max_model_len=256)
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv, Fp8Linear) and isinstance(layer.down, Fp8Linear)
    assert not isinstance(runner.model.lm_head, Fp8Linear)  # ignored: kept as the checkpoint has it
    assert (layer.qkv.input_scale is not None) == (scheme in STATIC)
    assert generate(runner, PROMPTS, STEPS) == want
    ignoring_scales = dict(load_file(dequantized / "model.safetensors"))  # what the loader used to serve
    assert not torch.equal(ignoring_scales["model.layers.0.mlp.down_proj.weight"],
                           load_file(folder / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].float())


def test_a_sharded_checkpoint_with_scales_apart_from_their_weights(bases: dict[str, Path], tmp_path: Path) -> None:
    """Sharded as save_pretrained may shard it, a weight in one file and its scale in the next (read in
    either order): the same tokens as the checkpoint in one file."""
    folder, _ = write_fp8(bases["qwen3"], tmp_path / "whole", "hf-fp8")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(folder / "config.json", sharded / "config.json")
    tensors = load_file(folder / "model.safetensors")
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                  "model-00002-of-00002.safetensors": {}}
    for i, (name, tensor) in enumerate(sorted(tensors.items())):
        # scales in the first file, weights in the second; the rest alternate
        first = name.endswith("_scale_inv") or (not name.endswith(".weight") and i % 2 == 0)
        shards["model-00001-of-00002.safetensors" if first else "model-00002-of-00002.safetensors"][name] = tensor
    for file, part in shards.items():
        save_file(part, sharded / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    whole = generate(make_runner(model=str(folder), max_model_len=256), PROMPTS, STEPS)
    assert generate(make_runner(model=str(sharded), max_model_len=256), PROMPTS, STEPS) == whole


def test_modules_to_not_convert_means_what_transformers_means(bases: dict[str, Path], tmp_path: Path) -> None:
    """transformers' `fp8` checkpoints name what they keep unquantized by a module prefix up to a boundary
    ("model.layers.1": all of layer 1, not layer 11) or a name's end ("down_proj"), not by the whole name
    as compressed-tensors' `ignore` does; the loader reads each format's list its own way."""
    folder, _ = write_fp8(bases["qwen3"], tmp_path / "hf", "hf-fp8")
    weights = load_file(folder / "model.safetensors")
    original = load_file(bases["qwen3"] / "model.safetensors")
    for name in list(weights):
        module, _, kind = name.rpartition(".")
        if kind == "weight_scale_inv" and (module.startswith("model.layers.1.") or module.endswith("down_proj")):
            del weights[name]
            weights[f"{module}.weight"] = original[f"{module}.weight"]
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.1", "down_proj"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps(raw))
    save_file(weights, mixed / "model.safetensors", metadata={"format": "pt"})
    model = load_checkpoint(mixed, torch.device("cpu"), torch.float32).model
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.qkv, Fp8Linear) == (i != 1) and isinstance(layer.gate_up, Fp8Linear) == (i != 1)
        assert not isinstance(layer.down, Fp8Linear)
    kept = dict(model.named_parameters())["layers.1.o_proj.weight"]
    assert torch.equal(kept, original["model.layers.1.self_attn.o_proj.weight"])
    fmt = read_format(raw["quantization_config"])
    assert fmt.quantizes("model.layers.11.mlp.up_proj") and fmt.quantizes("model.layers.2.mlp.gate_proj")
    ct = read_format({**quantization_config("FP8_DYNAMIC"), "ignore": ["model.layers.1", "down_proj"]})  # names there
    assert ct.quantizes("model.layers.1.mlp.up_proj") and ct.quantizes("model.layers.0.mlp.down_proj")


def test_an_fp8_checkpoint_says_what_it_loaded(bases: dict[str, Path], tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """One log line: the format, how many projections are FP8 and how they run, what stays unquantized."""
    folder, _ = write_fp8(bases["llama"], tmp_path / "llama-FP8", "FP8")
    _add_kv_scales(folder, [0.5, 0.5, 0.5], 0.5)
    with caplog.at_level("INFO", logger="engine.loader"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    assert ("FP8 weights (compressed-tensors, tensor scales, static input scales): 12 projections dequantized to "
            "torch.float32 (the reference path); KV scales folded into the weights") in caplog.text  # 3 layers x 4
    folder, _ = write_fp8(bases["qwen3"], tmp_path / "qwen3-hf", "hf-fp8")
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.loader"):
        model = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    untied = int(not model.config.tie_word_embeddings)  # an untied lm_head stays 16-bit
    assert "FP8 weights (fp8, block scales): 12 projections dequantized to torch.float32 (the reference path)" + \
        (f", {untied} unquantized as the checkpoint has them" if untied else "") in caplog.text


def test_ignore_list_keeps_modules_unquantized_and_refuses_half_a_fused_projection(bases: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    folder, _ = write_fp8(bases["llama"], tmp_path / "ct", "FP8_DYNAMIC")
    weights = load_file(folder / "model.safetensors")
    original = load_file(bases["llama"] / "model.safetensors")
    for part in ("gate_proj", "up_proj"):  # layer 1's MLP input kept in float, as `ignore` says
        name = f"model.layers.1.mlp.{part}"
        weights[f"{name}.weight"] = original[f"{name}.weight"]
        del weights[f"{name}.weight_scale"]
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.(gate|up)_proj$"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps(raw))
    save_file(weights, mixed / "model.safetensors", metadata={"format": "pt"})
    model = load_checkpoint(mixed, torch.device("cpu"), torch.float32).model
    assert not isinstance(model.layers[1].gate_up, Fp8Linear) and isinstance(model.layers[0].gate_up, Fp8Linear)
    kept = dict(model.named_parameters())["layers.1.gate_up.weight"]
    assert torch.equal(kept[:320], original["model.layers.1.mlp.gate_proj.weight"])
    raw["quantization_config"]["ignore"] = ["lm_head", "model.layers.1.mlp.gate_proj"]
    (mixed / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="ignore list keeps part of .*gate_proj.*up_proj.*ignore all of them"):
        load_checkpoint(mixed, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("change", "expected"), [
    ({"config_groups": {"group_0": {**_group("FP8"), "weights": {**_group("FP8")["weights"], "num_bits": 4,  # type: ignore[dict-item]
                                                                   "type": "int"}}}},
     "quant_method 'compressed-tensors' with int 4-bit weights is not supported"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}},
     "with a kv_cache_scheme of int 8-bit tensor scales"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "quant_method 'fp8' with activation_scheme 'static'"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"],
                          "ignore": ["lm_head"], "global_sparsity": 0.45}},
     "with sparse weights (sparsity_config format 'sparse-24-bitmask')"),
    ({"transform_config": {"config_groups": {"R1": {"type": "hadamard", "apply": []}}}},
     "with a transform_config (rotations applied to activations at run time)"),
    ({"config_groups": {"group_0": {**_group("FP8"), "format": "pack-quantized"}}},
     "with a config group in format 'pack-quantized'"),
])
def test_other_quantizations_are_refused_naming_them(change: dict[str, object], expected: str,
                                                     bases: dict[str, Path], tmp_path: Path) -> None:
    folder, _ = write_fp8(bases["llama"], tmp_path / "ct", "FP8")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **change}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    assert expected in str(e.value) and "\n" not in str(e.value) and "use an unquantized" in str(e.value)


def test_dense_sparsity_and_no_transforms_are_read_as_plain_fp8() -> None:
    """What llm-compressor writes beside FP8 when nothing is sparse or rotated loads as FP8."""
    from engine.fp8_formats import read_format

    config = {**quantization_config("FP8_DYNAMIC"), "transform_config": {},
              "sparsity_config": {"format": "dense", "sparsity_structure": "unstructured", "global_sparsity": 0.0}}
    assert read_format(config).weight == "channel"


def test_quantization_flag_quantizes_per_channel_at_load(bases: dict[str, Path]) -> None:
    """`--quantization fp8` on a float checkpoint: the tokens of its weights rounded per output channel."""
    base = bases["qwen3"]
    runner = make_runner(model=str(base), max_model_len=256)
    original = {n: p.clone() for n, p in runner.model.named_parameters()}
    loaded = load_checkpoint(base, torch.device("cpu"), torch.float32, quantization="fp8").model
    for name in ("layers.0.qkv.weight", "layers.2.down.weight"):
        w, got = original[name], dict(loaded.named_parameters())[name]
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        assert torch.equal(got, (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).float() * scale)
    assert torch.equal(loaded.lm_head.weight, original["lm_head.weight"])
    tiny = build_preset("tiny", torch.device("cpu"), torch.float32, quantization="fp8").model
    assert isinstance(tiny.layers[0].gate_up, Fp8Linear)


def test_block_scales_requantized_per_channel_stay_within_an_e4m3_step() -> None:
    """The GPU layout folds 128x128 block scales into one scale a row: each value moves by at most
    half an e4m3 step of itself (2^-4 relative), or the row's smallest subnormal step."""
    torch.manual_seed(0)
    w = torch.randn(300, 400) * torch.logspace(-2, 0, 400)  # blocks whose ranges differ 100-fold
    q, scale, deq = quantize(w, "hf-fp8")
    fmt = Fp8Format("fp8", "block", (128, 128), False, (), "weight_scale_inv")
    assert torch.equal(dequantize(q, scale, fmt), deq)
    values, row_scale = to_per_channel(q, scale, fmt)
    again = values.float() * row_scale[:, None]
    bound = deq.abs() * 2.0**-4 + row_scale[:, None] * 2.0**-10
    assert bool(((again - deq).abs() <= bound).all())


@pytest.mark.e2e
def test_fp8_checkpoint_served_disaggregated(bases: dict[str, Path], tmp_path: Path, server_logs: Path) -> None:
    """A real prefill and decode server on an HF block-FP8 checkpoint: the reference's tokens."""

    folder, dequantized = write_fp8(bases["qwen3"], tmp_path / "served", "hf-fp8")
    want = reference_greedy(dequantized)
    with served_pair(["--model", str(folder), "--max-model-len", "256"], server_logs) as decode:
        assert_disaggregated_tokens(decode, PROMPTS, want, STEPS)


@pytest.mark.e2e
def test_quantization_flag_on_a_server(bases: dict[str, Path], tmp_path: Path, server_logs: Path) -> None:
    """`--quantization fp8` through a real decode server gives the offline quantized tokens (not the
    16-bit ones); on a checkpoint that is FP8 already the server exits at start, saying so."""
    import grpc
    from pd.v1 import decode_pb2, decode_pb2_grpc

    from launcher.process import ServerFailed

    base = bases["llama"]
    want = generate(make_runner(model=str(base), max_model_len=256, quantization="fp8"), PROMPTS, STEPS)
    assert want != generate(make_runner(model=str(base), max_model_len=256), PROMPTS, STEPS)
    server = ServerProcess("decode_server", ["--model", str(base), "--max-model-len", "256", "--quantization", "fp8"],
                           server_logs).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            for prompt, tokens in zip(PROMPTS, want, strict=True):
                replies = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                    token_ids=prompt, max_new_tokens=STEPS, ignore_eos=True), timeout=60)
                assert [r.token_id for r in replies] == tokens
    finally:
        server.stop()
    folder, _ = write_fp8(base, tmp_path / "ct", "FP8_DYNAMIC")
    refused = ServerProcess("prefill_server", ["--model", str(folder), "--quantization", "fp8"], server_logs)
    with pytest.raises(ServerFailed, match="exited with 2"):
        refused.start(timeout=120)
    assert f"--model {folder} is already quantized (compressed-tensors); drop --quantization" in refused.log()


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _add_kv_scales(folder: Path, k_scales: list[float], v_scale: float) -> dict[str, torch.Tensor]:
    """A kv_cache_scheme and each layer's self_attn.k_scale and v_scale, as llm-compressor writes them."""
    weights = load_file(folder / "model.safetensors")
    for i, k_scale in enumerate(k_scales):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"]["kv_cache_scheme"] = KV_SCHEME
    (folder / "config.json").write_text(json.dumps(raw))
    return weights


def test_kv_cache_scales_keep_a_static_input_scale_on_what_it_was_calibrated_for(bases: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """FP8 with static input scales and FP8 KV scales (llm-compressor's FP8 with a kv_cache_scheme): the
    cache's V / v_scale reaches o_proj, whose input scale was calibrated on V's own range, so the folding
    divides that scale by v_scale too. The activations then round to the e4m3 values they would have, and
    the tokens are the dequantized reference's; a small v_scale otherwise saturates o_proj's input. The
    scales are powers of two, so the folding is exact: the test's input scales clip, and static e4m3
    rounding of clipped activations turns any float difference (q * k_scale . k / k_scale) into others."""
    folder, dequantized = write_fp8(bases["llama"], tmp_path / "llama-FP8", "FP8")
    _add_kv_scales(folder, [2.0**-5, 2.0**-6, 2.0**-4], 2.0**-4)
    runner = make_runner(model=str(folder), max_model_len=256)
    o_proj = runner.model.layers[0].o_proj
    assert isinstance(o_proj, Fp8Linear) and o_proj.input_scale is not None
    assert generate(runner, PROMPTS, STEPS) == reference_greedy(dequantized)


@pytest.mark.parametrize("names", ["self_attn.{kind}_scale", "self_attn.{kind}_proj.output_scale"])
def test_autofp8_kv_scales_fold_under_either_name(names: str, bases: dict[str, Path], tmp_path: Path) -> None:
    """AutoFP8 with `kv_cache_scheme: static`: a k and v scale a layer, under the name it saves them by
    (`self_attn.k_scale`) or its earlier one (`k_proj.output_scale`), folded as compressed-tensors' are
    (powers of two, so exactly: the static input scales clip); the tokens are the dequantized reference's."""
    folder, dequantized = write_fp8(bases["llama"], tmp_path / "autofp8", "autofp8-static")
    weights = load_file(folder / "model.safetensors")
    for i, k_scale in enumerate([2.0**-5, 2.0**-6, 2.0**-4]):
        weights[f"model.layers.{i}.{names.format(kind='k')}"] = torch.tensor(k_scale)
        weights[f"model.layers.{i}.{names.format(kind='v')}"] = torch.tensor(2.0**-4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"]["kv_cache_scheme"] = "static"
    (folder / "config.json").write_text(json.dumps(raw))
    runner = make_runner(model=str(folder), max_model_len=256)
    assert runner.layout.model.partition("-kv-scales-")[2]
    assert generate(runner, PROMPTS, STEPS) == reference_greedy(dequantized)


@pytest.mark.e2e
def test_servers_with_other_kv_scales_refuse_to_pair(bases: dict[str, Path], tmp_path: Path,
                                                     server_logs: Path) -> None:
    """The same weights with and without a kv_cache_scheme fill the pool at other scales: a decode server
    on one and a prefill server on the other are refused at pairing, in one line naming both layouts,
    where the KV would have been read at the wrong scale; on the same checkpoint they serve its tokens."""
    plain, dequantized = write_fp8(bases["llama"], tmp_path / "plain", "FP8_DYNAMIC")
    scaled, _ = write_fp8(bases["llama"], tmp_path / "scaled", "FP8_DYNAMIC")
    _add_kv_scales(scaled, [0.02, 0.03, 0.04], 0.05)
    scaled_args, plain_args = (["--model", str(folder), "--max-model-len", "256"] for folder in (scaled, plain))
    with pair_and_stranger(scaled_args, scaled_args, plain_args, server_logs) as (decode, stranger):
        assert_disaggregated_tokens(decode, PROMPTS, reference_greedy(dequantized), STEPS)
        refused = refused_at_pairing(stranger, PROMPTS[0])
        assert "KV layout mismatch" in refused and "-kv-scales-" in refused


def test_kv_cache_scales_fold_into_the_weights(bases: dict[str, Path], tmp_path: Path) -> None:
    """A compressed-tensors checkpoint with a kv_cache_scheme (k_scale, v_scale a layer): the cache
    holds K / k_scale and V / v_scale (an e4m3 pool: those rounded), while attention, and so the
    tokens, are those of the weights alone."""
    from engine.decode_batch import DecodeSeq
    from tests.conftest import rel_err

    for family in ("llama", "qwen3"):  # q and k scaled on the projection, and through Qwen3's q/k norms
        folder, dequantized = write_fp8(bases[family], tmp_path / family, "FP8_DYNAMIC")
        plain = make_runner(model=str(folder), max_model_len=256)
        weights = _add_kv_scales(folder, [0.02 + 0.01 * i for i in range(3)], 0.05)
        assert generate(make_runner(model=str(folder), max_model_len=256), PROMPTS, STEPS) == \
            reference_greedy(dequantized)
        scaled = make_runner(model=str(folder), max_model_len=256, kv_dtype=FP8)
        named, _, digest = scaled.layout.model.partition("-kv-scales-")
        assert digest and named == plain.layout.model
        assert make_runner(model=str(folder), max_model_len=256).layout.model == scaled.layout.model
        for runner in (plain, scaled):
            table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(PROMPTS[1]) + 1))
            runner.prefill(PROMPTS[1], table, 0)
            runner.decode([DecodeSeq(42, len(PROMPTS[1]), table)])
        slots = torch.arange(16, 16 + len(PROMPTS[1]) + 1)
        for i in range(3):
            stored = scaled.pool.storage[i, :, slots].float()
            assert rel_err(stored[0] * (0.02 + 0.01 * i), plain.pool.storage[i, 0, slots]) < 0.05, (family, i)
            assert rel_err(stored[1] * 0.05, plain.pool.storage[i, 1, slots]) < 0.05, (family, i)
        del weights["model.layers.2.self_attn.v_scale"]
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match="FP8 KV scheme needs a positive k_scale and v_scale in every layer"):
            load_checkpoint(folder, torch.device("cpu"), torch.float32)


def _kv_only(base: Path, folder: Path, quantization: dict[str, object] | None,
             modelopt: dict[str, object] | None = None) -> Path:
    """`base`'s 16-bit weights with a k and v scale a layer (powers of two: folded exactly) and a config
    that quantizes the KV cache alone: in config.json, or as an older ModelOpt export's hf_quant_config.json."""
    shutil.copytree(base, folder)
    weights = load_file(folder / "model.safetensors")
    for i in range(3):
        weights[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(2.0**-(4 + i))
        weights[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(2.0**-3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
    if modelopt is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(modelopt))
    return folder


@pytest.mark.parametrize("export", ["compressed-tensors", "compressed-tensors-empty-group", "modelopt",
                                    "modelopt-legacy"])
def test_a_kv_only_checkpoint_keeps_16_bit_weights_and_folds_its_kv_scales(export: str, bases: dict[str, Path],
                                                                            tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """llm-compressor's KV-cache-only recipe (a kv_cache_scheme, no config group that targets a module) and
    ModelOpt's (an FP8 KV algorithm, no quant_algo): the weights stay as the checkpoint has them, the KV
    scales are folded into them and name the layout, and the tokens are the weights' own; `--quantization
    fp8` quantizes those weights at load as for any 16-bit checkpoint."""
    ct: dict[str, object] = {"quant_method": "compressed-tensors", "format": "dense", "kv_cache_scheme": KV_SCHEME,
                             "quantization_status": "compressed", "config_groups": {}, "ignore": []}
    if export == "compressed-tensors-empty-group":
        ct = {**ct, "format": "float-quantized", "config_groups": {"group_0": {"targets": []}}}
    configs: dict[str, tuple[dict[str, object] | None, dict[str, object] | None]] = {
        "compressed-tensors": (ct, None), "compressed-tensors-empty-group": (ct, None),
        "modelopt": ({"quant_method": "modelopt", "quant_algo": None, "ignore": [],
                      "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, None),
        "modelopt-legacy": (None, {"producer": {"name": "modelopt"},
                                   "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}),
    }
    quantization, legacy = configs[export]
    folder = _kv_only(bases["llama"], tmp_path / export, quantization, legacy)
    with caplog.at_level("INFO", logger="engine.loader"):
        runner = make_runner(model=str(folder), max_model_len=256)
    method = export.split("-")[0].replace("compressed", "compressed-tensors")
    assert f"KV scales ({method}): folded into the 16-bit weights; the checkpoint quantizes no weight" in caplog.text
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    assert runner.layout.model.partition("-kv-scales-")[2]
    assert generate(runner, PROMPTS, STEPS) == generate(make_runner(model=str(bases["llama"]), max_model_len=256),
                                                        PROMPTS, STEPS)
    assert isinstance(load_checkpoint(folder, torch.device("cpu"), torch.float32, quantization="fp8"
                                      ).model.layers[0].qkv, Fp8Linear)


def test_a_config_that_quantizes_nothing_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    folder = _kv_only(bases["llama"], tmp_path / "nothing", None,
                      {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None}})
    with pytest.raises(ModelLoadError, match="quant_method 'modelopt' with quant_algo None is not supported"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


@pytest.fixture
def an_a100(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA calls answer as an A100 (compute capability 8.0) would: no e4m3 in Triton or cuBLASLt there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that loading gets past the check to no GPU")
def test_a_kv_only_checkpoint_is_not_refused_on_a_gpu_without_e4m3(bases: dict[str, Path], tmp_path: Path,
                                                                  an_a100: None) -> None:
    """Its weights are 16-bit and its KV scales fold into them: nothing needs e4m3, so the load goes on
    (and here, with no GPU to load onto, fails at torch's first CUDA allocation, not at our check)."""
    folder = _kv_only(bases["llama"], tmp_path / "kv", {"quant_method": "compressed-tensors", "format": "dense",
                                                         "kv_cache_scheme": KV_SCHEME, "config_groups": {}})
    with pytest.raises((RuntimeError, AssertionError)) as e:
        load_checkpoint(folder, torch.device("cuda:0"), torch.bfloat16)
    assert not isinstance(e.value, ModelLoadError) and "FP8" not in str(e.value)


A100 = r"cuda:0 \(NVIDIA A100-SXM4-80GB\) is compute capability 8\.0, and FP8 \(e4m3\) runs on 8\.9 or newer"
FLOAT32 = r"--dtype float32 on a GPU would dequantize every FP8 weight at every step; use --dtype bfloat16"


@pytest.mark.parametrize(("gpu", "dtype", "refusal"), [
    ("a100", torch.bfloat16, (f", but {A100}", "; serve a 16-bit checkpoint", "; use a 16-bit preset")),
    ("h100", torch.float32, (f": {FLOAT32}", "", "")),
])
def test_fp8_weights_a_gpu_cannot_run_are_refused_before_loading(gpu: str, dtype: torch.dtype,
                                                                 refusal: tuple[str, str, str],
                                                                 bases: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 checkpoint, `--quantization fp8` and the FP8 preset where they can't run: on a GPU below
    compute capability 8.9 (no e4m3 in Triton or cuBLASLt), or with float32 activations on one that has
    it (the FP8 kernels multiply 16-bit ones; float32 would dequantize every weight at every step). One
    line naming the cause and what to serve instead, raised before anything is put on the device (this
    machine has none to put it on). The CPU, the reference path, takes both."""
    from engine.fp8 import device_problem

    capability, name = ((8, 0), "NVIDIA A100-SXM4-80GB") if gpu == "a100" else ((9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda:0")
    assert device_problem(torch.device("cpu")) is None
    why, checkpoint_advice, preset_advice = refusal
    folder, _ = write_fp8(bases["llama"], tmp_path / "llama-FP8_DYNAMIC", "FP8_DYNAMIC")
    with pytest.raises(ModelLoadError, match=rf"has FP8 weights{why}.*{checkpoint_advice}"):
        load_checkpoint(folder, cuda, dtype)
    with pytest.raises(ModelLoadError, match=rf"^--quantization fp8 makes FP8 weights{why}.*{checkpoint_advice}"):
        load_checkpoint(bases["llama"], cuda, dtype, quantization="fp8")
    with pytest.raises(ModelLoadError, match=rf"^preset qwen2.5-7b-fp8 has FP8 weights{why}.*{preset_advice}"):
        build_preset("qwen2.5-7b-fp8", cuda, dtype)
    assert isinstance(load_checkpoint(folder, torch.device("cpu"), dtype).model.layers[0].qkv, Fp8Linear)


def test_a_gpu_with_e4m3_takes_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.fp8 import device_problem

    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert device_problem(torch.device("cuda:0")) is None
