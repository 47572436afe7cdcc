"""The prefill side's map of NIXL peers: a decode server's agent is unloaded when its pairing is replaced
by one with a new agent (the decode server restarted) or dropped; a handshake again from the same agent
keeps it loaded (its transfers may be in flight).

Run in a process of its own by tests/test_nixl_peers.py: importing the prefill server's metrics beside
the decode server's, as the rest of the suite does, registers the same metric names twice."""

from __future__ import annotations

from pd.v1 import prefill_pb2

from prefill_server.transports import NixlSenders


class RecordingAgent:
    """Stands in for NixlAgent's peer bookkeeping: a peer's name is its metadata; loading an agent again
    replaces its copy, as NIXL's add_remote_agent does."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.unloads = 0
        self.metadata = b"prefill-agent"

    def add_peer(self, metadata: bytes) -> str:
        if metadata.decode() not in self.loaded:
            self.loaded.append(metadata.decode())
        return metadata.decode()

    def remove_peer(self, name: str) -> None:
        self.loaded.remove(name)
        self.unloads += 1


def offer(agent: str) -> prefill_pb2.HandshakeRequest:
    return prefill_pb2.HandshakeRequest(nixl_metadata=agent.encode(), nixl_pool_addr=4096, nixl_pool_num_slots=64,
                                        nixl_pool_device=-1)


def senders() -> tuple[NixlSenders, RecordingAgent]:
    s = NixlSenders.__new__(NixlSenders)  # no runner, no NIXL: only the peer map is under test
    agent = RecordingAgent()
    s.agent, s._peers = agent, {}  # type: ignore[assignment]
    return s, agent


def test_replaced_pairing_unloads_the_old_agent() -> None:
    s, agent = senders()
    s.pair("decode-1", offer("agent-a"))
    s.pair("decode-2", offer("agent-b"))
    s.pair("decode-1", offer("agent-c"))  # decode-1 restarted with a new agent
    assert sorted(agent.loaded) == ["agent-b", "agent-c"]
    assert s._peers["decode-1"][0] == "agent-c"


def test_handshake_again_from_the_same_agent_keeps_it_loaded() -> None:
    s, agent = senders()
    s.pair("decode-1", offer("agent-a"))
    s.pair("decode-1", offer("agent-a"))  # after a freeze: the same process, transfers maybe in flight
    assert agent.loaded == ["agent-a"] and agent.unloads == 0 and s._peers["decode-1"][0] == "agent-a"


def test_dropped_pairing_unloads_its_agent() -> None:
    s, agent = senders()
    s.pair("decode-1", offer("agent-a"))
    s.pair("decode-2", offer("agent-b"))
    s.forget("decode-1")
    s.forget("never-paired")
    assert agent.loaded == ["agent-b"] and list(s._peers) == ["decode-2"]
