"""Compressed point-to-point messages (issue 17: asgd / easgd pushes and fetches, gossip): the
format's bytes, round trip and edges, untrusted bytes, the server applying exactly the Δ the
worker kept, and compressed runs on the virtual cluster. Gossip: tests/unit/test_gossip_maths.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.compress import (
    BLOCK,
    decode,
    encode,
    packed_bytes,
    payload_bytes,
    quantise,
    round_trip,
    wire_bytes_per_value,
)
from cloudburst.comm.flat import flatten_params
from cloudburst.comm.messages import TAG_REQUEST, TAG_REQUEST_PAYLOAD, Header, Kind, Status
from cloudburst.comm.p2p import PeerTransport
from cloudburst.comm.stats import CommStats
from cloudburst.comm.transport import REAL
from cloudburst.config import RunConfig
from cloudburst.sim.clock import is_payload
from cloudburst.strategies import strategy_spec
from cloudburst.strategies.asgd import AsgdStrategy
from cloudburst.strategies.asgd.server import ServerLoop
from tests.reference import trained
from tests.support import FakeNamespace, RecordingMetrics, run_sim, sim_cfg

METHODS = ["bf16", "int8", "fp8"]


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.linspace(0.01, 3.0, n)


# ---------------------------------------------------------------------------- the format
@pytest.mark.parametrize("method", ["none", *METHODS])
@pytest.mark.parametrize("numel", [0, 1, 3, 255, 256, 257, 1000])
def test_a_message_is_its_formats_bytes_and_decodes_to_the_round_trip(method, numel):
    """fp32 4 bytes a value, bf16 2; int8 and fp8 the codes padded to whole blocks and a 4-byte
    scale a block (1 + 4/256 a value: docs/algorithms.md#compression). A payload one byte short
    is refused; an empty one is no bytes and decodes to an empty fp32 vector."""
    blocks = -(-numel // BLOCK)
    expected = {"none": 4 * numel, "bf16": 2 * numel}.get(method, blocks * (BLOCK + 4))
    assert payload_bytes(numel, method) == expected
    assert wire_bytes_per_value(method) == {"none": 4.0, "bf16": 2.0}.get(method, 1.015625)
    if method == "none":
        return
    x = _vector(numel)
    packet = encode(x, method)
    assert packet.dtype == torch.uint8 and packet.numel() == expected
    out = decode(packet, numel, method)
    assert out.dtype == torch.float32 and torch.equal(out, round_trip(x, method))
    if numel:
        with pytest.raises(ValueError, match="bytes"):
            decode(packet[:-1], numel, method)
    if method != "bf16":
        assert packed_bytes(numel, method) == blocks * (BLOCK + 4)
        codes, scales = quantise(x, method)
        assert codes.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
        assert (codes.numel(), scales.numel()) == (blocks * BLOCK, blocks)


@pytest.mark.parametrize("numel", [0, 3])
def test_powersgd_has_no_point_to_point_payload(numel):
    with pytest.raises(ValueError, match="no point-to-point payload"):
        payload_bytes(numel, "powersgd")


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(
    "value, scale",
    [(math.nan, None), (math.inf, None), (-math.inf, None)]
    + [(None, scale) for scale in (math.nan, math.inf, 0.0, -1.0)],
)
def test_a_block_with_a_value_or_scale_not_finite_and_positive_decodes_to_nan(method, value, scale):
    """A value not finite in the second of three blocks, or that block's scale not finite and
    positive: the block arrives NaN (as it would uncompressed), the others as their round trip."""
    clean = _vector(600)
    x = clean.clone()
    if value is not None:
        x[BLOCK + 3] = value
    packet = encode(x, method)
    if scale is not None:
        packet[3 * BLOCK :].view(torch.float32)[1] = scale
    values, expected = decode(packet, 600, method), round_trip(clean, method)
    assert bool(values[BLOCK : 2 * BLOCK].isnan().all())
    assert torch.equal(values[:BLOCK], expected[:BLOCK])
    assert torch.equal(values[2 * BLOCK :], expected[2 * BLOCK :])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_block_of_denormal_values_arrives_finite(method):
    # Its absmax / 127 (or / 448) underflows to 0 in fp32; a 0 scale decodes to NaN.
    x = torch.cat([torch.full((BLOCK,), 1e-44), torch.linspace(-1.0, 1.0, BLOCK)])
    out = decode(encode(x, method), x.numel(), method)
    assert bool(torch.isfinite(out).all())
    assert bool((out[:BLOCK].abs() <= 1e-38).all())  # within one rounding of the tiny scale


@pytest.mark.parametrize("method", ["bf16", "none", "int4"])
def test_quantising_to_a_method_without_codes_is_refused_by_name(method):
    with pytest.raises(ValueError, match=rf"^not a quantised method: '{method}'$"):
        quantise(torch.ones(3), method)


def test_message_compression_is_for_the_message_strategies():
    method = {
        name: strategy_spec(name).message_method for name in ("asgd", "gossip", "sync", "easgd")
    }
    assert method["asgd"]("int8") == "int8" and method["gossip"]("bf16") == "bf16"
    assert method["sync"]("int8") == "none" and method["easgd"]("none") == "none"
    # Compressed EASGD sends the elastic difference: its shards add what they receive.
    assert RunConfig(strategy="easgd", workers=2, compress="int8").shard_rule == ("add", 1.0)


# ---------------------------------------------------------------------------- hostile input
NUMEL = 6


class _Wire:
    """gloo, faked for one PeerTransport: queued messages fill the front of the buffer they are
    received into (a shorter one leaves the rest as it was); sends (done at once) are recorded."""

    def __init__(self, transport: PeerTransport, messages: list[tuple[int, torch.Tensor]]):
        self.messages, self.sent = list(messages), []
        transport._recv = self.recv
        transport._send = lambda tensor, dst, tag: self.sent.append((dst, tag, tensor.clone()))
        transport._isend = self.isend

    def isend(self, tensor, dst, tag):
        self.sent.append((dst, tag, tensor.clone()))
        return SimpleNamespace(wait=lambda: True, is_completed=lambda: True)

    def recv(self, tensor, src, tag):
        want, message = self.messages.pop(0)
        assert want == tag, f"received on tag {tag}, the script has {want} next"
        assert message.numel() <= tensor.numel(), "a payload longer than its buffer was read"
        tensor.view(-1)[: message.numel()].copy_(message.view(-1).view(tensor.dtype))
        return 1


def test_a_compressed_push_cut_short_or_with_a_bad_scale_is_rejected_and_a_good_one_applied():
    transport = PeerTransport(compress="int8")
    good = encode(torch.full((NUMEL,), 0.5), "int8")
    nan_scale = good.clone()
    nan_scale[256:].view(torch.float32)[0] = math.inf
    push = Header(Kind.PUSH, numel=NUMEL).to_tensor()
    payloads = (good[:100], nan_scale, good)  # short, a non-finite scale, good
    script = [m for p in payloads for m in ((TAG_REQUEST, push), (TAG_REQUEST_PAYLOAD, p))]
    wire = _Wire(transport, script)
    cfg = RunConfig(strategy="asgd", workers=1, servers=1, dataset="synthetic", server_lr=1.0,
                    compress="int8")  # fmt: skip
    ctx = FakeNamespace(comm=REAL, cfg=cfg, rank=0, server_index=0, worker_ranks=[1],
                        elapsed_s=lambda: 0.0, transport=lambda *a, **kw: transport)  # fmt: skip
    loop = ServerLoop(ctx, torch.zeros(NUMEL), RecordingMetrics(), liveness=None)
    statuses = []
    for _ in range(3):
        src, header = transport.recv_request_any()
        loop._serve_one(transport, src, header)
        statuses.append(int(wire.sent[-1][2][6]))  # the reply header's status
    assert statuses == [Status.REJECTED, Status.REJECTED, Status.OK]
    assert loop.shard.rejected_nonfinite == 2 and loop.shard.version == 1
    assert torch.equal(loop.shard.theta, torch.full((NUMEL,), 0.5))
    # Bytes received: three headers and three payloads of the size θ implies (not the header).
    assert transport.stats.received_bytes == 3 * 64 + 3 * payload_bytes(NUMEL, "int8")


def test_a_compressed_transport_counts_what_it_sends_and_refuses_a_packet_of_the_wrong_size():
    counted = PeerTransport(compress="bf16", stats=CommStats())
    _Wire(counted, [])
    counted.send(0, Header(Kind.PUSH, numel=NUMEL), torch.ones(NUMEL))
    assert counted.stats.sent_bytes == 64 + 2 * NUMEL
    transport = PeerTransport(compress="int8")
    _Wire(transport, [])
    with pytest.raises(ValueError, match="int8 bytes"):
        transport.send(0, Header(Kind.PUSH, numel=NUMEL), encode(torch.ones(NUMEL + 300), "int8"))
    with pytest.raises(ValueError, match="cannot be sent as"):
        PeerTransport(compress="powersgd")


# ---------------------------------------------------------------------------- asgd, easgd
@pytest.mark.parametrize(
    ("strategy", "lr", "extra"),
    [("asgd", 0.5, {"server_lr": 0.5, "n_push": 2}), ("easgd", 1.0, {"easgd_tau": 2})],
)
def test_the_server_applies_exactly_the_decompressed_updates_the_worker_kept(
    tmp_path, monkeypatch, strategy, lr, extra
):
    """One worker (staleness 0): the trained model is θ0 plus lr times each Δ the worker kept,
    C⁻¹(C(Δ + e)) (EASGD compressed: the centre adds e, λ = 1)."""
    sent, starts = [], []
    push, start_ = AsgdStrategy._compress_push, AsgdStrategy.start

    def recording(self, delta):
        packets = push(self, delta)
        sent.append(delta.clone())
        return packets

    def start(self):
        starts.append(flatten_params(self.model).clone())
        start_(self)

    monkeypatch.setattr(AsgdStrategy, "_compress_push", recording)
    monkeypatch.setattr(AsgdStrategy, "start", start)
    run_sim(sim_cfg(tmp_path, strategy, 1, 16, servers=1, compress="int8", **extra))
    assert len(sent) == 8 and len(starts) == 1
    expected = starts[0].clone()  # θ0: the worker's initial model is the servers' too
    for delta in sent:
        expected.add_(delta, alpha=lr)
    assert torch.equal(flatten_params(trained(tmp_path)), expected)


def _bytes_and_accuracy(tmp_path, strategy: str, compress: str, **kw) -> tuple[int, float]:
    out = tmp_path / f"{strategy}-{compress}"
    # 40 steps learn to ~0.99 (asgd and EASGD, each compression), far above the floor of 0.5
    summary = run_sim(sim_cfg(out, strategy, 2, 40, servers=1, compress=compress, **kw))
    return summary["sent_bytes"], summary["final_test_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "extra"), [("asgd", {"server_lr": 0.5}), ("easgd", {"easgd_tau": 4})]
)
def test_compressed_asgd_and_easgd_learn_with_about_a_quarter_of_the_bytes(
    tmp_path, strategy, extra
):
    plain_bytes, plain_acc = _bytes_and_accuracy(tmp_path, strategy, "none", **extra)
    int8_bytes, int8_acc = _bytes_and_accuracy(tmp_path, strategy, "int8", **extra)
    assert int8_acc > 0.5 and int8_acc >= plain_acc - 0.05
    # Payloads cost 1 + 4/256 bytes a value instead of 4; headers (64 bytes) are unchanged.
    assert 0.25 < int8_bytes / plain_bytes < 0.27
    bf16_bytes, bf16_acc = _bytes_and_accuracy(tmp_path, strategy, "bf16", **extra)
    assert bf16_acc >= plain_acc - 0.05 and 0.49 < bf16_bytes / plain_bytes < 0.51


# ---------------------------------------------------------------------------- the simulator
def test_simulated_compressed_pushes_cost_a_quarter_of_the_modelled_bytes(tmp_path):
    # the simulator scales payloads, compressed or not, and never headers
    assert is_payload(torch.zeros(3)) and is_payload(torch.zeros(3, dtype=torch.bfloat16))
    assert is_payload(encode(torch.ones(3), "int8"))  # uint8 bytes of a quantised payload
    assert not is_payload(Header(Kind.PUSH).to_tensor())  # int64 control data
    # A slow link and a large stand-in; the shard on its own node, so every message crosses.
    kw = dict(servers=1, nodes=2, shard_placement="own", inter_node_link="0.1,0", n_push=1)
    times = {}
    for method in ("none", "int8"):
        cfg = sim_cfg(tmp_path / method, "asgd", 1, 8, compress=method, **kw)
        times[method] = run_sim(cfg, modelled_params=10**7)["wall_time_s"]
    # 10⁷ fp32 values over 0.1 Gbit/s are 3.2 s a message each way; int8 about 0.8 s.
    assert 0.24 < times["int8"] / times["none"] < 0.3
