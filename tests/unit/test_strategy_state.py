"""``state_dict`` → ``load_state_dict`` into a fresh strategy of the same config restores it
exactly; another compression's or fragment count's checkpoint is handled as meant: sync, local_sgd
and diloco (θ_global, per-fragment outer optimizers and last outer steps, which decide finish())."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from cloudburst.comm.allreduce import compressed_hook, new_powersgd_state
from cloudburst.comm.compress import POWERSGD_START, Compression
from cloudburst.config import ConfigError, RunConfig
from cloudburst.strategies.diloco import DilocoStrategy
from cloudburst.strategies.local_sgd import LocalSgdStrategy
from cloudburst.strategies.sync import SyncStrategy
from tests import reference as ref
from tests.support import BATCH, FakeNamespace, ThreadComm, ThreadGroup, same_state, survivor_cfg


def _ctx(cfg: RunConfig, worker: int, comm=None) -> SimpleNamespace:
    """Worker ``worker``'s context; its transport ``comm``, by default a group of one."""
    comm = ThreadComm(ThreadGroup(1), 0) if comm is None else comm
    return FakeNamespace(cfg=cfg, worker_index=worker, workers_group=None, topology=None,
                         worker_ranks=list(range(cfg.job.workers)), link=None, comm=comm,
                         device=torch.device("cpu"))  # fmt: skip


def _vec(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- sync
class _DdpSetup:
    """A transport that sets the compressing hook's state up at wrap time as DDP's, recording
    what its wrapper was given and its calls."""

    def __init__(self):
        self.calls: list = []

    def data_parallel(self, model, group, device, state):
        compressed_hook(state)
        self.calls.append((group, device, state))
        return SimpleNamespace(module=model, after_backward=lambda: self.calls.append("after"))


def _sync(compress: str) -> SyncStrategy:
    strategy = SyncStrategy(_ctx(survivor_cfg("sync", 2, compress=compress), 0, _DdpSetup()))
    model = ref.tiny_model()
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return strategy


def _saved(strategy) -> dict:
    """``state_dict()`` as a checkpoint file gives it back (no tensor shared with the worker)."""
    return copy.deepcopy(strategy.state_dict())


METHODS = ["none", "bf16", "int8", "powersgd:2"]


def _filled(method: str) -> SyncStrategy:
    """A sync worker after 7 steps: int8 residuals of two keys, or PowerSGD's state (iteration,
    bucket 0's residual, warm-start P and Q)."""
    strategy = _sync(method)
    strategy.local_steps = 7
    if strategy.hook_state.feedback is not None:
        strategy.hook_state.feedback.remember("0", _vec(40, 0), _vec(40, 1))
        strategy.hook_state.feedback.remember("0:owner", _vec(40, 1), _vec(40, 0))
    if (psgd := strategy.hook_state.powersgd) is not None:
        psgd.iter, psgd.error_dict = 5, {0: _vec(75, 2)}
        psgd.p_memory_dict, psgd.q_memory_dict = {0: _vec(16, 3)}, {0: _vec(10, 4)}
    return strategy


def _compression(strategy: SyncStrategy):
    fb, psgd = strategy.hook_state.feedback, strategy.hook_state.powersgd
    return (None if fb is None else fb.residuals, None if psgd is None else
            (psgd.iter, psgd.error_dict, psgd.p_memory_dict, psgd.q_memory_dict))  # fmt: skip


@pytest.mark.parametrize("workers", [2, 1])
def test_sync_averages_over_its_workers_group_charged_to_the_link_across_nodes(workers):
    """Sync's gradient average runs over the workers' group on the rank's device, its hook
    charged to the link when those workers span nodes; every step is counted, and a run of one
    worker is not wrapped (nothing to average, nothing to do after backward)."""
    ctx = _ctx(survivor_cfg("sync", workers), 0, comm := _DdpSetup())
    ctx.workers_group, ctx.device, ctx.link = "workers", "device", "link"
    ctx.topology = SimpleNamespace(spans_nodes=lambda ranks: ranks == [0, 1])
    strategy, model = SyncStrategy(ctx), ref.tiny_model()
    assert strategy.wrap(model, None) is model
    strategy.after_backward()
    for _ in range(3):
        strategy.after_step(8)
    state = strategy.hook_state
    assert (state.group, state.spans_nodes, state.link) == ("workers", workers == 2, "link")
    assert comm.calls == ([("workers", "device", state), "after"] if workers == 2 else [])
    assert strategy.local_steps == strategy.state_dict()["local_steps"] == 3


@pytest.mark.parametrize("source", METHODS)
@pytest.mark.parametrize("target", METHODS)
def test_sync_compression_state_round_trips_and_another_methods_leaves_it_fresh(source, target):
    """A checkpoint restores the steps, and its compression state only into a worker of the same
    --compress (int8 residuals, PowerSGD's state); another's leaves it as a fresh one has it."""
    state = _saved(_filled(source))
    assert ("compress_feedback" in state) == (source == "int8")
    assert ("compress_powersgd" in state) == (source == "powersgd:2")
    if source == "int8":
        assert torch.equal(state["compress_feedback"]["0"], _vec(40, 0) - _vec(40, 1))
    if source == "powersgd:2":
        assert state["compress_powersgd"]["iter"] == 5
        assert torch.equal(state["compress_powersgd"]["error_dict"][0], _vec(75, 2))
    worker = _sync(target)
    worker.load_state_dict(state)
    assert worker.local_steps == 7
    expected = _filled(target) if source == target else _sync(target)
    assert same_state(_compression(worker), _compression(expected))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("powersgd", (1, POWERSGD_START)),
        ("powersgd:4", (4, POWERSGD_START)),
        ("powersgd:2:200", (2, 200)),
        ("powersgd:2:1", "start must be an integer in 2.."),
        ("powersgd:2:", "start must be an integer in 2.."),
        ("powersgd:2:x", "start must be an integer in 2.."),
        ("powersgd:0:100", "rank must be an integer in 1.."),
        ("int8:2:100", "only powersgd takes arguments"),
    ],
)
def test_powersgds_rank_and_start_reach_its_state_and_a_bad_one_is_one_config_line(spec, expected):
    """``--compress powersgd:RANK:START`` reaches PyTorch's PowerSGDState (START: its warm-up)."""
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=f"^compress: '{spec}': .*{expected}") as err:
            RunConfig(strategy="sync", workers=2, compress=spec)
        assert "\n" not in str(err.value)
        return
    assert Compression.parse(spec) == Compression("powersgd", *expected)
    state = new_powersgd_state(None, spec)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == expected
    assert state.use_error_feedback and state.warm_start


# ---------------------------------------------------------------------------- local_sgd
class _LocalJob:
    """W local SGD workers on threads of one :class:`ThreadComm` group, replicas from ``seed``."""

    def __init__(self, cfg: RunConfig, seed: int):
        group = ThreadGroup(cfg.job.workers)
        self.replicas = ref.Replicas(cfg.job.workers, ref.sgd(), seed=seed)
        self.strategies = []
        for w in range(cfg.job.workers):
            self.strategies.append(LocalSgdStrategy(_ctx(cfg, w, ThreadComm(group, w))))
            self.strategies[w].wrap(self.replicas.models[w], self.replicas.optimizers[w])

    def train(self, steps: range) -> None:
        def worker(w: int) -> None:
            for step in steps:
                self.replicas.step(w, step)
                self.strategies[w].after_step(BATCH)

        with ThreadPoolExecutor(len(self.strategies)) as pool:
            list(pool.map(worker, range(len(self.strategies))))

    def flats(self) -> list[torch.Tensor]:
        return [ref.flat(m) for m in self.replicas.models]


def test_local_sgd_int8_reference_and_residuals_round_trip_and_the_run_continues_alike():
    cfg = survivor_cfg("local_sgd", 2, period=3, compress="int8")
    job = _LocalJob(cfg, seed=0)
    job.train(range(1, 4))  # the average after step 3: the replicas start again from it
    averaged = job.flats()
    assert torch.equal(averaged[0], averaged[1])
    job.train(range(4, 6))  # and drift away from it
    saved = [_saved(s) for s in job.strategies]
    for state in saved:
        assert state["averages"] == 1 and torch.equal(state["compress_reference"], averaged[0])
        assert set(state["compress_feedback"]) == {"theta"}
        assert state["compress_feedback"]["theta"].abs().sum() > 0

    twin = _LocalJob(cfg, seed=3)  # other initial θ: another reference until loaded
    for w, (strategy, state) in enumerate(zip(twin.strategies, saved, strict=True)):
        assert not torch.equal(strategy._reference, averaged[0])
        ref.set_flat(twin.replicas.models[w], job.flats()[w])
        twin.replicas.optimizers[w].load_state_dict(
            copy.deepcopy(job.replicas.optimizers[w].state_dict())
        )
        strategy.load_state_dict(copy.deepcopy(state))
        assert strategy.local_steps == 5 and strategy.averages == 1
        assert torch.equal(strategy._reference, averaged[0])
        residual = strategy.feedback.residuals["theta"]
        assert torch.equal(residual, state["compress_feedback"]["theta"])
    job.train(range(6, 10))
    twin.train(range(6, 10))
    for mine, theirs in zip(job.flats(), twin.flats(), strict=True):
        assert torch.equal(mine, theirs)


def _local_sgd(compress: str, seed: int = 0) -> LocalSgdStrategy:
    cfg = survivor_cfg("local_sgd", 1, period=3, compress=compress)
    strategy = LocalSgdStrategy(_ctx(cfg, 0))
    model = ref.tiny_model(seed)
    strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return strategy


def test_local_sgd_loads_a_checkpoint_of_another_compression_keeping_its_own_reference():
    compressed = _local_sgd("int8", seed=1)
    compressed.feedback.remember("theta", _vec(75, 0), _vec(75, 1))
    compressed._reference.copy_(_vec(75, 2))
    compressed.local_steps, compressed.averages = 6, 2
    state = _saved(compressed)
    assert torch.equal(state["compress_reference"], _vec(75, 2))
    # into an uncompressed worker: the steps and averages, no reference made up
    plain = _local_sgd("none")
    plain.load_state_dict(state)
    assert (plain.local_steps, plain.averages, plain._reference) == (6, 2, None)
    # an uncompressed checkpoint into a compressed worker: its reference stays the replica's
    # θ at wrap time (on a resume, the checkpoint's model), no residuals
    plain.local_steps, plain.averages = 4, 1
    state = _saved(plain)
    assert not any(k.startswith("compress_") for k in state)
    fresh = _local_sgd("int8", seed=5)
    fresh.load_state_dict(state)
    assert (fresh.local_steps, fresh.averages) == (4, 1)
    assert torch.equal(fresh._reference, ref.flat(ref.tiny_model(5)))
    assert fresh.feedback.residuals == {}


# ---------------------------------------------------------------------------- diloco
def _diloco(seed: int = 0, **kw) -> tuple[DilocoStrategy, ref.Replicas]:
    """One DiLoCo worker (a group of one: its outer step is still real) over a replica."""
    kw = dict(period=4, diloco_outer_lr=0.7, diloco_outer_momentum=0.9) | kw
    replicas = ref.Replicas(1, ref.sgd(), seed=seed)
    strategy = DilocoStrategy(_ctx(survivor_cfg("diloco", 1, **kw), 0))
    strategy.wrap(replicas.models[0], replicas.optimizers[0])
    return strategy, replicas


def _train(strategy: DilocoStrategy, replicas: ref.Replicas, steps: range) -> None:
    for step in steps:
        replicas.step(0, step)
        strategy.after_step(BATCH)


def _replica(replicas: ref.Replicas) -> tuple[torch.Tensor, dict]:
    """What a worker checkpoint holds of the replica: θ and the inner optimizer's state."""
    return ref.flat(replicas.models[0]), copy.deepcopy(replicas.optimizers[0].state_dict())


def _restore(saved: dict, replica: tuple[torch.Tensor, dict], **kw):
    """A worker of another seed given the saved replica (as a resume loads it), then ``saved``."""
    strategy, twin = _diloco(seed=3, **kw)
    ref.set_flat(twin.models[0], replica[0])
    twin.optimizers[0].load_state_dict(copy.deepcopy(replica[1]))
    strategy.load_state_dict(saved)
    return strategy, twin


def test_a_diloco_checkpoint_lists_the_fragments_outer_states_and_fits_only_its_fragments():
    """A list of outer states only with fragments; another fragment count's state is refused."""
    one, replicas = _diloco(fragments=1)
    _train(one, replicas, range(1, 5))
    keys = {"local_steps", "stats", "averages", "global_theta", "outer"}
    assert set(one.state_dict()) == keys
    two, replicas = _diloco(fragments=2)
    _train(two, replicas, range(1, 5))
    state = two.state_dict()
    assert set(state) == keys | {"outer_fragments"} and len(state["outer_fragments"]) == 2
    with pytest.raises(ValueError):
        _diloco(fragments=1)[0].load_state_dict(_saved(two))
    with pytest.raises(ValueError):
        _diloco(fragments=2)[0].load_state_dict(_saved(one))


# Streaming DiLoCo, H = 4, F = 2, τ = 1: fragment 0 applied after steps 3, 7, 11, fragment 1
# after 5, 9, 13 (each started a step before); a checkpoint only with none in flight.
STREAMING = dict(fragments=2, fragment_delay=1)
LAST_OUTER_STEP = {0: [0, 0], 1: [0, 0], 3: [3, 0], 5: [3, 5], 7: [7, 5], 9: [7, 9], 11: [11, 9]}
# With a warm start of 2 steps (both fragments averaged after steps 1 and 2) the schedule
# runs from step 2: fragment 0 applied after 5, 9; fragment 1 after 7, 11.
WARM = {2: [2, 2], 5: [5, 2], 7: [5, 7]}
CASES = [(0, s, last) for s, last in LAST_OUTER_STEP.items()] + [
    (2, s, last) for s, last in WARM.items()
]


@pytest.mark.parametrize("warm,step,last", CASES)
def test_a_diloco_worker_restored_at_any_checkpoint_finishes_as_the_uninterrupted_one(
    warm, step, last
):
    """finish() steps each fragment moved since its last outer step: a restored one knows when."""
    kw = dict(STREAMING, local_sgd_warmup_steps=warm)
    strategy, replicas = _diloco(**kw)
    _train(strategy, replicas, range(1, step + 1))
    assert strategy.checkpoint_ready()
    assert strategy.synced_at == last
    saved = _saved(strategy)
    restored, twin = _restore(saved, _replica(replicas), **kw)
    assert restored.synced_at == last
    strategy.finish()
    restored.finish()
    moved = sum(t != step for t in last)
    assert strategy.averages == restored.averages == saved["averages"] + moved
    assert torch.equal(ref.flat(twin.models[0]), ref.flat(replicas.models[0]))


@pytest.mark.parametrize("kw, saved_at", [(STREAMING, 5), ({}, 9)], ids=["streaming", "one"])
def test_a_diloco_state_dict_is_a_snapshot_the_worker_continues_from(kw, saved_at):
    """Saved with momentum in every outer optimizer, unchanged by further training; a worker
    restored from it ends where the uninterrupted one did."""
    strategy, replicas = _diloco(**kw)
    _train(strategy, replicas, range(1, saved_at + 1))
    saved = strategy.state_dict()
    snapshot, replica = copy.deepcopy(saved), _replica(replicas)
    _train(strategy, replicas, range(saved_at + 1, 14))
    strategy.finish()
    outers = [state.get("outer_fragments", [state["outer"]]) for state in (saved, snapshot)]
    for now, then in zip(*outers, strict=True):
        assert torch.equal(now["state"][0]["momentum_buffer"], then["state"][0]["momentum_buffer"])
    assert torch.equal(saved["global_theta"], snapshot["global_theta"])
    restored, twin = _restore(saved, replica, **kw)
    assert (restored.local_steps, restored.averages) == (saved_at, saved["averages"])
    _train(restored, twin, range(saved_at + 1, 14))
    restored.finish()
    assert restored.averages == strategy.averages
    assert torch.equal(ref.flat(twin.models[0]), ref.flat(replicas.models[0]))
