"""The decoder forward of every supported family (Llama 3.x, Qwen2/2.5, Qwen3, Mistral) in plain
PyTorch, over the paged KV pool. What differs between families is a `ModelConfig` field: a bias on
q, k and v (Qwen2), a per-head RMSNorm on q and k before RoPE (Qwen3), Llama 3's RoPE scaling, and
tied embeddings.

One forward serves a prefill chunk of one sequence (`PrefillMeta`) and a decode step of many
sequences (`DecodeMeta`); `on_layer_done(layer)` fires after each layer's KV is in the pool so
a transport can ship that layer while later layers compute. The residual add is carried into
the next norm (`delta`), which fuses on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine import ops
from engine.attention import DecodeMeta, PrefillMeta, decode_attention, last_row_attention, prefill_attention
from engine.kv_cache import KVPool
from engine.model_config import Llama3RopeScaling, ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, self.weight, self.eps, delta)

    def feeding(self, layer: ops.Linear, x: torch.Tensor, delta: torch.Tensor | None, kernels: ops.KernelOptions,
                gated: bool = False) -> tuple[ops.Activations, torch.Tensor]:
        """The norm before the projection `layer`, its output's e4m3 rows written too where that
        projection takes them (`ops.norm_feeding`)."""
        return ops.norm_feeding(x, self.weight, self.eps, delta, layer, kernels, gated)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3's scaling: long wavelengths slowed by `factor`, short ones kept, the band between
    blended smoothly (the formula of Meta's reference code and transformers')."""
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return torch.where(medium, blended, scaled)


class RotaryTable(nn.Module):
    """cos/sin (float32) for every position up to `max_positions`, computed as transformers does."""

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.scaling = head_dim, theta, max_positions, scaling
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)

    def reset(self) -> None:
        """Fill the tables (after the module was built on the meta device and moved)."""
        device = self.cos.device
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        if self.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # stay float32 whatever the model dtype


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: ops.KernelOptions) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)  # q, k, v fused
        # Qwen3: an RMSNorm over each head of q and of k, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate, up fused
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor, rope: RotaryTable,
                pool: KVPool, layer: int, meta: PrefillMeta | DecodeMeta,
                last_row_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (residual stream, this layer's MLP output still to be added to it). With
        `last_row_only` (a prefill's last layer) every row's KV is stored but only the last row
        goes on through attention and the MLP: no later layer reads the other rows."""
        qkv, x = self.project_qkv(x, delta)
        attn: ops.Activations
        if isinstance(meta, DecodeMeta):
            # where o_proj takes its x in e4m3 (planned on a view of its input's shape), the merge writes it
            o_proj_x = qkv[:, :self.num_heads * self.head_dim]
            attn = decode_attention(qkv, positions, rope.cos, rope.sin, pool, layer, meta, self.num_heads,
                                    self.num_kv_heads, self.head_dim,
                                    e4m3_rows=ops.plan(o_proj_x, self.o_proj, self.kernels).takes_e4m3,
                                    e4m3_bound=ops.input_bound(self.o_proj))
        else:
            q, k, v = self.rope_and_store(qkv, positions, rope, pool, layer, meta.new_slots,
                                          meta.rows if meta.whole_prompt else None)
            heads, x = self.prefill_attention(q, k, v, x, pool, layer, meta, last_row_only)
            attn = heads.reshape(x.shape[0], -1)
        return self.after_attention(x, attn)

    def project_qkv(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm (the residual `delta` added first) and the fused q/k/v projection: (qkv, residual)."""
        h, x = self.input_norm.feeding(self.qkv, x, delta, self.kernels)
        qkv = ops.linear(h, self.qkv, self.kernels)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        return qkv, x

    def rope_and_store(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, pool: KVPool,
                       layer: int, slots: torch.Tensor,
                       rows: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prefill's rope and KV write: q [T, H, D], k and v [T, Hkv, D] (padded to `rows`, `ops.rope_and_store`)."""
        return ops.rope_and_store(qkv, positions, rope.cos, rope.sin, pool.layers[layer], slots, self.num_heads,
                                  self.num_kv_heads, self.head_dim, rows)

    @staticmethod
    def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, pool: KVPool,
                          layer: int, meta: PrefillMeta, last_row_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill's attention over its KV, already in the pool: (its output [T, H, D], the residual
        rows that go on). With `last_row_only`, the last row's alone."""
        if last_row_only:
            t = meta.new_slots.numel()
            return last_row_attention(q[t - 1:t], k[:t], v[:t], pool, layer, meta), x[t - 1:t]
        return prefill_attention(q, k, v, pool, layer, meta), x

    def after_attention(self, x: torch.Tensor, attn: ops.Activations) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the norm (its output added to the residual first) and the MLP: (residual, the MLP's output)."""
        h, x = self.post_norm.feeding(self.gate_up, x, ops.linear(attn, self.o_proj, self.kernels), self.kernels,
                                      gated=True)
        return x, ops.mlp(h, self.gate_up, self.down, self.kernels)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q_norm and k_norm over each head of the fused projection, in place."""
        assert self.q_norm is not None and self.k_norm is not None
        t, d = qkv.shape[0], self.head_dim
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        for norm, start, end in ((self.q_norm, 0, q_end), (self.k_norm, q_end, k_end)):
            qkv[:, start:end] = norm(qkv[:, start:end].reshape(-1, d))[0].view(t, end - start)
        return qkv


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: ops.KernelOptions, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        ops.apply_launch_options(kernels)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, max_positions or cfg.max_position_embeddings,
                                cfg.rope_scaling)

    def tie_weights(self) -> None:
        """Llama 3.2 1B/3B: the output projection is the embedding. Called again after `to_empty`,
        which gives each of the two names its own storage."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool,
                meta: PrefillMeta | DecodeMeta, last_only: bool = False,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Float32 logits [T, V] of the flattened `input_ids` [T]; with `last_only` (a prefill),
        of its last row alone [1, V]."""
        x, delta = self._layers(self.embed(input_ids), None, positions, pool, meta, range(len(self.layers)),
                                last_only, on_layer_done)
        return self.logits(x, delta)

    @torch.inference_mode()
    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool,
                       meta: DecodeMeta, feed: tuple[torch.Tensor, torch.Tensor] | None = None,
                       tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: float32 logits [B, V] and the greedy tokens [B] (their argmax, which the
        lm_head's skinny matmul finds as it stores the logits, where it runs; written into `tokens`
        when given). `feed` (sources, previous): rows with a source >= 0 take their input token from
        previous[source], the last step's tokens on the device (`ops.embed`)."""
        x = ops.embed(input_ids, self.embed.weight, feed)
        x, delta = self._layers(x, None, positions, pool, meta, range(len(self.layers)), False, None)
        h, _ = self.norm(x, delta)
        return ops.linear_argmax(h, self.lm_head, self.kernels, tokens)

    @torch.inference_mode()
    def prefill_slices(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool, meta: PrefillMeta,
                       layers_per_slice: int) -> Iterator[torch.Tensor | None]:
        """A prefill's forward (`last_only`) a slice of layers at a time: each step of the iterator
        queues the next `layers_per_slice` layers and yields None, the last one also the logits and
        yields them [1, V]."""
        x, delta = self.embed(input_ids), None
        n = len(self.layers)
        for start in range(0, n, layers_per_slice):
            x, delta = self._layers(x, delta, positions, pool, meta, range(start, min(n, start + layers_per_slice)),
                                    True, None)
            if start + layers_per_slice < n:
                yield None
        yield self.logits(x, delta)

    def _layers(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor, pool: KVPool,
                meta: PrefillMeta | DecodeMeta, which: range, last_only: bool,
                on_layer_done: Callable[[int], None] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        last_layer = len(self.layers) - 1
        for i in which:
            x, delta = self.layers[i](x, delta, positions, self.rope, pool, i, meta, last_only and i == last_layer)
            if on_layer_done is not None:
                on_layer_done(i)
        return x, delta

    def logits(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm (the residual `delta` added first) and the lm_head: float32 logits."""
        h, _ = self.norm(x, delta)
        return ops.linear(h, self.lm_head, self.kernels, out_dtype=torch.float32)
