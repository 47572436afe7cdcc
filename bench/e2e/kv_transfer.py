"""`python -m bench.e2e.kv_transfer`: how fast a prompt's KV moves from the prefill side to the
decode side, and whether it arrives bit for bit.

--mode servers (GPU): real prefill and decode server processes with `--kv-transport T`; a
prompt of --tokens is prefilled remotely (`--kv-checksum on` checksums every handoff); the figures
are the decode server's own (ServerTiming): handoff time beyond the prefill's compute (and its
checksums), and the part exposed after the prefill's last layer.
--mode endpoints: the transport's real endpoints without a model, the whole KV moved with nothing
to hide it under. grpc (any machine): a subprocess streams a KV pool of the preset's layout,
filled with random values, through GrpcKVSender over gRPC on loopback, into GrpcKVReceiver and a
pool here. nccl, cuda-ipc (two GPUs): `bench.e2e.kv_endpoints_gpu`. nixl (any machine: host memory on
the CPU, GPU 0's memory with a GPU): `bench.e2e.kv_endpoints_nixl`, WRITE and READ.
Several --transport and --mode values run one after another into one --json.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from bench.common import metadata, write_json
from bench.random_pool import make_pool
from engine.kv_checksum import layer_checksums
from engine.presets import PRESETS
from engine.transport.grpc_stream import GrpcKVReceiver, GrpcKVSender, chunk_tokens_for, keep_freed_memory
from engine.transport.grpc_wire import KVView, add_prefill_servicer, encode_kv, prefill_stream
from launcher.process import ServerFailed, ServerProcess, stop_all
from serving.grpc_common import GRPC_OPTIONS


class EndpointService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, preset: str, tokens: int) -> None:
        self.pool, self.table = make_pool(preset, tokens, seed=1)
        self.slots = self.pool.slots(self.table, 0, tokens)
        self.checksums = layer_checksums(self.pool, self.table, tokens)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any):  # type: ignore[no-untyped-def,override]
        out: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(layer: int, start: int, end: int, parts: list[memoryview]) -> None:
            loop.call_soon_threadsafe(out.put_nowait, encode_kv(layer, start, end, parts))

        def send_all() -> None:
            sender = GrpcKVSender(self.pool, self.slots, chunk_tokens_for(self.pool.layout), emit,
                                  self.pool.table_start(self.table, len(self.slots)))
            for layer in range(self.pool.layout.num_layers):
                sender.layer_done(layer)
            sender.finish()
            done = prefill_pb2.PrefillDone(layer_checksums=self.checksums)
            loop.call_soon_threadsafe(out.put_nowait, prefill_pb2.PrefillResponse(done=done))

        task = loop.run_in_executor(None, send_all)
        while True:
            item = await out.get()
            yield item
            if not isinstance(item, bytes):  # the PrefillDone that ends the stream
                break
        await task


async def serve_endpoint(port: int, preset: str, tokens: int) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    add_prefill_servicer(EndpointService(preset, tokens), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def receive_once(address: str, preset: str, tokens: int) -> tuple[float, int, bool]:
    pool, table = make_pool(preset, tokens, seed=2)
    receiver = GrpcKVReceiver(pool, table, tokens)
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        call = prefill_stream(channel)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        checksums: list[int] = []
        async for message in call(prefill_pb2.PrefillRequest(token_ids=[0])):
            if isinstance(message, KVView):
                c = message
                await loop.run_in_executor(None, receiver.write, c.layer, c.token_start, c.token_end, c.data)
            else:
                checksums = list(message.done.layer_checksums)
        seconds = time.perf_counter() - t0
    return seconds, receiver.bytes_received, receiver.complete() and checksums == layer_checksums(pool, table, tokens)


def endpoints_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    port = 50090
    proc = subprocess.Popen([sys.executable, "-m", "bench.e2e.kv_transfer", "--serve-endpoint", str(port), "--preset",
                             args.preset, "--tokens", str(args.tokens)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        rows = []
        for i in range(args.repeats + 1):
            seconds, nbytes, equal = asyncio.run(receive_once(f"127.0.0.1:{port}", args.preset, args.tokens))
            if i:  # the first is a warm-up
                rows.append({"transport": "grpc", "mode": "endpoints", "tokens": args.tokens, "bytes": nbytes,
                             "seconds": round(seconds, 4), "gbps": round(nbytes / seconds / 1e9, 3),
                             "exposed_ms": None, "bitwise_equal": equal})
                print(f"grpc endpoints: {nbytes / 1e9:.2f} GB in {seconds * 1e3:.0f} ms = "
                      f"{nbytes / seconds / 1e9:.2f} GB/s, bitwise equal: {equal}", flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(10)


def servers_rows(args: argparse.Namespace, transport: str) -> list[dict[str, Any]]:
    common = ["--host", "127.0.0.1", "--preset", args.preset, "--kv-transport", transport, "--metrics-port",
              "0", "--max-model-len", str(args.tokens + 64)]
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    logs = Path(args.logs) / transport if args.logs else Path(tempfile.mkdtemp())
    prefill = ServerProcess("prefill_server", [*common, "--port", "50062", "--device", "cuda:0"], "127.0.0.1:50062",
                            logs / "prefill.log")
    decode = ServerProcess("decode_server", [*common, "--port", "50061", "--http-port", "0", "--device", decode_device,
                                             "--prefill-addr",
                                             prefill.address, "--no-cuda-graphs", "--max-batch-size", "4",
                                             "--kv-checksum", "on"], "127.0.0.1:50061", logs / "decode.log")
    try:  # one after the other: on a shared GPU, the decode server sizes its KV pool from what the prefill left
        prefill.start(timeout=900)
        decode.start(timeout=900)
        return asyncio.run(_timed_handoffs(args))
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        stop_all([decode, prefill], timeout=60)


async def _timed_handoffs(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel("127.0.0.1:50061") as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        for i in range(args.repeats + 1):
            prompt = torch.randint(0, 256, (args.tokens,), generator=torch.Generator().manual_seed(i)).tolist()
            request = decode_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=1, ignore_eos=True,
                                                 prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED)
            last = None
            async for response in stub.Generate(request, timeout=300):
                last = response
            assert last is not None
            t = last.timing
            if i:
                rows.append({"transport": t.kv_transport, "mode": "servers", "tokens": args.tokens,
                             "bytes": t.kv_bytes, "seconds": round(t.kv_transfer_s, 5),
                             "gbps": None,  # "seconds" is the handoff beyond the prefill, not a link transfer
                             "exposed_ms": round(t.kv_exposed_s * 1e3, 3), "prefill_ms": round(t.prefill_s * 1e3, 1),
                             "bitwise_equal": True})  # --kv-checksum on: a mismatch fails the request (DATA_LOSS)
                print(f"{t.kv_transport}: {t.kv_bytes / 1e9:.2f} GB, handoff beyond prefill "
                      f"{t.kv_transfer_s * 1e3:.2f} ms, exposed {t.kv_exposed_s * 1e3:.2f} ms, prefill "
                      f"{t.prefill_s * 1e3:.0f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.kv_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", nargs="+", default=["grpc"], choices=["grpc", "nccl", "cuda-ipc", "nixl"])
    p.add_argument("--mode", nargs="+", choices=["servers", "endpoints"], default=None,
                   help="default: servers with a GPU, endpoints without")
    p.add_argument("--preset", default="qwen2.5-7b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--blocks", nargs="+", choices=["contiguous", "scattered"], default=["contiguous"],
                   help="GPU endpoints: both pools' block tables one run (cuda-ipc and nccl move them as slices) "
                        "or scattered (gathered and scattered)")
    p.add_argument("--sender-busy-ms", type=float, nargs="+", default=[0.0],
                   help="GPU endpoints: run matmuls on the sending GPU for this long just before each transfer, "
                        "so it starts at working clocks as after a prefill (0: from idle)")
    p.add_argument("--timed-from", nargs="+", choices=["kv-ready", "first-call"], default=["kv-ready"],
                   help="GPU endpoints, nccl: start the clock when the KV is ready on the sending GPU, every "
                        "send queued behind it as in the servers (kv-ready), or at the sender's first call")
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=None)
    p.add_argument("--serve-endpoint", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    keep_freed_memory()  # as the servers do (serving.grpc_common.run_main)
    if args.serve_endpoint:
        asyncio.run(serve_endpoint(args.serve_endpoint, args.preset, args.tokens))
        return
    rows = []
    for mode in args.mode or ["servers" if torch.cuda.is_available() else "endpoints"]:
        for transport in args.transport:
            if mode == "servers":
                rows += servers_rows(args, transport)
            elif transport == "grpc":
                rows += endpoints_rows(args)
            elif transport == "nixl":
                from bench.e2e import kv_endpoints_nixl

                device = "cuda:0" if torch.cuda.is_available() else "cpu"
                rows += kv_endpoints_nixl.rows(args.preset, args.tokens, args.repeats, device)
            else:
                from bench.e2e import kv_endpoints_gpu

                for blocks in args.blocks:
                    for busy_ms in args.sender_busy_ms:
                        for timed_from in args.timed_from if transport == "nccl" else ["first-call"]:
                            rows += kv_endpoints_gpu.rows(transport, args.preset, args.tokens, args.repeats,
                                                          scattered=blocks == "scattered", sender_busy_ms=busy_ms,
                                                          timed_from=timed_from)
    if args.json:
        write_json(args.json, {**metadata(), "preset": args.preset, "rows": rows})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
