"""`bench.e2e.kv_transfer --mode endpoints --transport nixl`: a prompt's whole KV between two processes'
pools over NIXL (UCX), without a model: the sending process WRITEs every layer into the receiving
pool (as the prefill server does, by index into both pools' descriptor lists prepared once), and the
receiving process READs it the other way (one descriptor per contiguous run of slots, K and V),
each timed from its first post until every transfer is done (WRITE: on the sender, which then
notifies; READ: on the receiver). Bytes are compared by the layers' checksums. On the CPU the pools
are host memory; with --device cuda:N, device memory (one GPU: both processes on it, UCX's cuda_ipc;
UCX_TLS from the environment as in the servers).

The agents' metadata goes over the child's stdin and stdout here (the servers pass it in their
handshake)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.random_pool import make_pool
from engine.kv_cache import KVPool
from engine.kv_checksum import layer_checksums
from engine.transport.nixl import DONE, NixlAgent, prepared_writes
from engine.transport.nixl_descriptors import PoolAddress, chunk_pairs, chunk_tokens, layer_descriptors, slot_runs


def _runs(pool: KVPool, table: list[int], tokens: int) -> np.ndarray:
    bs = pool.layout.block_size
    return slot_runs(table, bs, table, bs, 0, tokens)


def _all_layers(pool: KVPool, runs: np.ndarray, where: PoolAddress, which: int) -> np.ndarray:
    token_bytes = pool.layout.bytes_per_token_per_layer // 2
    return np.concatenate([layer_descriptors(runs, where, which, layer, token_bytes)
                           for layer in range(pool.layout.num_layers)])


def _wait(agent: NixlAgent, handles: list[Any]) -> None:
    for handle in handles:
        while (state := agent.state(handle)) not in ("DONE", "ERR"):
            pass
        agent.release(handle)
        if state == "ERR":
            raise RuntimeError("a NIXL transfer failed")


def _send(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def sender(preset: str, tokens: int, device: str) -> None:
    """The child: the prefill side's pool, random KV; WRITEs it layer by layer on each 'write' line."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    pool, table = make_pool(preset, tokens, seed=1, device=dev)
    agent = NixlAgent(pool, "bench-send")
    peer_meta, peer_addr = sys.stdin.readline().split()
    peer = agent.add_peer(bytes.fromhex(peer_meta))
    remote = PoolAddress(*[int(x) for x in peer_addr.split(",")])
    where = PoolAddress.of(pool)
    _send(f"agent {agent.metadata.hex()} {where.addr},{where.num_slots},{where.device} "
          f"{','.join(map(str, layer_checksums(pool, table, tokens)))}")
    bs = pool.layout.block_size
    prepared = agent.prepare(peer, remote, chunk_tokens(bs, bs))
    make = prepared_writes(agent, peer, prepared, chunk_pairs(table, bs, table, bs, 0, tokens, prepared.chunk))
    while sys.stdin.readline().strip() == "write":
        started = time.perf_counter()
        handles = [agent.start(make(layer), "WRITE", peer) for layer in range(pool.layout.num_layers)]
        _wait(agent, handles)
        agent.notify(peer, DONE + b":bench")
        _send(f"sent {time.perf_counter() - started}")
    agent.release_prepared(prepared)
    agent.close()


def rows(preset: str, tokens: int, repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    """The decode side (this process); the prefill side is a child process on the same `device`."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    pool, table = make_pool(preset, tokens, None, dev)
    agent = NixlAgent(pool, "bench-receive")
    child = subprocess.Popen([sys.executable, "-m", "bench.e2e.kv_endpoints_nixl", preset, str(tokens), device],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        here = PoolAddress.of(pool)
        child.stdin.write(f"{agent.metadata.hex()} {here.addr},{here.num_slots},{here.device}\n")
        child.stdin.flush()
        while not (line := child.stdout.readline()).startswith("agent "):  # NIXL logs to stdout too
            if not line:
                raise RuntimeError("the sending process ended before its agent was up")
        _, meta, addr, sums = line.split()
        peer = agent.add_peer(bytes.fromhex(meta))
        there = PoolAddress(*[int(x) for x in addr.split(",")])
        expected = [int(c) for c in sums.split(",")]
        runs = _runs(pool, table, tokens)
        nbytes = tokens * pool.layout.bytes_per_token
        out = []
        for op in ("WRITE", "READ"):
            for i in range(repeats + 1):
                pool.storage.zero_()  # every byte must come again
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                started = time.perf_counter()
                if op == "WRITE":  # timed by the sender: its first post until every write is done
                    child.stdin.write("write\n")
                    child.stdin.flush()
                    while agent.take_note(peer, b"bench") is None:
                        pass
                    while not (line := child.stdout.readline()).startswith("sent "):
                        pass
                    seconds = float(line.split()[1])
                else:
                    _wait(agent, [agent.read(_all_layers(pool, runs, here, 1), _all_layers(pool, runs, there, 0),
                                             peer)])
                    seconds = time.perf_counter() - started
                equal = layer_checksums(pool, table, tokens) == expected
                if i:  # the first of each is a warm-up (connection set-up, registration caches)
                    out.append({"transport": "nixl", "mode": "endpoints", "op": op, "device": device,
                                "tokens": tokens, "bytes": nbytes, "seconds": round(seconds, 5),
                                "gbps": round(nbytes / seconds / 1e9, 3), "descriptors_per_layer": 2 * len(runs),
                                "exposed_ms": None, "bitwise_equal": equal})
                    print(f"nixl {op} endpoints ({device}): {nbytes / 1e9:.2f} GB in {seconds * 1e3:.1f} ms = "
                          f"{nbytes / seconds / 1e9:.2f} GB/s, bitwise equal: {equal}", flush=True)
        return out
    finally:
        child.stdin.write("stop\n")
        child.stdin.close()
        child.wait(30)
        agent.close()


if __name__ == "__main__":
    sender(sys.argv[1], int(sys.argv[2]), sys.argv[3])
