"""`python -m client.generate`: send one prompt (text or token ids) and print the stream as it comes."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc
from pd.v1 import decode_pb2, decode_pb2_grpc

from client.stream import open_channel, stream_generate


def build_request(args: argparse.Namespace) -> decode_pb2.GenerateRequest:
    request = decode_pb2.GenerateRequest(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                                         sampling=decode_pb2.SamplingParams(temperature=args.temperature,
                                                                            top_p=args.top_p, top_k=args.top_k,
                                                                            seed=args.seed))
    if args.token_ids:
        request.token_ids.extend(int(t) for t in args.token_ids.split(","))
    else:
        request.prompt = args.prompt
    return request


async def run(args: argparse.Namespace) -> int:
    channel = open_channel(args.target, args.tls_ca, args.tls_client_cert, args.tls_client_key)
    stub = decode_pb2_grpc.DecodeStub(channel)
    sent = time.perf_counter()
    last = None
    try:
        async for response, arrived in stream_generate(stub, build_request(args), timeout=args.timeout):
            if args.show_ids:
                print(f"[{response.index}] id={response.token_id} +{(arrived - sent) * 1e3:.1f}ms "
                      f"{response.text!r}", flush=True)
            else:
                print(response.text, end="", flush=True)
            last = response
    except grpc.aio.AioRpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        await channel.close()
    if last is not None:
        t = last.timing
        print(f"\nfinish_reason={last.finish_reason} tokens={last.index + 1} ttft={t.first_token_s * 1e3:.1f}ms "
              f"(queue {t.queue_s * 1e3:.1f}, prefill {t.prefill_s * 1e3:.1f}, kv {t.kv_transfer_s * 1e3:.1f})")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m client.generate", description=__doc__)
    p.add_argument("prompt", nargs="?", default="", help="prompt text (needs a server with a tokenizer)")
    p.add_argument("--token-ids", help="comma-separated token ids instead of text")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--show-ids", action="store_true", help="one line per token with its id and arrival time")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--tls-ca", help="PEM CA bundle, when the server uses TLS")
    p.add_argument("--tls-client-cert", help="PEM certificate to present, when the server requires one")
    p.add_argument("--tls-client-key", help="PEM private key for --tls-client-cert")
    args = p.parse_args()
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        p.error("--tls-client-cert and --tls-client-key go together")
    if not args.prompt and not args.token_ids:
        p.error("give a prompt or --token-ids")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
