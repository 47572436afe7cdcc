"""What both servers do around their servicers: bind (with a clear error), health, reflection,
TLS, metrics endpoint, logging, SIGTERM drain, uvloop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.event_loop import run_event_loop
from serving.gc_freeze import unfreeze_startup_objects
from serving.server_config import ServerConfig

log = logging.getLogger(__name__)

FATAL_GRACE_S = 1.0

MAX_MESSAGE_BYTES = 256 << 20  # internal KV messages (channels between the servers)
MAX_REQUEST_BYTES = 64 << 20   # what a server accepts in one request; larger: RESOURCE_EXHAUSTED
# Channels between the servers: large KV messages; reconnect soon after a peer restarts (the default
# backoff grows to 120 s); HTTP/2 keepalive pings so a peer that vanishes without closing its socket
# (partition, frozen host) fails the in-flight calls with UNAVAILABLE instead of hanging them.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what bounds the keepalive ping's wait in grpc 1.84
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers: requests are capped at MAX_REQUEST_BYTES (the prefill server's replies carry the KV, so
# sends stay large); the peers' keepalive pings are welcome.
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


# The client's deadline fires first and cancels the call; the server's copy of it started when the
# request arrived, so it runs out a transit time later.
DEADLINE_SLACK_S = 0.1


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether a call that ended early ran into its deadline (else the client cancelled it)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class StatusError(Exception):
    """A request's failure, with the gRPC status code it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StartupError(Exception):
    """A one-line reason the server can't start, and what to do about it."""


# Read by NCCL when a pair's group is made. Our own deadlines abort a stuck pair, so NCCL's watchdog
# must not tear the whole server down; NVLink SHARP is not usable between two single-GPU pods; the
# watchdog's dump-on-timeout would poll the pair's store, which on the decode side is a relay over a
# channel closed once the pair has met (engine.transport.nccl_rendezvous).
# Values already in the environment win.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def set_nccl_env() -> None:
    for name, value in NCCL_ENV.items():
        os.environ.setdefault(name, value)


def setup_process(cfg: ServerConfig) -> None:
    """Logging, how often Python passes the GIL between the server's threads, and NCCL's environment."""
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(cfg.gil_switch_ms / 1e3)
    set_nccl_env()


def server_ssl_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    """What `server_credentials` is for gRPC, for an HTTP listener: the same certificate and, with
    --tls-client-ca, the same demand for client certificates (None without TLS)."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        if cfg.tls_client_ca is not None:
            context.load_verify_locations(cfg.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"can't read TLS files for HTTP: {e}") from e
    return context


def read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise StartupError(f"can't read {flag} {path}: {e.strerror}") from e


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS with --tls-cert/--tls-key; with --tls-client-ca too, every client must present a certificate
    that CA signed (mutual TLS)."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    cert, key = read_pem(cfg.tls_cert, "--tls-cert"), read_pem(cfg.tls_key, "--tls-key")
    if cfg.tls_client_ca is None:
        return grpc.ssl_server_credentials([(key, cert)])
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=read_pem(cfg.tls_client_ca, "--tls-client-ca"),
                                       require_client_auth=True)


def channel_credentials(ca: str | None, client_cert: str | None = None,
                        client_key: str | None = None) -> grpc.ChannelCredentials | None:
    """What a channel to a TLS server needs: the CA that signed its certificate and, for mutual TLS, this
    side's own certificate and key. None (plaintext) when neither is given."""
    if ca is None and client_cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "--tls-ca") if ca else None,
        private_key=read_pem(client_key, "--tls-client-key") if client_key else None,
        certificate_chain=read_pem(client_cert, "--tls-client-cert") if client_cert else None)


def bind(server: grpc.aio.Server, cfg: ServerConfig) -> int:
    address = f"{cfg.host}:{cfg.port}"
    creds = server_credentials(cfg)
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as e:
        port = 0
        log.debug("bind failed: %s", e)
    if port == 0:
        raise StartupError(f"can't listen on {address}: the port is in use or the address is not this "
                           "machine's; stop the other process or pass another --port/--host")
    return port


def check_port_free(cfg: ServerConfig, more: Sequence[tuple[int, str]] = ()) -> None:
    """Fail in a second, before loading a model, when a port is taken (`more`: a server's own
    (port, flag) pairs)."""
    for port, flag in ((cfg.port, "--port"), (cfg.metrics_port, "--metrics-port"), (cfg.health_port, "--health-port"),
                       *more):
        if not port:
            continue
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.host, port))
            except OSError as e:
                raise StartupError(f"can't listen on {cfg.host}:{port} ({e.strerror}); stop the other process or "
                                   f"pass another {flag}") from e


def start_metrics(cfg: ServerConfig) -> None:
    if not cfg.metrics_port:
        return
    from prometheus_client import start_http_server

    try:
        start_http_server(cfg.metrics_port, addr=cfg.host)
    except OSError as e:
        raise StartupError(f"can't serve metrics on {cfg.host}:{cfg.metrics_port} ({e.strerror}); pass "
                           "another --metrics-port, or 0 to turn metrics off") from e


class Health:
    """The standard grpc.health.v1 service; '' (overall) and each named service share one status.
    `listen_plaintext` also answers it alone on a port of its own, for probes that can't do mutual TLS."""

    def __init__(self, services: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.services = ["", *services]
        self.plaintext: grpc.aio.Server | None = None

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, status)

    async def listen_plaintext(self, cfg: ServerConfig) -> None:
        if not cfg.health_port:
            return
        server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        address = f"{cfg.host}:{cfg.health_port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise StartupError(f"can't listen on {address}: pass another --health-port, or 0 to turn it off")
        await server.start()
        self.plaintext = server

    async def close(self) -> None:
        if self.plaintext is not None:
            await self.plaintext.stop(0)


def make_server(register: Callable[[grpc.aio.Server], None], service_names: Sequence[str],
                health_state: Health) -> grpc.aio.Server:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server


async def serve_until_signalled(server: grpc.aio.Server, health_state: Health, drain_timeout_s: float,
                                on_stop: Callable[[], None] | None = None,
                                fatal: asyncio.Event | None = None,
                                on_drain: Callable[[], None] | None = None,
                                in_flight: Callable[[], int] | None = None) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0) or until `fatal` is set (exit 1).

    Draining: health turns NOT_SERVING (still answered, so probes and load balancers see it),
    `on_drain` makes the servicers refuse new work with UNAVAILABLE, and in-flight requests get up
    to `drain_timeout_s` to finish; then the server stops, cancelling what is left. A second
    signal cuts the drain short.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait())]
    if fatal is not None:
        waiters.append(asyncio.ensure_future(fatal.wait()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    failed = fatal is not None and fatal.is_set()
    # An engine failure ends the in-flight streams with an error at once; a second is enough to send them.
    grace = FATAL_GRACE_S if failed else drain_timeout_s
    log.info("%s: health NOT_SERVING, draining for up to %.0fs", "engine failed" if failed else "stopping", grace)
    await health_state.set(False)
    if on_drain is not None:
        on_drain()
    deadline = loop.time() + grace
    stop.clear()
    while in_flight is not None and in_flight() > 0 and loop.time() < deadline and not stop.is_set():
        await asyncio.sleep(0.05)
    left = in_flight() if in_flight is not None else 0
    if left:
        log.warning("stopping with %d requests still in flight (their streams are cancelled)", left)
    remaining = 0.0 if stop.is_set() else max(0.0, deadline - loop.time())
    # Tracked requests are done: a moment more for other calls (a health Watch, a reflection query).
    await server.stop(min(remaining, FATAL_GRACE_S) if in_flight is not None else remaining)
    await health_state.close()
    if on_stop is not None:
        on_stop()
    log.info("stopped")
    return 1 if failed else 0


def run_main(main: Callable[[], Coroutine[Any, Any, int]]) -> None:
    """Run an async main under uvloop; turn StartupError and bad flags into one line and exit 2."""
    from engine.transport.grpc_stream import keep_freed_memory

    keep_freed_memory()
    try:
        code = run_event_loop(main())
    except (StartupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        code = 0
    finally:
        unfreeze_startup_objects()
    sys.exit(code)
