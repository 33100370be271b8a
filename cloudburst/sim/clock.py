"""The virtual cluster's clock: what each step, message, collective and server apply costs, in
virtual seconds.

Every cost is a pure function of its arguments and the configuration: the same run gives the
same times whatever order the simulator asks in. The links' costs are
the emulated link's own formulas (:mod:`cloudburst.comm.costs`: ring all-reduce, log-tree
broadcast, latency + bytes / bandwidth), so a simulated run and a real run with the emulated
link charge the same time for the same traffic, by construction.

Modelled: each worker's compute time per step (given, from a profile, or calibrated; times a
straggler's or a slow fault's factor; times seeded noise), each node's NIC (``--inter-node-link``
is its egress; ``--nic-ingress-gbit-per-s`` its ingress), shared by the node's ranks, with
messages into one node queued at its ingress (incast), the intra-node link
(``--intra-node-link``, free by default, one per rank), a parameter server's apply (bytes /
memory bandwidth), and a stand-in model's message sizes; with ``--network-model nccl`` also
hierarchical all-reduce, the algorithm chosen by size, and DDP's overlap with backward
(:mod:`cloudburst.comm.costs`; docs/simulator.md). Not modelled: see
:data:`NOT_MODELLED`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from cloudburst.comm.costs import (
    LinkSpec,
    best_allreduce_s,
    ddp_overlap_end_s,
    hierarchical_allreduce_s,
    nic_transfer,
)
from cloudburst.comm.link import LinkEmulator
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig

NOT_MODELLED = (
    "contention between the ranks of one node for memory bandwidth and PCIe; intra-node "
    "messages queue at their sender only",
    "the switch fabric: oversubscription, congestion control, packet loss",
    "operating-system noise beyond the step-time jitter",
    "evaluation and checkpoint time",
    "a stand-in model's convergence (the maths is the run's own small model)",
)

STEP_TIME_SOURCES = ("flag", "profile", "calibrated", "min_step_time")


def _link(text: str | None) -> LinkEmulator:
    return LinkEmulator(None if text is None else LinkSpec.parse(text))


def _describe_link(emulator: LinkEmulator) -> dict[str, float] | None:
    spec = emulator.spec
    return None if spec is None else {"gbit_per_s": spec.gbit_per_s, "latency_ms": spec.latency_ms}


class ClockModel:
    """The costs the simulated transport charges, in virtual seconds.

    ``step_time_s`` is the base compute time of one step, resolved once by
    :func:`resolve_step_time` (so that a calibration runs once, outside); ``step_time_source``
    says where it came from (one of :data:`STEP_TIME_SOURCES`) for the summary.
    """

    def __init__(
        self,
        sim: SimulationConfig,
        cfg: RunConfig,
        actual_params: int,
        step_time_s: float,
        step_time_source: str = "flag",
    ):
        if actual_params < 1:
            raise ValueError(f"actual_params: {actual_params} must be >= 1")
        if not step_time_s > 0:
            raise ValueError(f"step_time_s: {step_time_s} must be > 0")
        # --network-model, else nccl where the run models GPUs, flat where the CPU emulation:
        # resolved once here, so that the summary's settings say which the run used.
        network_model, self.network_model_reason = sim.network_model_for(cfg.model.device)
        if sim.network_model != network_model:
            sim = dataclasses.replace(sim, network_model=network_model)
        self.sim, self.cfg = sim, cfg
        self.actual_params = actual_params
        self.step_time_s = float(step_time_s)
        self.step_time_source = step_time_source
        self.jitter = sim.jitter
        self.inter = _link(cfg.cluster.inter_node_link)
        self.intra = _link(sim.intra_node_link)
        modelled = sim.stand_in_params
        # Float payloads (θ, Δ, gradients) scale with the parameter count; headers do not.
        self.wire_scale = 1.0 if modelled is None else modelled / actual_params
        self.apply_bytes_per_s = sim.server_apply_gbyte_per_s * 1e9

    # ------------------------------------------------------------------ compute
    def jitter_factor(self, worker: int, step: int) -> float:
        """The noise of ``worker``'s step ``step``: a uniform drawn from a hash of
        (seed, worker, step), so it never depends on the order of calls."""
        if self.jitter is None:
            return 1.0
        key = f"cloudburst-step-jitter:{self.cfg.training.seed}:{worker}:{step}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        return self.jitter.sample((draw + 0.5) / 2**64)  # in (0, 1), never 0 or 1

    def step_s(self, worker: int, step: int, factor: float) -> float:
        """Seconds of ``worker``'s step ``step`` (1-based): base x ``factor`` (a straggler's
        or a slow fault's) x the seeded noise."""
        return self.step_time_s * factor * self.jitter_factor(worker, step)

    # ------------------------------------------------------------------ bytes
    def wire_bytes(self, tensor_bytes: int, payload: bool) -> float:
        """Bytes a message carries on the modelled wire: a payload (the model's values, in
        whatever format: see :func:`is_payload`) scaled to the stand-in model's size; control
        data (headers, versions) as it is."""
        return tensor_bytes * self.wire_scale if payload else float(tensor_bytes)

    # ------------------------------------------------------------------ links
    def _emulator(self, crosses_nodes: bool) -> LinkEmulator:
        return self.inter if crosses_nodes else self.intra

    def latency_s(self, crosses_nodes: bool) -> float:
        spec = self._emulator(crosses_nodes).spec
        return 0.0 if spec is None else spec.latency_s

    def p2p_s(self, nbytes: float, crosses_nodes: bool) -> float:
        """One message: latency + bytes / bandwidth (0 on a free link)."""
        return self._emulator(crosses_nodes).p2p_s(nbytes)

    def allreduce_s(self, nbytes: float, group_size: int, spans_nodes: bool) -> float:
        """A ring all-reduce of n ranks: 2(n−1) latencies + 2(n−1)/n x bytes / bandwidth."""
        return self._emulator(spans_nodes).allreduce_s(nbytes, group_size)

    @property
    def nccl(self) -> bool:
        """``--network-model nccl``: hierarchical, size-chosen collectives and DDP's overlap."""
        return self.sim.network_model == "nccl"

    def nic_send(self, start_s: float, ingress_free_s: float, nbytes: float):
        """A message between nodes: (egress free, arrival), :func:`~cloudburst.comm.costs.
        nic_transfer` on the NIC (free links: (start, start))."""
        spec = self.inter.spec
        if spec is None:
            return start_s, start_s
        ingress = self.sim.nic_ingress_gbit_per_s
        ingress_bps = spec.bytes_per_s if ingress is None else ingress * 1e9 / 8
        return nic_transfer(
            start_s, ingress_free_s, nbytes, spec.latency_s, spec.bytes_per_s, ingress_bps
        )

    def group_allreduce_s(self, nbytes: float, ranks_per_node: list[int]) -> float:
        """An all-reduce of a group with ``ranks_per_node[i]`` members on its i-th node.
        ``flat``: :meth:`allreduce_s` (a ring on the slowest link spanned). ``nccl``: within one
        node, :func:`~cloudburst.comm.costs.best_allreduce_s` on the intra-node link; across
        nodes, the cheaper of that flat choice on the NIC and
        :func:`~cloudburst.comm.costs.hierarchical_allreduce_s`."""
        n, nodes = sum(ranks_per_node), len(ranks_per_node)
        if not self.nccl:
            return self.allreduce_s(nbytes, n, nodes > 1)
        link = self._emulator(nodes > 1).spec
        flat = (
            0.0
            if link is None
            else best_allreduce_s(nbytes, n, link.latency_s, link.bytes_per_s)[0]
        )
        if nodes == 1 or max(ranks_per_node) == 1:
            return flat
        hier = hierarchical_allreduce_s(
            nbytes, nodes, max(ranks_per_node), self.intra.spec, self.inter.spec
        )
        return min(flat, hier)

    def ddp_end_s(
        self, step_s: float, nbytes: float, ranks_per_node: list[int], link_free_s: float = 0.0
    ) -> float:
        """When DDP's overlapped gradient all-reduce of a step of ``step_s`` ends, from the
        step's start: :func:`~cloudburst.comm.costs.ddp_overlap_end_s` with forward = step/3,
        backward = 2·step/3 (device_emulation's FORWARD_SHARE) and each bucket costing
        :meth:`group_allreduce_s`."""
        from cloudburst.comm.device_emulation import FORWARD_SHARE

        forward = step_s * FORWARD_SHARE
        return ddp_overlap_end_s(
            forward,
            step_s - forward,
            nbytes,
            lambda b: self.group_allreduce_s(b, ranks_per_node),
            link_free_s=link_free_s,
        )

    def all_to_all_s(self, sent_bytes: float, group_size: int, spans_nodes: bool) -> float:
        """An all-to-all of n ranks whose busiest rank sends ``sent_bytes`` (already
        :meth:`wire_bytes`): (n−1) latencies + those bytes / bandwidth
        (:func:`cloudburst.comm.collectives.all_to_all_s`)."""
        from cloudburst.comm.collectives import all_to_all_s

        return all_to_all_s(self._emulator(spans_nodes), sent_bytes, group_size)

    def broadcast_s(self, nbytes: float, group_size: int, spans_nodes: bool) -> float:
        """A broadcast to n ranks: ceil(log2 n) latencies + bytes / bandwidth."""
        return self._emulator(spans_nodes).broadcast_s(nbytes, group_size)

    def apply_s(self, nbytes: float) -> float:
        """A server shard applying an update of ``nbytes`` (already :meth:`wire_bytes`)."""
        return nbytes / self.apply_bytes_per_s

    # ------------------------------------------------------------------ report
    def describe(self) -> dict[str, Any]:
        """The clock model for ``summary.json``'s ``"clock_model"``."""
        stand_in = self.sim.stand_in
        return {
            "time_unit": "virtual seconds",
            "step_time_s": self.step_time_s,
            "step_time_source": self.step_time_source,
            "step_time_jitter": self.sim.step_time_jitter,
            "inter_node_link": _describe_link(self.inter),
            "intra_node_link": _describe_link(self.intra),
            "link_model": "ring all-reduce, log2 broadcast, latency + bytes/bandwidth "
            "(cloudburst.comm.link.LinkEmulator); no link given: free",
            "network_model": self.sim.network_model,
            "nic_ingress_gbit_per_s": self.sim.nic_ingress_gbit_per_s,
            "server_apply_gbyte_per_s": self.sim.server_apply_gbyte_per_s,
            "actual_params": self.actual_params,
            "modelled_params": self.sim.stand_in_params,
            "wire_scale": self.wire_scale,
            "profile": None
            if stand_in is None
            else {
                "name": stand_in.name,
                "params": stand_in.params,
                "samples_per_s": stand_in.samples_per_s,
                "published_batch_size": stand_in.batch_size,
                "device": stand_in.device,
                "source": stand_in.source,
            },
            "not_modelled": list(NOT_MODELLED),
            "settings": self.sim.to_dict(),
        }


def resolve_step_time(
    sim: SimulationConfig, cfg: RunConfig, calibrate_fn: Callable[[RunConfig], float]
) -> tuple[float, str]:
    """(seconds per step, source): a flag, then ``--calibrate``, then the profile, then the
    run's ``--min-step-time-s`` if > 0, else ``calibrate_fn(cfg)``."""
    if sim.step_time_s is not None:
        return float(sim.step_time_s), "flag"
    if sim.step_time_per_sample_s is not None:
        return sim.step_time_per_sample_s * cfg.training.batch_size, "flag"
    if sim.modelled_step_time_s is not None:
        return float(sim.modelled_step_time_s), "flag"
    if sim.calibrate:
        return float(calibrate_fn(cfg)), "calibrated"
    if sim.stand_in is not None:
        return sim.stand_in.step_time_s(cfg.training.batch_size), "profile"
    if cfg.cluster.min_step_time_s > 0:
        return float(cfg.cluster.min_step_time_s), "min_step_time"
    return float(calibrate_fn(cfg)), "calibrated"


def is_payload(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries the model's values (scaled by the stand-in model) rather than
    control data: floating point (fp32, bf16), or bytes (uint8/int8: compressed payloads,
    :func:`cloudburst.comm.quantise.encode`). Headers are int64 (``cloudburst.comm.messages``), as
    is every other piece of control data the ranks send."""
    return tensor.is_floating_point() or tensor.dtype in (torch.uint8, torch.int8)
