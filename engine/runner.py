"""The model on its device with its KV pool: prefill chunks and batched decode steps.

Decode on CUDA replays one CUDA graph per batch-size bucket (`engine.cuda_graphs`); elsewhere it
runs eagerly. Everything here runs on one thread (the engine's), never on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from engine import ops
from engine.attention import DecodeMeta, PrefillMeta, fp8_prefill, prepare_prefill_plans
from engine.cuda_graphs import DecodeGraphs
from engine.decode_batch import DecodeSeq, sources, table_width, write_rows
from engine.device import free_memory
from engine.kv_cache import KVLayout, KVPool, long_tensor
from engine.loader import LoadedModel
from engine.logprobs import device_tensor
from engine.prefill_graphs import PARTITION_BUCKETS, PrefillGraphs

log = logging.getLogger(__name__)

GiB = 1 << 30


def kv_pool_bytes(device: torch.device, requested_gb: float | None, reserve_gb: float) -> int:
    """Bytes for the KV pool: as asked (refused with ValueError where the device has less free), or on CUDA
    what is free after weights less a reserve for activations; 256 MiB on the CPU."""
    if requested_gb is not None:
        want, free = int(requested_gb * GiB), free_memory(device)
        if free is not None and want > free:
            raise ValueError(f"the KV pool of {requested_gb:g} GiB (--kv-cache-gb) does not fit: {device} has "
                             f"{free / GiB:.1f} GiB free after the weights; pass a smaller --kv-cache-gb")
        return want
    if device.type != "cuda":
        return 256 << 20
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(free * 0.9) - int(reserve_gb * GiB))


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, block_size: int,
                 kv_bytes: int, max_batch_size: int, max_model_len: int, cuda_graphs: bool,
                 min_decode_bucket: int = 1, kv_dtype: torch.dtype | None = None,
                 prefill_graphs: bool | None = None) -> None:
        """`kv_dtype`: the KV pool's, when not the model's (e4m3: `--kv-cache-dtype fp8`);
        `prefill_graphs`: short prefills as CUDA graphs (`engine.prefill_graphs`), by default where
        `cuda_graphs` has the decode steps so."""
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.layout = KVLayout.for_model(loaded.config, kv_dtype or dtype, block_size, loaded.kv_scales)
        num_blocks = KVPool.blocks_for_memory(self.layout, kv_bytes)
        need = -(-max_model_len // block_size) + 1
        if num_blocks < need:
            raise ValueError(f"KV pool of {kv_bytes / GiB:.2f} GiB holds {num_blocks} blocks of {block_size} tokens; "
                             f"one {max_model_len}-token sequence needs {need}: raise --kv-cache-gb or lower "
                             "--max-model-len")
        self.pool = KVPool(self.layout, num_blocks, device, reserved_blocks=1)
        self.use_kernel = device.type == "cuda"
        if device.type == "cuda":  # compiled now, not at a request's second token
            self._warm_fed_embedding()
        self.graphs = None
        self.prefill_graphs: PrefillGraphs | None = None
        self._partition_graphs: dict[int, PrefillGraphs] = {}  # by the green stream they replay on
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, self.pool, max_batch_size, max_model_len, min_decode_bucket)
        if (cuda_graphs if prefill_graphs is None else prefill_graphs) and device.type == "cuda":
            self.prefill_graphs = PrefillGraphs(self.model, self.pool)
        log.info("KV pool: %d blocks x %d tokens (%.2f GiB, %d bytes/token)", num_blocks, block_size,
                 num_blocks * block_size * self.layout.bytes_per_token / GiB, self.layout.bytes_per_token)

    def _warm_fed_embedding(self) -> None:
        """Compile the fed embedding (`ops.embed`) for the eager path's int64 rows; the CUDA graphs
        compile their int32 one as they are captured."""
        with torch.cuda.device(self.device):  # Triton launches on the thread's current device
            ids = torch.zeros(2, dtype=torch.long, device=self.device)
            ops.embed(ids, self.model.embed.weight, (torch.tensor([-1, 0], device=self.device), ids))

    def bind_thread(self) -> None:
        """Make this thread's current CUDA device the runner's (Triton launches on the current one)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def prepare_engine_thread(self) -> None:
        """Bind this thread and build cuDNN's attention plan for every prompt-length bucket on it, so
        no request waits for one (PyTorch keeps cuDNN plans per thread)."""
        self.bind_thread()
        if self.device.type != "cuda":
            return
        cfg = self.config
        started = time.perf_counter()
        n = prepare_prefill_plans(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                                  self.max_model_len, fp8=fp8_prefill(self.pool, self.device))
        log.info("built prefill attention plans for %d prompt-length buckets up to %d tokens in %.1fs", n,
                 self.max_model_len, time.perf_counter() - started)

    def partition_graphs(self) -> PrefillGraphs | None:
        """Prefill graphs of the calling thread's current stream, a green context's (partitioned mode's
        prefill thread, inside `SmPartitions.confine`): captured there on first use, so their kernels
        keep to that context's SMs, with buffers of their own, since they run beside the engine thread's
        prefills; up to `PARTITION_BUCKETS[-1]` tokens. None where the engine has no prefill graphs."""
        if self.prefill_graphs is None:
            return None
        stream = torch.cuda.current_stream(self.device)
        graphs = self._partition_graphs.get(stream.cuda_stream)
        if graphs is None:
            graphs = PrefillGraphs(self.model, self.pool, PARTITION_BUCKETS, stream=stream)
            self._partition_graphs[stream.cuda_stream] = graphs
        return graphs

    def release_partition_graphs(self, graphs: PrefillGraphs) -> None:
        """Free a set `partition_graphs` gave before its green context goes (from any stream)."""
        assert graphs.stream is not None, "the engine thread's prefill graphs live as long as the runner"
        self._partition_graphs.pop(graphs.stream.cuda_stream, None)
        graphs.release()

    def prefill(self, token_ids: Sequence[int] | np.ndarray, block_table: list[int], start: int,
                on_layer_done: Callable[[int], None] | None = None, every_token: bool = False,
                graphed: bool | PrefillGraphs = True) -> torch.Tensor:
        """Prefill `token_ids` as positions start.. of the sequence; returns the last token's logits [V]
        (`every_token`: every token's, [T, V], for the prompt's own log probabilities). A short one
        replays the engine thread's prefill graphs (`engine.prefill_graphs`), or the set `graphed` names
        (`partition_graphs`); eagerly with `graphed=False`: a caller on another thread than the engine's,
        whose prefills may overlap its own, must not share their buffers."""
        graphs = graphed if isinstance(graphed, PrefillGraphs) else self.prefill_graphs if graphed else None
        if not every_token and graphs is not None and graphs.fits(len(token_ids)):
            return graphs.prefill(token_ids, block_table, start, on_layer_done)[0]
        ids, positions, meta = self._prefill_inputs(token_ids, block_table, start)
        logits = self.model(ids, positions, self.pool, meta, last_only=not every_token, on_layer_done=on_layer_done)
        return logits if every_token else logits[0]

    def prefill_slices(self, token_ids: Sequence[int] | np.ndarray, block_table: list[int], slice_tokens: int,
                       start: int = 0) -> Iterator[torch.Tensor | None]:
        """A prompt's prefill (`token_ids` as positions start.., after a cached prefix) a slice of
        layers at each step of the iterator (layered mode): as many layers as keep those tokens x
        layers within `slice_tokens`, one at least. None until the last step, which gives the last
        token's logits [V]."""
        ids, positions, meta = self._prefill_inputs(token_ids, block_table, start)
        layers_per_slice = max(1, slice_tokens // len(token_ids))
        for logits in self.model.prefill_slices(ids, positions, self.pool, meta, layers_per_slice):
            yield None if logits is None else logits[0]

    def _prefill_inputs(self, token_ids: Sequence[int] | np.ndarray, block_table: list[int],
                        start: int) -> tuple[torch.Tensor, torch.Tensor, PrefillMeta]:
        """Token ids, positions and slots of `token_ids` as positions start.. of the sequence, on the device."""
        end = start + len(token_ids)
        meta = PrefillMeta(
            new_slots=self.pool.slots(block_table, start, end),
            prior_slots=self.pool.slots(block_table, 0, start) if start else None,
        )
        ids = long_tensor(token_ids).to(self.device, non_blocking=True)
        return ids, torch.arange(start, end, device=self.device), meta

    def decode(self, seqs: list[DecodeSeq], previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for every sequence: float32 logits [B, V] and greedy tokens [B].
        `previous`: the last step's sampled tokens on the device, which rows with a `source_row`
        take as their input (the step is queued before those tokens are read back)."""
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            return self.graphs.run(seqs, previous)
        return self.decode_eager(seqs, previous)

    def decode_meta_tensors(self, seqs: list[DecodeSeq]) -> tuple[torch.Tensor, ...]:
        """Host-built (ids, positions, new_slots, block_tables, context_lens) for `seqs`; the block
        tables are as wide as the longest sequence's."""
        meta = np.zeros((4, len(seqs)), dtype=np.int64)
        tables = np.zeros((len(seqs), table_width(seqs, self.layout.block_size)), dtype=np.int32)
        write_rows(seqs, self.layout.block_size, meta, tables)
        ids, positions, slots, lens = torch.from_numpy(meta)
        out = (ids, positions, slots, torch.from_numpy(tables), lens.to(torch.int32))
        return tuple(t.pin_memory() for t in out) if self.device.type == "cuda" else out

    def decode_eager(self, seqs: list[DecodeSeq], previous: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, slots, tables, lens = (t.to(self.device, non_blocking=True)
                                               for t in self.decode_meta_tensors(seqs))
        rows = sources(seqs)
        feed = None
        if rows is not None:
            assert previous is not None, "a row takes its token from the previous step: pass that step's tokens"
            feed = (device_tensor(rows, torch.long, self.device), previous)  # pinned: queued behind the step before
        max_context = max(s.position for s in seqs) + 1
        meta = DecodeMeta(slots, tables, lens, max_context, use_kernel=self.use_kernel)
        return self.model.decode_forward(ids, positions, self.pool, meta, feed=feed)
