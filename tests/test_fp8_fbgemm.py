"""FP8 checkpoints as FBGEMM writes them (`quant_method: fbgemm_fp8`, Meta's `Llama-3.1-*-FP8`) load
through the one decoder and decode to the greedy tokens of the same weights dequantized, run by
transformers with each quantized projection's input clamped to +-`activation_scale_ub`: what FBGEMM's
per-token scales, bounded by it, do to the magnitudes past it. The bound is chosen small enough to
change the tokens, so a loader that dropped it would fail here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.fp8 import FP8, Fp8Linear
from engine.fp8_formats import FBGEMM_BOUND, read_format
from engine.loader import ModelLoadError, load_checkpoint
from engine.offline import generate, make_runner
from tests.conftest import write_tiny_checkpoint
from tests.servers import assert_disaggregated_tokens, served_pair
from tests.test_fp8_loading import E4M3_MAX, FUSED, PROMPTS, STEPS, save_with_reference

BOUND = 0.25  # below the tiny models' larger activations (about 1-3), so the bound changes what they decode


def write_fbgemm(base: Path, folder: Path, bound: float | None = BOUND,
                 not_converted: tuple[str, ...] = ()) -> Path:
    """`base`'s decoder projections quantized per output channel as FBGEMM's `quantize_fp8_per_row`
    does (e4m3 weight, float32 `weight_scale` [N, 1]), those under the prefixes `not_converted` kept as
    they are and listed in `modules_to_not_convert`; the dequantized reference goes to
    `folder`-dequantized, with the names of the quantized modules for `bounded_greedy`."""
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, w in load_file(base / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in FUSED or module.startswith(not_converted):
            out[name] = reference[name] = w
            continue
        scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
        q = (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
        out[name], out[f"{module}.weight_scale"], reference[name] = q, scale, q.float() * scale
        quantized.append(module)
    raw = json.loads((base / "config.json").read_text())
    config: dict[str, object] = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": list(not_converted)}
    if bound is not None:
        config["activation_scale_ub"] = bound
    return save_with_reference(folder, {**raw, "quantization_config": config}, out, reference,
                               ("quantized.json", quantized))


def bounded_greedy(folder: Path, bound: float | None) -> list[list[int]]:
    """transformers on the dequantized weights, each quantized module's input clamped to +-bound."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for module in json.loads((folder / "quantized.json").read_text()) if bound is not None else []:
        model.get_submodule(module).register_forward_pre_hook(
            lambda _, args: (args[0].clamp(-bound, bound),))  # type: ignore[operator]
    return [model.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fbgemm")
    return {family: write_tiny_checkpoint(root / f"tiny-{family}", seed=7, family=family, hidden_size=192,
                                          intermediate_size=320) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fbgemm_checkpoint_decodes_as_its_weights_with_inputs_bounded(family: str, bases: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    folder = write_fbgemm(bases[family], tmp_path / family)
    dequantized = folder.with_name(f"{family}-dequantized")
    want = bounded_greedy(dequantized, BOUND)
    assert want != bounded_greedy(dequantized, None), "the bound must change the tokens for this test to see it"
    runner = make_runner(model=str(folder), max_model_len=256)
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv, Fp8Linear) and layer.qkv.input_bound == BOUND and layer.qkv.input_scale is None
    assert not isinstance(runner.model.lm_head, Fp8Linear)  # transformers never converts the output embeddings
    assert generate(runner, PROMPTS, STEPS) == want


def test_modules_to_not_convert_and_the_default_bound(bases: dict[str, Path], tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """`modules_to_not_convert` as transformers reads it ("model.layers.1" is all of layer 1, not layer 11);
    a config without `activation_scale_ub` takes transformers' default, 1200, which these activations
    never reach: the tokens are the dequantized weights' own."""
    fmt = read_format({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["model.layers.1"]})
    assert fmt.input_bound == FBGEMM_BOUND == 1200.0 and fmt.weight == "channel" and not fmt.static_input
    assert not fmt.quantizes("model.layers.1.mlp.up_proj") and fmt.quantizes("model.layers.11.mlp.up_proj")
    assert not fmt.quantizes("lm_head")
    folder = write_fbgemm(bases["llama"], tmp_path / "kept", bound=None, not_converted=("model.layers.1",))
    with caplog.at_level("INFO", logger="engine.loader"):
        runner = make_runner(model=str(folder), max_model_len=256)
    assert ("FP8 weights (fbgemm_fp8, channel scales, input scales bounded by 1200 / 448): 8 projections dequantized "
            "to torch.float32 (the reference path), 4 unquantized as the checkpoint has them") in caplog.text
    for i, layer in enumerate(runner.model.layers):
        assert isinstance(layer.qkv, Fp8Linear) == (i != 1) and isinstance(layer.down, Fp8Linear) == (i != 1)
    assert generate(runner, PROMPTS, STEPS) == bounded_greedy(folder.with_name("kept-dequantized"), None)


@pytest.mark.parametrize(("change", "expected"), [
    ({"activation_scale_ub": -1.0}, "activation_scale_ub -1.0 (a positive number is needed)"),
    ({"activation_scale_ub": "1200"}, "activation_scale_ub '1200' (a positive number is needed)"),
    ({"activation_scale_ub": True}, "activation_scale_ub True (a positive number is needed)"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert 'lm_head' (a list of module names is needed)"),
])
def test_a_bad_fbgemm_config_is_refused_in_one_line(change: dict[str, object], expected: str,
                                                   bases: dict[str, Path], tmp_path: Path) -> None:
    folder = write_fbgemm(bases["llama"], tmp_path / "bad")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert f"quant_method 'fbgemm_fp8' with {expected} is not supported" in message and "\n" not in message


def test_a_missing_weight_scale_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    folder = write_fbgemm(bases["llama"], tmp_path / "scaleless")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.2.mlp.up_proj.weight_scale missing from an FP8 "
                                             r"\(fbgemm_fp8\) checkpoint"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


def test_a_saved_input_scale_ub_must_be_the_configs(bases: dict[str, Path], tmp_path: Path) -> None:
    """transformers' FbgemmFp8Linear once saved its bound as a parameter a module (`input_scale_ub` [1]):
    equal to the config's it loads as before; another value is a contradiction, refused in one line."""
    folder = write_fbgemm(bases["llama"], tmp_path / "saved")
    weights = load_file(folder / "model.safetensors")
    for name in [n for n in weights if n.endswith(".weight_scale")]:
        weights[name.replace(".weight_scale", ".input_scale_ub")] = torch.tensor([BOUND])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    want = bounded_greedy(folder.with_name("saved-dequantized"), BOUND)
    assert generate(make_runner(model=str(folder), max_model_len=256), PROMPTS, STEPS) == want
    weights["model.layers.1.mlp.down_proj.input_scale_ub"] = torch.tensor([2 * BOUND])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
    assert str(e.value).endswith("model.layers.1.mlp.down_proj.input_scale_ub is [0.5] but the quantization_config's "
                                 "activation_scale_ub is 0.25; make them agree") and "\n" not in str(e.value)


@pytest.mark.e2e
def test_fbgemm_checkpoint_served_disaggregated(bases: dict[str, Path], tmp_path: Path, server_logs: Path) -> None:
    """A real prefill and decode server on an fbgemm_fp8 checkpoint: the bounded reference's tokens,
    the KV handed over between them."""
    folder = write_fbgemm(bases["qwen2"], tmp_path / "served")
    want = bounded_greedy(folder.with_name("served-dequantized"), BOUND)
    with served_pair(["--model", str(folder), "--max-model-len", "256"], server_logs) as decode:
        assert_disaggregated_tokens(decode, PROMPTS, want, STEPS)
