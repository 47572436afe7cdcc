"""KV over NIXL (UCX backend): each server registers its whole KV pool with one NIXL agent at
start; the agents' metadata travels in the pairing handshake (no port of NIXL's own). The prefill
side WRITEs each layer's KV into the slots the decode server reserved, as each layer finishes,
naming them by index into both pools' descriptor lists prepared at pairing
(engine.transport.nixl_descriptors; benchmarks also build them per transfer, as merged runs); once
every write is done it sends a notification ("done" or, after a transfer that stopped early, "end").
UCX picks the wire (RDMA between hosts, cuda_ipc inside one, TCP otherwise) from the environment
(UCX_TLS, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.kv_cache import KVPool
from engine.transport.base import KVReceiver, KVSender
from engine.transport.nixl_descriptors import PoolAddress, PreparedPools, layer_descriptors, layer_indices, plane_rows

log = logging.getLogger(__name__)

DONE, END = b"done", b"end"  # a notification's kind, before ":" and the transfer's tag
TRANSFER_TIMEOUT_S = 60.0  # the prefill side's sender lets go of writes not done by then
PUMP_S = 0.0005  # how often a host-memory pool's agent progresses UCX
WHEEL = "nixl-cu13"  # the variant pyproject.toml installs (CPU and CUDA 13 builds of torch)


class NixlUnavailable(RuntimeError):
    pass


def nixl_api() -> ModuleType:
    """NIXL's Python API, from whichever CUDA variant of the wheel is installed."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlUnavailable(f"KV transport nixl needs NIXL: pip install {WHEEL}")


def nixl_available() -> bool:
    """Whether a NIXL wheel is installed, without loading it: its bundled libraries must not meet
    grpc_tools' protoc in one process (both loaded, the process crashes), as in a test run."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu13", "nixl_cu12", "nixl"))


class NixlAgent:
    """This process's agent, its pool registered once. Every call into NIXL holds one lock (the
    engine thread sends, the writer thread and the event loop poll notifications)."""

    def __init__(self, pool: KVPool, role: str, telemetry: bool = False) -> None:
        """`telemetry`: NIXL records each transfer's descriptors (`descriptors_posted`; benchmarks)."""
        api = nixl_api()
        self.pool = pool
        self.name = f"{role}-{uuid.uuid4().hex[:12]}"
        # NIXL's progress thread polls UCX without pause (the Python API sets no delay): a core per
        # agent. GPU pools keep it, so writes move while the prefill computes; host-memory pools (CPU
        # servers, where every core counts) drive UCX from a thread of ours that polls every PUMP_S.
        on_gpu = pool.device.type == "cuda"
        config = api.nixl_agent_config(enable_prog_thread=on_gpu, capture_telemetry=telemetry, backends=["UCX"])
        self._agent = api.nixl_agent(self.name, config)
        self._reg = self._agent.register_memory(pool.storage)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self.mem_type = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self._lock = threading.Lock()
        self._notes: dict[str, set[bytes]] = {}  # peer agent -> notifications not yet taken
        self._closed = threading.Event()
        self._pumping = None if on_gpu else threading.Thread(target=self._pump, daemon=True, name="nixl-progress")
        if self._pumping is not None:
            self._pumping.start()

    def _pump(self) -> None:
        """Progress UCX (a notification poll does) while no call of ours does: a WRITE's bytes land on
        the decode side only as its worker progresses."""
        while not self._closed.wait(PUMP_S):
            with self._lock:
                self._collect()

    def _collect(self) -> None:
        for name, notes in self._agent.get_new_notifs().items():
            self._notes.setdefault(name, set()).update(notes)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (replacing an earlier copy of the same agent); its name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._notes.setdefault(name, set())
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._notes.pop(name, None)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # a peer never fully loaded, or already gone
                log.debug("removing NIXL peer %s: %s", name, e)

    def write(self, local: np.ndarray, remote: np.ndarray, peer: str) -> Any:
        """Post a WRITE of `local` descriptors into the peer's `remote` ones; its handle."""
        return self.start(self.make_xfer("WRITE", local, remote, peer), "WRITE", peer)

    def read(self, local: np.ndarray, remote: np.ndarray, peer: str) -> Any:
        """Post a READ of the peer's `remote` descriptors into `local` ones; its handle."""
        return self.start(self.make_xfer("READ", local, remote, peer), "READ", peer)

    def make_xfer(self, op: str, local: np.ndarray, remote: np.ndarray, peer: str) -> Any:
        """A transfer of (address, bytes, device) rows, checked by NIXL now, not yet posted."""
        with self._lock:
            src = self._agent.get_xfer_descs(local, self.mem_type)
            dst = self._agent.get_xfer_descs(remote, self.mem_type)
            return self._agent.initialize_xfer(op, src, dst, peer)

    def make_prepared_write(self, prepared: PreparedPools, local: np.ndarray, remote: np.ndarray, peer: str) -> Any:
        """A WRITE of the prepared lists' `local` descriptors into their `remote` ones, not yet posted."""
        with self._lock:
            if prepared.released:
                raise TransferError(f"the pairing with {peer} was replaced or dropped")
            return self._agent.make_prepped_xfer("WRITE", prepared.local, local, prepared.remote, remote)

    def start(self, handle: Any, op: str, peer: str, prepared: PreparedPools | None = None) -> Any:
        """Post a transfer made by make_xfer or make_prepared_write (from `prepared`); its handle
        (released if NIXL refuses, or if `prepared` was let go since: its peer may be unloaded)."""
        with self._lock:
            if prepared is not None and prepared.released:
                self._agent.release_xfer_handle(handle)
                raise TransferError(f"the pairing with {peer} was replaced or dropped")
            if self._agent.transfer(handle) != "ERR":
                return handle
            self._agent.release_xfer_handle(handle)
        raise TransferError(f"NIXL refused a {op} with {peer}")

    def prepare(self, peer: str, remote: PoolAddress, chunk: int) -> PreparedPools:
        """Both pools, ours and the peer's, as descriptor lists of `chunk`-token pieces of every plane,
        prepared once (NIXL checks every descriptor against the registrations here, not per transfer)."""
        token_bytes = self.pool.layout.bytes_per_token_per_layer // 2
        planes = self.pool.layout.num_layers * 2
        here = PoolAddress.of(self.pool)
        with self._lock:
            local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", plane_rows(here, planes, chunk, token_bytes),
                                                self.mem_type)
            try:
                theirs = self._agent.prep_xfer_dlist(peer, plane_rows(remote, planes, chunk, token_bytes),
                                                     remote.mem_type)
            except BaseException:
                self._agent.release_dlist_handle(local)
                raise
        return PreparedPools(local, theirs, chunk, here.num_slots // chunk, remote.num_slots // chunk,
                             planes * (remote.num_slots // chunk))

    def release_prepared(self, prepared: PreparedPools) -> None:
        """Let go of a pairing's lists; a sender still holding them then fails its next post, never
        naming freed lists."""
        with self._lock:
            if not prepared.released:
                prepared.released = True
                self._agent.release_dlist_handle(prepared.local)
                self._agent.release_dlist_handle(prepared.remote)

    def state(self, handle: Any) -> str:
        with self._lock:
            return str(self._agent.check_xfer_state(handle))

    def descriptors_posted(self, handle: Any) -> int:
        """How many descriptors NIXL gave its backend for a finished transfer, after merging neighbours."""
        with self._lock:
            return int(self._agent.get_xfer_telemetry(handle).descCount)

    def release(self, handle: Any) -> None:
        with self._lock:
            self._agent.release_xfer_handle(handle)

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer, message)

    def take_note(self, peer: str, tag: bytes) -> bytes | None:
        """DONE or END if the peer sent it for transfer `tag` (taken: asked once), else None."""
        with self._lock:
            self._collect()
            notes = self._notes.get(peer, set())
            for kind in (DONE, END):
                if kind + b":" + tag in notes:
                    notes.discard(kind + b":" + tag)
                    return kind
        return None

    def close(self) -> None:
        self._closed.set()
        if self._pumping is not None:  # gone before NIXL is: no poll of ours outlives the agent
            self._pumping.join()
        with self._lock:
            self._agent.deregister_memory(self._reg)


class TransferError(RuntimeError):
    pass


LayerWrite = Callable[[int], Any]  # one layer's WRITE, made (NixlAgent.start posts it)


def prepared_writes(agent: NixlAgent, peer: str, prepared: PreparedPools, pairs: np.ndarray) -> LayerWrite:
    """Each layer's WRITE by index into the pairing's prepared lists (`pairs`: nixl_descriptors.chunk_pairs)."""
    return lambda layer: agent.make_prepared_write(prepared, *layer_indices(pairs, prepared, layer), peer)


def merged_writes(agent: NixlAgent, peer: str, remote: PoolAddress, runs: np.ndarray) -> LayerWrite:
    """Each layer's WRITE as one descriptor per run and plane (`runs`: nixl_descriptors.slot_runs)."""
    here = PoolAddress.of(agent.pool)
    token_bytes = agent.pool.layout.bytes_per_token_per_layer // 2

    def make(layer: int) -> Any:
        local = layer_descriptors(runs, here, 0, layer, token_bytes)
        return agent.make_xfer("WRITE", local, layer_descriptors(runs, remote, 1, layer, token_bytes), peer)

    return make


class NixlKVSender(KVSender):
    """Prefill side: each layer's WRITE (made by `make`) posted from a thread of its own once the layer's KV
    is written (a CUDA event on the GPU), so the prefill never waits; `finish` waits for every write,
    then notifies DONE, or END when the transfer stopped early (a cancel or a failure: the decode side
    then knows nothing more will land). The thread makes the next layers' WRITEs while it waits for
    their KV, and notes the earlier ones done as it goes, so that once the last layer's KV is there
    only its post, its WRITE and the notification stand between it and the decode side; the handles
    are let go in `release`, after the answer has left."""

    def __init__(self, agent: NixlAgent, peer: str, make: LayerWrite, tag: str, num_layers: int,
                 timeout_s: float, prepared: PreparedPools | None = None) -> None:
        """`prepared`: the pairing's lists `make` draws on; a WRITE made from them is not posted once
        they are let go."""
        self.agent, self.peer, self.make, self.prepared = agent, peer, make, prepared
        self.timeout_s = timeout_s
        self.tag, self.num_layers = tag.encode(), num_layers
        self._handles: list[Any] = []  # posted
        self._landed = 0  # how many of them (in order) NIXL has reported done
        self._released = False
        self._error: BaseException | None = None
        self._layers: queue.Queue[tuple[int, torch.cuda.Event | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._post_loop, daemon=True, name="nixl-send")
        self._thread.start()

    def layer_done(self, layer: int) -> None:
        if self._error is not None:
            raise TransferError(f"KV over nixl: {self._error}")
        event = None
        if self.agent.pool.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._layers.put((layer, event))

    def _post_loop(self) -> None:
        made: dict[int, Any] = {}  # WRITEs made ahead of their layer's KV, not yet posted
        ahead = 0  # the next layer to make while no layer waits
        while True:
            if ahead < self.num_layers and self._error is None and self._layers.empty():
                try:
                    made[ahead] = self.make(ahead)
                except BaseException as e:
                    self._error = e
                ahead += 1
                continue
            if (item := self._layers.get()) is None:
                break
            layer, event = item
            if self._error is not None:
                continue
            handle = made.pop(layer, None)
            ahead = max(ahead, layer + 1)
            try:
                handle = handle if handle is not None else self.make(layer)
                if event is not None:
                    event.synchronize()
            except BaseException as e:
                self._error = e
                if handle is not None:
                    made[layer] = handle  # released below
                continue
            try:
                self._handles.append(self.agent.start(handle, "WRITE", self.peer, self.prepared))  # released if refused
            except BaseException as e:
                self._error = e
            self._check_landed(wait=False)
        for handle in made.values():  # never posted: the transfer stopped early
            self.agent.release(handle)

    def _check_landed(self, wait: bool) -> None:
        """Move past the posted WRITEs NIXL reports done, in order; `wait`: until all are, or the timeout."""
        give_up = time.monotonic() + self.timeout_s
        while self._landed < len(self._handles):
            state = self.agent.state(self._handles[self._landed])
            if state == "DONE":
                self._landed += 1
            elif state == "ERR" or (wait and time.monotonic() > give_up):
                self._error = self._error or TransferError(
                    f"a NIXL WRITE to {self.peer} {'failed' if state == 'ERR' else 'hung'}")
                return
            elif wait:
                time.sleep(0.0001)
            else:
                return

    def finish(self) -> None:
        self._layers.put(None)
        self._thread.join()
        self._check_landed(wait=True)
        whole = self._error is None and len(self._handles) == self.num_layers
        try:
            self.agent.notify(self.peer, (DONE if whole else END) + b":" + self.tag)
        except Exception as e:  # its agent unloaded (the pairing replaced or dropped): the first error stays
            self._error = self._error or TransferError(f"no notification reached {self.peer}: {e}")
        if self._error is not None:
            raise TransferError(f"KV over nixl: {self._error}") from self._error

    def release(self) -> None:
        """Let go of every posted WRITE (NIXL's bookkeeping), once finish has returned or raised."""
        if not self._released:
            self._released = True
            for handle in self._handles:
                self.agent.release(handle)


class NixlKVReceiver(KVReceiver):
    """Decode side: the prefill server writes into the pool itself; this waits for its notification."""

    def __init__(self, agent: NixlAgent, peer: str, tag: str) -> None:
        self.agent, self.peer, self.tag = agent, peer, tag.encode()
        self.ended = False  # the prefill side sent its last notification: nothing more will land

    def complete(self) -> bool:
        if not self.ended:
            note = self.agent.take_note(self.peer, self.tag)
            if note is not None:
                self.ended = True
                if note == END:
                    self.error = TransferError("the prefill server stopped the transfer early")
        return self.ended and self.error is None
