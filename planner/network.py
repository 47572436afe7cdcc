"""The network between nodes: where a deployment's GPUs sit, and what a KV handoff between two nodes costs.

Inside a node a handoff is priced as measured (`Costs.kv_handoff_ms`: NVLink between two H200s). Between nodes
the KV crosses each GPU's NIC. The prefill streams a layer's KV out as soon as that layer is computed, so the
transfer hides behind the compute until the NIC is slower than the prefill: with L layers, t a layer's bytes on
the NIC and c a layer's compute, the last layer lands t + max(0, (L - 1)(t - c)) after the compute ends (the
slowest point of the pipeline), plus the NIC's latency once (the last write and its notification).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.costs import KV_BYTES_PER_TOKEN, LAYERS, Costs

NIC_GBPS = 400.0        # per GPU, gigabits a second: one 400G InfiniBand / RoCE NIC a GPU, as on H200 nodes
NIC_LATENCY_US = 5.0    # one RDMA write and its completion across a switch
GPUS_PER_NODE = 8
# how a deployment's servers sit on nodes (Deployment.pools):
#   nvlink     every GPU in one NVLink domain, prefill servers shared by all decode servers (the plan's default)
#   per-node   each node the same split, its decode servers handed KV only by its own prefill servers
#   split-nodes prefill servers fill nodes of their own, decode servers the nodes after: every handoff crosses NICs
POOLS = ("nvlink", "per-node", "split-nodes")


@dataclass(frozen=True)
class Network:
    nic_gbps: float = NIC_GBPS
    nic_latency_us: float = NIC_LATENCY_US
    gpus_per_node: int = GPUS_PER_NODE

    def __post_init__(self) -> None:
        if self.nic_gbps <= 0 or self.nic_latency_us < 0 or self.gpus_per_node < 1:
            raise ValueError("the network needs a positive NIC rate (--nic-gbps), a latency >= 0 "
                             "(--nic-latency-us) and at least one GPU a node")

    @property
    def nic_bytes_per_ms(self) -> float:
        return self.nic_gbps / 8 * 1e9 / 1e3

    def nic_exposed_ms(self, tokens: int, compute_ms: float) -> float:
        """What of `tokens`' KV on the NIC is left after a prefill of `compute_ms` (streamed a layer at a time)."""
        if tokens <= 0:
            return 0.0
        layer_ms = tokens * KV_BYTES_PER_TOKEN / LAYERS / self.nic_bytes_per_ms
        compute_layer_ms = compute_ms / LAYERS
        return layer_ms + max(0.0, (LAYERS - 1) * (layer_ms - compute_layer_ms)) + self.nic_latency_us / 1e3

    def handoff_ms(self, costs: Costs, tokens: int, sent_tokens: int, compute_ms: float) -> float:
        """A handoff between nodes beyond the prefill: the servers' own part of the measured one (control messages,
        the decode side's completion; the measured tail less its last layer on NVLink) and the NIC's exposed part.
        `sent_tokens`: what the decode server lacks (the prefill server sends from its cached prefix on)."""
        return control_ms(costs, tokens) + self.nic_exposed_ms(sent_tokens, compute_ms)

    def hold_ms(self, costs: Costs, tokens: int, sent_tokens: int, compute_ms: float) -> float:
        """How long the prefill worker waits for its sends across the NIC before its next prompt."""
        return min(costs.kv_send_ms, control_ms(costs, tokens)) + self.nic_exposed_ms(sent_tokens, compute_ms)


def control_ms(costs: Costs, tokens: int) -> float:
    """The measured handoff beyond the prefill less its bytes' share on NVLink: what the servers add whatever the
    link (`Costs.kv_handoff_ms` with the last layer's transfer taken out)."""
    nvlink_layer_ms = tokens * KV_BYTES_PER_TOKEN / LAYERS / (costs.kv.params[0] * 1e9) * 1e3
    return max(0.0, costs.kv_handoff_ms(tokens) - nvlink_layer_ms)


def node_layout(pools: str, prefill: int, decode: int, gpus_per_node: int) -> tuple[list[int], list[int]]:
    """The node of each prefill server and of each decode server."""
    if pools == "nvlink":
        return [0] * prefill, [0] * decode
    if pools == "split-nodes":
        first_decode_node = -(-prefill // gpus_per_node)
        return ([i // gpus_per_node for i in range(prefill)],
                [first_decode_node + j // gpus_per_node for j in range(decode)])
    if pools != "per-node":
        raise ValueError(f"unknown pools {pools!r}: use one of {', '.join(POOLS)}")
    nodes, left = divmod(prefill + decode, gpus_per_node)
    if left or prefill % nodes or decode % nodes:
        raise ValueError(f"per-node pools need whole nodes of {gpus_per_node} GPUs, each with the same split: "
                         f"{prefill}P+{decode}D does not divide into them")
    return ([i // (prefill // nodes) for i in range(prefill)],
            [j // (decode // nodes) for j in range(decode)])
