"""From a server's flags to a model on its device with its KV pool."""

from __future__ import annotations

import logging
import time

import torch

from engine.device import default_preset, resolve_device, resolve_dtype
from engine.fp8 import device_problem
from engine.loader import LoadedModel, ModelLoadError, load_model, load_tokenizer, model_context
from engine.ops import KernelOptions
from engine.runner import ModelRunner, kv_pool_bytes
from serving.grpc_common import StartupError
from serving.server_config import ServerConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 40960


def build_runner(cfg: ServerConfig, role: str, max_batch_size: int, cuda_graphs: bool,
                 kv_reserve_gb: float, kv_cache_gb: float | None = None,
                 prefill_graphs: bool | None = None) -> ModelRunner:
    """`cuda_graphs`: decode steps as CUDA graphs; `prefill_graphs`: prefills of up to 512 tokens too (by
    default as `cuda_graphs`)."""
    if cfg.kv_transport == "nixl":
        from engine.transport.nixl import NixlUnavailable, nixl_api

        try:
            nixl_api()
        except NixlUnavailable as e:
            raise StartupError(f"--kv-transport nixl: {e}") from e
    try:
        device = resolve_device(cfg.device, role)
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:
        raise StartupError(str(e)) from e
    if cfg.kv_cache_dtype == "fp8" and (problem := device_problem(device)):
        raise StartupError(f"--kv-cache-dtype fp8: {problem}; drop it on this GPU")
    preset = None if cfg.model else (cfg.preset or default_preset())
    started = time.perf_counter()
    try:
        context = model_context(cfg.model, preset)
        if cfg.max_model_len is not None and cfg.max_model_len > context:
            raise ModelLoadError(f"--max-model-len {cfg.max_model_len} is past the model's context of {context} "
                                 f"tokens (max_position_embeddings); pass at most {context}")
        max_len = min(cfg.max_model_len if cfg.max_model_len is not None else DEFAULT_MAX_MODEL_LEN, context)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kernels = KernelOptions(skinny_gemv=cfg.skinny_gemv, fused_gate_up=cfg.fused_gate_up, pdl=cfg.pdl)
        loaded: LoadedModel = load_model(cfg.model, preset, device, dtype, max_positions=max_len, kernels=kernels,
                                             quantization=cfg.quantization)
        if cfg.tokenizer:
            loaded.tokenizer = load_tokenizer(cfg.tokenizer, loaded.config.vocab_size)
    except ModelLoadError as e:
        raise StartupError(str(e)) from e
    log.info("%s model %s on %s (%s) in %.1fs", role, loaded.source, device, dtype, time.perf_counter() - started)
    try:
        kv_bytes = kv_pool_bytes(device, kv_cache_gb if kv_cache_gb is not None else cfg.kv_cache_gb, kv_reserve_gb)
        kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else None
        return ModelRunner(loaded, device, dtype, cfg.block_size, kv_bytes, max_batch_size, max_len, cuda_graphs,
                           kv_dtype=kv_dtype, prefill_graphs=prefill_graphs)
    except ValueError as e:
        raise StartupError(str(e)) from e
