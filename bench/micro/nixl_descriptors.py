"""`python -m bench.micro.nixl_descriptors`: the host's cost of posting one request's KV over NIXL, the two
ways engine.transport.nixl_descriptors names it: by index into lists prepared once at pairing
(`prepared`), or as descriptors built and checked per transfer, one per run of slots contiguous on
both sides (`merged`).

Two agents in this process, each with a pool of the preset's layout in host memory (the 7B shape: 28
layers, K and V, 16-token blocks, 1,024 bytes a token and plane), over UCX (UCX_TLS, tcp unless set).
For each prompt length and each layout of its blocks (`one run` on both sides, as a fresh pool gives;
`scattered`: no two neighbouring blocks adjacent, a fragmented pool's worst case) the sender makes a
WRITE a layer, as the prefill server does, then posts them. Timed: `make` (from the request's block
tables to every layer's transfer made: the descriptor work, where the two ways differ), `post` (NIXL's
transfer calls; over TCP on the CPU these already move bytes, the same for both ways) and until every
WRITE is done; recorded: the descriptors NIXL's backend got a layer (after NIXL merged neighbouring
ones); then the receiving pool's checksums are compared with the sender's. Also timed: preparing the
lists once, as a pairing does.

  python -m bench.micro.nixl_descriptors --json bench/results/nixl_descriptors-cpu.json
  python -m bench.micro.nixl_descriptors --preset tiny --tokens 256 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from bench.common import metadata, write_json
from bench.random_pool import make_pool
from engine.kv_cache import KVPool
from engine.kv_checksum import layer_checksums
from engine.transport.nixl import LayerWrite, NixlAgent, merged_writes, prepared_writes
from engine.transport.nixl_descriptors import PoolAddress, PreparedPools, chunk_pairs, chunk_tokens, slot_runs

METHODS = ("prepared", "merged")


def make_request(method: str, send: NixlAgent, peer: str, prepared: PreparedPools, remote: PoolAddress,
                 tables: tuple[list[int], list[int]], tokens: int) -> list[Any]:
    """The descriptor work of a prefill's sender for one request, every layer's WRITE made, none posted."""
    src, dst = tables
    block = send.pool.layout.block_size
    make: LayerWrite
    if method == "prepared":
        make = prepared_writes(send, peer, prepared, chunk_pairs(src, block, dst, block, 0, tokens, prepared.chunk))
    else:
        make = merged_writes(send, peer, remote, slot_runs(src, block, dst, block, 0, tokens))
    return [make(layer) for layer in range(send.pool.layout.num_layers)]


def wait_done(agent: NixlAgent, handles: list[Any]) -> int:
    """Once every WRITE is done: the descriptors NIXL's backend got for the first layer's."""
    for handle in handles:
        while (state := agent.state(handle)) not in ("DONE", "ERR"):
            time.sleep(0.0001)
        if state == "ERR":
            raise RuntimeError("a NIXL WRITE failed")
    posted = agent.descriptors_posted(handles[0])
    for handle in handles:
        agent.release(handle)
    return posted


def measure(send: NixlAgent, receive: KVPool, peer: str, prepared: PreparedPools, tables: tuple[list[int], list[int]],
            tokens: int, method: str, repeats: int) -> dict[str, Any]:
    remote = PoolAddress.of(receive)
    expected = layer_checksums(send.pool, tables[0], tokens)
    make_ms, post_ms, done_ms, equal = [], [], [], True
    for i in range(repeats + 1):  # the first is a warm-up (the connection, UCX's registration caches)
        receive.storage.zero_()  # every byte must come again
        started = time.perf_counter()
        handles = make_request(method, send, peer, prepared, remote, tables, tokens)
        made = time.perf_counter()
        for handle in handles:
            send.start(handle, "WRITE", peer)
        posted = time.perf_counter()
        descriptors = wait_done(send, handles)
        done = time.perf_counter()
        equal &= layer_checksums(receive, tables[1], tokens) == expected
        if i:
            make_ms.append((made - started) * 1e3)
            post_ms.append((posted - made) * 1e3)
            done_ms.append((done - started) * 1e3)
    return {"make_ms": round(statistics.median(make_ms), 3), "make_ms_min": round(min(make_ms), 3),
            "post_ms": round(statistics.median(post_ms), 3), "done_ms": round(statistics.median(done_ms), 1),
            "descriptors_posted_a_layer": descriptors, "bitwise_equal": equal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here (bench/results/...)")
    args = p.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    longest = max(args.tokens)
    send_pool, forward = make_pool(args.preset, longest, seed=1)
    receive_pool, _ = make_pool(args.preset, longest, seed=None)
    send, receive = NixlAgent(send_pool, "bench-prefill", telemetry=True), NixlAgent(receive_pool, "bench-decode")
    try:
        peer = send.add_peer(receive.metadata)
        layout = send_pool.layout
        started = time.perf_counter()
        prepared = send.prepare(peer, PoolAddress.of(receive_pool), chunk_tokens(layout.block_size, layout.block_size))
        prepare_ms = (time.perf_counter() - started) * 1e3
        print(f"prepared {prepared.descriptors:,} descriptors a side in {prepare_ms:.1f} ms", flush=True)
        rows = []
        for tokens in args.tokens:
            blocks = send_pool.blocks_needed(tokens)
            for name, table in (("one run", forward[:blocks]), ("scattered", forward[:blocks][::-1])):
                for method in METHODS:
                    row = {"tokens": tokens, "blocks": name, "method": method, "layers": layout.num_layers,
                           "bytes": tokens * layout.bytes_per_token,
                           **measure(send, receive_pool, peer, prepared, (table, table), tokens, method, args.repeats)}
                    rows.append(row)
                    print(f"{tokens:>6} tokens, {name:>9}, {method:>8}: made {row['make_ms']:8.3f} ms "
                          f"(min {row['make_ms_min']:.3f}), posted {row['post_ms']:8.1f} ms "
                          f"({row['descriptors_posted_a_layer']} descriptors a layer), "
                          f"done {row['done_ms']:8.1f} ms, bitwise equal: {row['bitwise_equal']}", flush=True)
        send.release_prepared(prepared)
    finally:
        send.close()
        receive.close()
    if args.json:
        meta = metadata()
        if not torch.cuda.is_available():
            meta["hardware"] = f"{os.cpu_count()}-core CPU, host memory"
        write_json(args.json, {**meta, "preset": args.preset, "ucx_tls": os.environ["UCX_TLS"],
                               "pool_slots": send_pool.num_slots, "prepared_descriptors_a_side": prepared.descriptors,
                               "prepare_ms": round(prepare_ms, 2), "rows": rows})


if __name__ == "__main__":
    main()
