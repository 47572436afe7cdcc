"""Generate without a server: the reference path that tests and benchmarks compare against."""

from __future__ import annotations

import torch

from engine.decode_batch import DecodeSeq
from engine.ops import ALL_KERNELS, KernelOptions
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
             params: SamplingParams | None = None, chunk_size: int | None = None) -> list[list[int]]:
    """Greedy (or seeded) generation for several prompts decoded together as one batch."""
    params = params or SamplingParams()
    pool = runner.pool
    tables: list[list[int]] = []
    outputs: list[list[int]] = []
    try:
        for prompt in prompts:
            table = pool.allocator.allocate(pool.blocks_needed(len(prompt) + max_new_tokens))
            tables.append(table)
            step = chunk_size or len(prompt)
            for start in range(0, len(prompt), step):
                logits = runner.prefill(prompt[start:start + step], table, start)
            outputs.append([int(sample(logits[None], [params], [0])[0])])  # type: ignore[possibly-undefined]
        for index in range(1, max_new_tokens):
            seqs = [DecodeSeq(out[-1], len(prompt) + len(out) - 1, table)
                    for prompt, out, table in zip(prompts, outputs, tables, strict=True)]
            logits, greedy = runner.decode(seqs)
            tokens = sample(logits, [params] * len(seqs), [index] * len(seqs), greedy).tolist()
            for out, token in zip(outputs, tokens, strict=True):
                out.append(int(token))
    finally:
        for table in tables:
            pool.allocator.free(table)
    return outputs


def make_runner(model: str | None = None, preset: str | None = "tiny", device: str = "cpu",
                dtype: torch.dtype = torch.float32, block_size: int = 16, kv_gb: float = 0.25,
                max_batch_size: int = 8, max_model_len: int = 4096, cuda_graphs: bool = False,
                min_decode_bucket: int = 1, kernels: KernelOptions = ALL_KERNELS,
                quantization: str | None = None, kv_dtype: torch.dtype | None = None,
                prefill_graphs: bool | None = None) -> ModelRunner:
    from engine.loader import load_model

    dev = torch.device(device)
    loaded = load_model(model, preset, dev, dtype, max_positions=max_model_len, kernels=kernels,
                        quantization=quantization)
    return ModelRunner(loaded, dev, dtype, block_size, int(kv_gb * (1 << 30)), max_batch_size, max_model_len,
                       cuda_graphs, min_decode_bucket, kv_dtype, prefill_graphs)
