"""FP8 checkpoints as NVIDIA ModelOpt exports them (the `nvidia/*-FP8` checkpoints) load through the one
decoder and decode to the greedy tokens of the same weights dequantized, run by transformers: the older
exports' `hf_quant_config.json` and the newer ones' `quantization_config` in config.json, each of the
three FP8 algorithms, KV scales under `k_proj` / `v_proj`, and `exclude_modules` read as wildcards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.fp8 import Fp8Linear
from engine.fp8_formats import read_format
from engine.loader import ModelLoadError, load_checkpoint
from engine.offline import generate, make_runner
from tests.conftest import write_tiny_checkpoint
from tests.servers import assert_disaggregated_tokens, served_pair
from tests.test_fp8_loading import E4M3_MAX, FUSED, PROMPTS, STEPS, quantize, reference_greedy, save_with_reference

PRODUCER = {"name": "modelopt", "version": "0.29.0"}


def _quantize(w: torch.Tensor, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as ModelOpt stores it, the dequantized float32 values): `quantize`'s for the
    same granularity, the scale in ModelOpt's shape (blocks [N/128, 1, K/128, 1], channels [N], one 0-d)."""
    scheme = {"FP8_PB_WO": "FP8_BLOCK", "FP8_PER_CHANNEL_PER_TOKEN": "FP8_DYNAMIC", "FP8": "FP8"}[algo]
    q, scale, deq = quantize(w, scheme)
    if algo == "FP8_PB_WO":
        return q, scale.float()[:, None, :, None], deq
    return q, scale.float().reshape(-1 if algo == "FP8_PER_CHANNEL_PER_TOKEN" else ()), deq


def write_modelopt(base: Path, folder: Path, algo: str, *, legacy: bool, kv_scales: list[float] | None = None,
                   exclude: tuple[str, ...] = ("lm_head",), kept: tuple[str, ...] = ()) -> Path:
    """`base` exported as ModelOpt would: `legacy` with hf_quant_config.json, else quantization_config in
    config.json; `kv_scales` (k_scale a layer, all v_scale the last) under k_proj and v_proj; modules
    under the prefixes `kept` left 16-bit (for `exclude` to name). The dequantized reference goes to
    `folder`-dequantized, with the static input scales for `reference_greedy`."""
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    input_scales: dict[str, float] = {}
    for name, w in load_file(base / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in FUSED or module.startswith(kept):
            out[name] = reference[name] = w
            continue
        q, scale, deq = _quantize(w, algo)
        out[name], reference[name], out[f"{module}.weight_scale"] = q, deq, scale
        if algo == "FP8":  # calibrated per module, a scalar
            input_scales[module] = 2.0 / E4M3_MAX * (1 + 0.1 * (len(input_scales) % 5))
            out[f"{module}.input_scale"] = torch.tensor(input_scales[module])
    for i, k_scale in enumerate(kv_scales or []):
        out[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k_scale)
        out[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(kv_scales[-1] if kv_scales else 1.0)
    raw = json.loads((base / "config.json").read_text())
    if legacy:
        save_with_reference(folder, raw, out, reference, ("input_scales.json", input_scales))
        (folder / "hf_quant_config.json").write_text(json.dumps({"producer": PRODUCER, "quantization": {
            "quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv_scales else None,
            "exclude_modules": list(exclude)}}))
        return folder
    quantization: dict[str, object] = {"ignore": list(exclude), "quant_algo": algo, "producer": PRODUCER,
                                       "quant_method": "modelopt"}
    if kv_scales:
        quantization["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return save_with_reference(folder, {**raw, "quantization_config": quantization}, out, reference,
                               ("input_scales.json", input_scales))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modelopt")
    return {family: write_tiny_checkpoint(root / f"tiny-{family}", seed=7, family=family, hidden_size=192,
                                          intermediate_size=320) for family in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize(("algo", "family", "legacy", "kv_scales"), [
    # static input scales with KV scales: powers of two, so the folding into the weights is exact (the
    # clipped static e4m3 rounding would turn any float difference into other tokens)
    ("FP8", "llama", True, [2.0**-5, 2.0**-6, 2.0**-4]),
    ("FP8", "qwen2", False, None),
    ("FP8_PER_CHANNEL_PER_TOKEN", "qwen2", False, [0.02, 0.03, 0.05]),
    ("FP8_PB_WO", "qwen3", True, None),
])
def test_modelopt_checkpoint_decodes_as_its_dequantized_weights(algo: str, family: str, legacy: bool,
                                                                kv_scales: list[float] | None,
                                                                bases: dict[str, Path], tmp_path: Path) -> None:
    folder = write_modelopt(bases[family], tmp_path / f"{family}-{algo}", algo, legacy=legacy, kv_scales=kv_scales)
    runner = make_runner(model=str(folder), max_model_len=256)
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv, Fp8Linear) and isinstance(layer.o_proj, Fp8Linear)
    assert not isinstance(runner.model.lm_head, Fp8Linear)
    assert (layer.o_proj.input_scale is not None) == (algo == "FP8")
    assert bool(runner.layout.model.partition("-kv-scales-")[2]) == bool(kv_scales)  # folded, so named
    assert generate(runner, PROMPTS, STEPS) == reference_greedy(folder.with_name(folder.name + "-dequantized"))


def test_exclude_modules_are_modelopt_wildcards(bases: dict[str, Path], tmp_path: Path) -> None:
    """`model.layers.1*` (ModelOpt's way to name a module and all under it) keeps layer 1 in 16 bits but
    not layer 11; `*down_proj` every layer's down; the others stay FP8, and the tokens are the reference's."""
    fmt = read_format({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                       "ignore": ["lm_head", "model.layers.1*", "*down_proj"]})
    assert not fmt.quantizes("lm_head") and not fmt.quantizes("model.layers.1.mlp.up_proj")
    assert fmt.quantizes("model.layers.11.mlp.up_proj") and not fmt.quantizes("model.layers.0.mlp.down_proj")
    folder = write_modelopt(bases["llama"], tmp_path / "mixed", "FP8_PER_CHANNEL_PER_TOKEN", legacy=True,
                            exclude=("lm_head", "model.layers.1*", "*down_proj"),
                            kept=("model.layers.1.", "model.layers.0.mlp.down_proj", "model.layers.2.mlp.down_proj"))
    runner = make_runner(model=str(folder), max_model_len=256)
    for i, layer in enumerate(runner.model.layers):
        assert isinstance(layer.qkv, Fp8Linear) == (i != 1) and not isinstance(layer.down, Fp8Linear)
    assert generate(runner, PROMPTS, STEPS) == reference_greedy(folder.with_name("mixed-dequantized"))


@pytest.mark.parametrize(("quantization", "expected"), [
    ({"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}, "quant_algo 'NVFP4'"),
    ({"quant_algo": "W4A8_AWQ", "exclude_modules": ["lm_head"]}, "quant_algo 'W4A8_AWQ'"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo 'NVFP4'"),
])
def test_other_modelopt_algorithms_are_refused_naming_them(quantization: dict[str, object], expected: str,
                                                           bases: dict[str, Path], tmp_path: Path) -> None:
    folder = write_modelopt(bases["llama"], tmp_path / "m", "FP8", legacy=True)
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": PRODUCER, "quantization": quantization}))
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert f"quant_method 'modelopt' with {expected} is not supported" in message and "\n" not in message
    (folder / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="hf_quant_config.json is not a JSON object"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


def test_missing_kv_scales_and_misshapen_block_scales_are_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    folder = write_modelopt(bases["qwen3"], tmp_path / "kv", "FP8_PB_WO", legacy=False, kv_scales=[0.1, 0.1, 0.1])
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.2.self_attn.v_proj.v_scale"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="FP8 KV scheme needs a positive k_scale and v_scale in every layer"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    weights["model.layers.2.self_attn.v_proj.v_scale"] = torch.tensor(0.1)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    weights[name] = weights[name].reshape(weights[name].shape[0], -1, 1)  # 3-d: neither form
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale has shape \(2, 3, 1\); block scales of this "
                                             r"weight have \(2, 3\) or \(2, 1, 3, 1\)"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


@pytest.mark.e2e
def test_modelopt_checkpoint_served_disaggregated(bases: dict[str, Path], tmp_path: Path, server_logs: Path) -> None:
    """A real prefill and decode server on an older ModelOpt export (hf_quant_config.json beside a plain
    config.json, static input scales, KV scales): the reference's tokens, the KV handed over between them."""
    folder = write_modelopt(bases["llama"], tmp_path / "served", "FP8", legacy=True,
                            kv_scales=[2.0**-5, 2.0**-6, 2.0**-4])
    want = reference_greedy(folder.with_name("served-dequantized"))
    with served_pair(["--model", str(folder), "--max-model-len", "256"], server_logs) as decode:
        assert_disaggregated_tokens(decode, PROMPTS, want, STEPS)
