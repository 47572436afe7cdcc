"""The GPU transports' real endpoints without a model, for `python -m bench.e2e.kv_transfer --mode endpoints`:
how long a whole prompt's KV takes to move from one GPU's pool to another's when nothing hides it.

This process is the decode side (on the second GPU); a child process is the prefill side (on the
first), its pool filled with random values. They meet on a loopback TCPStore (the servers relay
their rendezvous over gRPC instead).
- nccl: this side posts its receives (`NcclKVReceiver`), then the child sends every layer with
  `NcclKVSender`, timed to every layer in this pool (landed straight in it when both tables are
  one run, else scattered from staging), optionally after the sending GPU has run matmuls for
  `sender_busy_ms`. Timed from (`timed_from`):
  - kv-ready: as in the servers, where each layer's send is queued while the prefill still
    computes, the sends are queued behind a wait on the sending GPU, and the clock starts when
    that wait ends (the KV is ready), seen by polling an event: the link and the receive side;
  - first-call: the sender's first call, with the KV ready and the GPU idle: the host's posting
    too (the first post of a transfer takes about 0.3 ms, its code gone cold while the thread slept).
  The posting of the receives is timed on its own (`receive_setup_ms`): in the servers it runs
  while the prefill's first layers compute, and a sender that started first would count its time
  as the link's.
- cuda-ipc: the child exports its pool; this side maps it (`RemotePool`) and copies every layer
  (`IpcKVReceiver`); timed from the first copy to the last one done.
Both processes read time.perf_counter (CLOCK_MONOTONIC, one clock per host).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bench.random_pool import make_pool
from engine.kv_cache import KVPool
from engine.kv_checksum import layer_checksums
from serving.grpc_common import set_nccl_env

TIMEOUT_S = 120.0
GATE_CYCLES = 20_000_000  # the kv-ready wait: about 10 ms at the SM clock, longer than posting 28 layers
TIMED_FROM = ("kv-ready", "first-call")


def _store(port: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False, use_libuv=True,
                         timeout=timedelta(seconds=TIMEOUT_S))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _keep_busy(device: torch.device, ms: float) -> None:
    """Matmuls on `device` for about `ms` milliseconds, waited for."""
    if ms <= 0:
        return
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        _sync(device)


def serve(transport: str, port: int, preset: str, tokens: int, repeats: int, device: torch.device,
          scattered: bool, busy_ms: float = 0.0, timed_from: str = "kv-ready") -> None:
    """The prefill side (child process, first GPU)."""
    from engine.transport.nccl import PREFILL_RANK, NcclKVSender, NcclPair

    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = _store(port, master=False)
    pool, table = make_pool(preset, tokens, 1, device, scattered)
    slots = pool.slots(table, 0, tokens)
    store.set("checksum", ",".join(map(str, layer_checksums(pool, table, tokens))))
    store.set("table", ",".join(map(str, table)))
    if transport == "cuda-ipc":
        from engine.transport.cuda_ipc import export_pool

        handle, offset = export_pool(pool)
        store.set("ipc", handle.hex() + f":{offset}:{pool.num_slots}")
        store.get("finished")  # keep the pool alive until the decode side is done with it
        return
    pair = NcclPair(store, "bench", PREFILL_RANK, device, TIMEOUT_S)
    pair.warm_up()
    for i in range(repeats):
        store.get(f"posted{i}")
        _keep_busy(device, busy_ms)
        ready = None
        if timed_from == "kv-ready":
            torch.cuda._sleep(GATE_CYCLES)  # the prefill's last layers, as far as the sends can tell
            ready = torch.cuda.Event()
            ready.record()
        started = time.perf_counter()
        sender = NcclKVSender(pair, pool, slots, TIMEOUT_S, pool.table_start(table, tokens))
        for layer in range(pool.layout.num_layers):
            sender.layer_done(layer)
        if ready is not None:
            if ready.query():
                sys.exit("error: the KV-ready wait ended before every send was queued; raise GATE_CYCLES")
            while not ready.query():
                pass
            started = time.perf_counter()
        sender.finish()
        store.set(f"started{i}", repr(started))
        store.set(f"first_post{i}", repr(sender.posted_at[0]))
        store.set(f"last_post{i}", repr(sender.posted_at[-1]))
    store.get("finished")


def rows(transport: str, preset: str, tokens: int, repeats: int,
         devices: tuple[str, str] = ("cuda:0", "cuda:1"), scattered: bool = False,
         sender_busy_ms: float = 0.0, timed_from: str = "kv-ready") -> list[dict[str, Any]]:
    """The decode side (this process, on devices[1]; the prefill side on devices[0]). On two CPU
    devices the nccl protocol runs over Gloo, as in the servers (tests), timed from the first call."""
    set_nccl_env()  # here and in the child, which inherits it, as in the servers
    if not devices[0].startswith("cuda"):
        timed_from = "first-call"
    if devices[0].startswith("cuda") and torch.cuda.device_count() < 2:
        sys.exit(f"error: --mode endpoints with {transport} needs two GPUs (NCCL refuses two ranks on one)")
    store = _store(0, master=True)  # on a port it picks
    port = store.port
    child = subprocess.Popen([sys.executable, "-m", "bench.e2e.kv_endpoints_gpu", transport, str(port), preset,
                              str(tokens), str(repeats + 1), devices[0], "--busy-ms", str(sender_busy_ms),
                              "--timed-from", timed_from]
                             + (["--scattered"] if scattered else []))
    try:
        device = torch.device(devices[1])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pool, table = make_pool(preset, tokens, None, device, scattered)
        expected = [int(c) for c in store.get("checksum").decode().split(",")]
        src_table = [int(b) for b in store.get("table").decode().split(",")]
        timed = _ipc_copies(store, pool, table, src_table, tokens, repeats + 1) if transport == "cuda-ipc" \
            else _nccl_receives(store, pool, table, tokens, repeats + 1)
        out = []
        for i, (seconds, set_up_ms) in enumerate(timed):
            equal = layer_checksums(pool, table, tokens) == expected
            pool.storage.zero_()  # the next repeat must bring every byte again
            _sync(device)
            if i == 0:
                continue  # warm-up
            nbytes = tokens * pool.layout.bytes_per_token
            blocks = "scattered" if scattered else "contiguous"
            out.append({"transport": transport, "mode": "endpoints", "blocks": blocks, "tokens": tokens,
                        "bytes": nbytes, "seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 1),
                        "exposed_ms": None, "bitwise_equal": equal,
                        "receive_setup_ms": None if set_up_ms is None else round(set_up_ms, 3),
                        "sender_busy_ms": sender_busy_ms,
                        "timed_from": timed_from if transport == "nccl" else "first copy"})
            print(f"{transport} endpoints ({blocks} blocks, sender busy {sender_busy_ms:g} ms before"
                  + (f", from {timed_from}" if transport == "nccl" else "") + "): "
                  f"{nbytes / 1e9:.2f} GB in {seconds * 1e3:.2f} ms = "
                  f"{nbytes / seconds / 1e9:.0f} GB/s, bitwise equal: {equal}"
                  + ("" if set_up_ms is None else f" (receives posted before, in {set_up_ms:.2f} ms)"), flush=True)
        store.set("finished", "1")
        child.wait(60)
        return out
    finally:
        if child.poll() is None:
            child.kill()


def _nccl_receives(store: dist.TCPStore, pool: KVPool, table: list[int], tokens: int,
                   n: int) -> Iterator[tuple[float, float | None]]:
    """Each transfer's seconds and its receives' posting (ms), yielded before the next starts (so its
    arrival can be checked)."""
    from engine.transport.nccl import DECODE_RANK, NcclKVReceiver, NcclPair

    pair = NcclPair(store, "bench", DECODE_RANK, pool.device, TIMEOUT_S)
    pair.warm_up()
    for i in range(n):
        receiver = NcclKVReceiver(pair, pool, table, tokens)
        set_up = time.perf_counter()
        receiver.post(i, time.monotonic() + TIMEOUT_S)
        set_up_ms = (time.perf_counter() - set_up) * 1e3
        store.set(f"posted{i}", "1")  # the sender goes now, as in the servers, where the receives are posted
        # while the prefill's first layers compute
        # wait as the servers do, without holding the GIL: a spinning thread here would make the
        # receiver's watching thread wait a switch interval (5 ms) each time it wakes
        if not receiver.stopped.wait(TIMEOUT_S) or receiver.error is not None:
            raise RuntimeError(f"transfer {i} failed: {receiver.error}")
        while not receiver.complete():
            time.sleep(0.00005)
        done = time.perf_counter()
        started = float(store.get(f"started{i}"))
        print(f"  from the start (ms): first send posted {_ms(store.get(f'first_post{i}'), started)}, "
              f"last {_ms(store.get(f'last_post{i}'), started)}, "
              f"first layer landed {_ms(receiver.landed_at[0], started)}, last landed "
              f"{_ms(receiver.landed_at[-1], started)}, all in the pool {_ms(done, started)}", flush=True)
        yield done - started, set_up_ms


def _ms(at: float | bytes, since: float) -> str:
    return f"{(float(at) - since) * 1e3:.2f}"


def _ipc_copies(store: dist.TCPStore, pool: KVPool, table: list[int], src_table: list[int], tokens: int,
                n: int) -> Iterator[tuple[float, float | None]]:
    from engine.transport.cuda_ipc import IpcKVReceiver, RemotePool

    handle, offset, slots = store.get("ipc").decode().split(":")
    remote = RemotePool(pool.layout, bytes.fromhex(handle), int(offset), int(slots), pool.device)
    for _ in range(n):
        receiver = IpcKVReceiver(remote, pool, table, tokens)
        receiver.start(src_table, pool.layout.block_size)
        _sync(pool.device)
        started = time.perf_counter()
        for layer in range(pool.layout.num_layers):
            receiver.copy_layer(layer)
        while not receiver.complete():
            pass
        yield time.perf_counter() - started, None
    remote.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the prefill side of bench.e2e.kv_endpoints_gpu (started by it)")
    p.add_argument("transport", choices=["nccl", "cuda-ipc"])
    p.add_argument("port", type=int)
    p.add_argument("preset")
    p.add_argument("tokens", type=int)
    p.add_argument("repeats", type=int)
    p.add_argument("device")
    p.add_argument("--scattered", action="store_true")
    p.add_argument("--busy-ms", type=float, default=0.0)
    p.add_argument("--timed-from", choices=TIMED_FROM, default="kv-ready")
    a = p.parse_args()
    serve(a.transport, a.port, a.preset, a.tokens, a.repeats, torch.device(a.device), a.scattered, a.busy_ms,
          a.timed_from)
