"""The parameter-server strategies, run for real over a fake comm in a scripted step order, match
``tests/reference.py`` bit for bit; the references match hand values and each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cloudburst.comm.flat import flatten_params
from cloudburst.config import RunConfig
from cloudburst.strategies.asgd.shard import ShardState
from tests import reference as ref
from tests.support import flush, ps_job, references_cfg, same_state

BATCH = 8


def play(cfg: RunConfig, script: list[int]) -> ref.PsRun:
    """``cfg``'s strategy over the fake network in ``script`` order, recorded as a
    :class:`tests.reference.PsRun` (ending, as ``finish`` starts, with each worker's flush)."""
    replicas = ref.Replicas(cfg.job.workers, ref.sgd())
    job = ps_job(cfg, replicas.models)
    for worker in job.workers:
        worker.start()
    run = ref.PsRun([], [], [[] for _ in job.workers])
    steps = [0] * cfg.job.workers

    def record_push(w: int, pushes_before: int) -> None:
        worker = job.workers[w]
        if worker.pushes > pushes_before:  # one reply per shard, all with the same staleness
            assert worker.pushes == pushes_before + cfg.job.servers
            run.pushes.append((w, worker.last_staleness))
            run.server.append(job.server_theta.clone())

    for w in script:
        steps[w] += 1
        replicas.step(w, steps[w])
        before = job.workers[w].pushes
        job.workers[w].after_step(BATCH)
        record_push(w, before)
        run.replicas[w].append(flatten_params(replicas.models[w]))
    for w, worker in enumerate(job.workers):
        before = worker.pushes
        flush(worker)
        record_push(w, before)
    run.final = [flatten_params(m) for m in replicas.models]
    for loop in job.loops:  # the shards agree on the order: same version everywhere
        assert loop.shard.version == len(run.pushes)
    return run


def assert_same_run(actual: ref.PsRun, expected: ref.PsRun) -> None:
    """The same pushes and, bit for bit, server θ after each, replicas after each step, final θ."""
    assert actual.pushes == expected.pushes
    for part in ("server", "replicas", "final"):
        assert same_state(getattr(actual, part), getattr(expected, part)), part


# ---------------------------------------------------------------------------- the references
def test_reference_module_imports_nothing_from_cloudburst_but_the_parity_runs_input():
    """No strategy, server, comm or model code: only the parity runs' input (the synthetic
    split, in ``streams``) and a run's saved model (``trained``) come from cloudburst."""
    tree = ast.parse(Path(ref.__file__).read_text())
    imported = {}  # module: the top-level definition importing it ("" at module level)
    for top in tree.body:
        for node in ast.walk(top):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported.update({name: getattr(top, "name", "") for name in names})
    assert "torch" in imported
    assert {m: f for m, f in imported.items() if m.split(".")[0] == "cloudburst"} == {
        "cloudburst.data": "streams",
        "cloudburst.records.checkpoint": "trained",
    }


def _set_models(values: list[float]) -> list[torch.nn.Module]:
    """One tiny model per value, every parameter set to it."""
    models = [ref.tiny_model() for _ in values]
    for m, v in zip(models, values, strict=True):
        ref.set_flat(m, torch.full((ref.NUMEL,), v))
    return models


def test_gossip_reference_on_hand_values():
    # Ring of 3, no training: 0 pulls 1's θ of the previous step, 1 pulls 2's, 2 pulls 0's
    # θ of this step (0 acted before it).
    models = _set_models([0.0, 4.0, 8.0])
    run = ref.gossip_pull(models, lambda w, s: None, steps=2, peer=lambda i, r: (i + 1) % 3)
    assert [r[0][0].item() for r in run.replicas] == [2.0, 6.0, 5.0]  # (0+4)/2, (4+8)/2, (8+2)/2
    assert [r[1][0].item() for r in run.replicas] == [4.0, 5.5, 4.5]  # (2+6)/2, (6+5)/2, (5+4)/2
    assert run.pulls == [(0, 1, 1), (1, 2, 1), (2, 0, 0)] * 2


def test_easgd_reference_on_hand_values():
    # Centre starts at worker 0's θ = 0; worker 1 is moved to the centre first, then trains
    # to 10 (here: set by its step); α = 0.5, τ = 1.
    models = _set_models([0.0, 0.0])

    def step(worker: int, _: int) -> None:
        ref.set_flat(models[worker], ref.flat(models[worker]) + 10.0 * worker)

    run = ref.easgd(models, step, script=[1, 0, 1], tau=1, alpha=0.5)
    # w1: θ=10, e=5 -> θ1=5, centre 5; w0: θ=0, e=-2.5 -> θ0=2.5, centre 2.5;
    # w1: θ=15, e=6.25 -> θ1=8.75, centre 8.75.
    assert [c[0].item() for c in run.server] == [5.0, 2.5, 8.75]
    assert [r[-1][0].item() for r in run.replicas] == [2.5, 8.75]
    assert run.pushes == [(1, 0), (0, 1), (1, 1)]


def test_local_sgd_with_period_1_equals_large_batch_sgd():
    replicas = ref.Replicas(3, ref.sgd())
    history = ref.local_sgd(replicas.models, replicas.step, steps=5, period=1)
    model = ref.tiny_model()
    expected = ref.large_batch_sgd(model, ref.sgd()(model), workers=3, steps=5)
    for w in range(3):
        for a, b in zip(history[w], expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_diloco_with_outer_lr_1_and_no_momentum_equals_local_sgd():
    a, b = ref.Replicas(2, ref.adamw()), ref.Replicas(2, ref.adamw())
    local = ref.local_sgd(a.models, a.step, steps=7, period=3)
    outer = ref.diloco(b.models, b.step, steps=7, period=3, outer_lr=1.0, outer_momentum=0.0)
    for x, y in zip(local[0], outer[0], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_diloco_reference_nesterov_first_outer_step_is_1_plus_mu_times_the_average():
    # No training: the pseudo-gradient is 0; move the replicas by hand instead.
    models = _set_models([1.0, 1.0])

    def step(worker: int, _: int) -> None:
        ref.set_flat(models[worker], ref.flat(models[worker]) - (worker + 1))  # -1, -2

    history = ref.diloco(models, step, steps=1, period=1, outer_lr=0.5, outer_momentum=0.9)
    # g = 1 - mean(0, -1) = 1.5; Nesterov: d = g + 0.9 g = 2.85; θ = 1 - 0.5 · 2.85
    assert history[0][0][0].item() == pytest.approx(1 - 0.5 * 2.85)


# ---------------------------------------------------------------------------- asgd
# Scripts: whose local step comes next. Staleness worked out by hand (n_sync = 2).
SCRIPT_2 = [0, 1, 1, 0, 0, 0, 1, 1, 1]  # pushes: w1 w0 w0 w1, then w1's flush
STALENESS_2 = [(1, 0), (0, 1), (0, 0), (1, 2), (1, 0)]
SCRIPT_3 = [0, 0, 1, 0, 0, 2, 2, 1, 1, 1, 2, 0, 2]  # w0 w0 w2 w1 w1 w2, then w0's flush
STALENESS_3 = [(0, 0), (0, 0), (2, 2), (1, 3), (1, 0), (2, 2), (0, 4)]


@pytest.mark.parametrize(
    "workers, servers, script, pushes",
    [(2, 1, SCRIPT_2, STALENESS_2), (3, 2, SCRIPT_3, STALENESS_3)],
)
@pytest.mark.parametrize("lam", ["default", "1/W", 1.0])  # λ's default is 1/W
def test_asgd_scripted_pushes_match_the_parameter_server_reference(
    workers, servers, script, pushes, lam
):
    value = 1.0 if lam == 1.0 else 1.0 / workers
    lr = {} if lam == "default" else {"server_lr": value}
    replicas = ref.Replicas(workers, ref.sgd())
    expected = ref.asgd(replicas.models, replicas.step, script, n_sync=2, lam=value)
    assert expected.pushes == pushes  # the reference agrees with the hand count
    cfg = references_cfg(strategy="asgd", workers=workers, servers=servers, n_sync=2, **lr)
    assert_same_run(play(cfg, script), expected)


SHARD_ORDER = [
    (0, "fetch"),
    (1, "fetch"),
    (2, "fetch"),
    (0, "push"),  # base 0 at version 0: staleness 0
    (1, "push"),  # base 0 at 1: 1
    (0, "fetch"),
    (2, "push"),  # base 0 at 2: 2
    (1, "fetch"),
    (0, "push"),  # base 2 at 3: 1
    (1, "push"),  # base 3 at 4: 1
    (2, "fetch"),
    (2, "push"),  # base 5 at 5: 0
]  # with two workers (worker 2's entries left out): 0, 1, 0, 1


@pytest.mark.parametrize("workers, staleness", [(2, [0, 1, 0, 1]), (3, [0, 1, 2, 1, 1, 0])])
@pytest.mark.parametrize("lam", ["1/W", 1.0])
def test_shard_maths_matches_the_parameter_server_reference(workers, staleness, lam):
    # Two shards of one θ against the unsharded reference: random Δ in a scripted order of
    # fetches and pushes (each worker pushes against the version it last fetched).
    lam = 1.0 / workers if lam == "1/W" else lam
    g = torch.Generator().manual_seed(workers)
    theta = torch.randn(101, generator=g)
    server = ref.Server(theta, lr=lam)
    shards = [ShardState(theta[:51], lr=lam), ShardState(theta[51:], lr=lam)]
    base = {}
    for w, action in [(w, a) for w, a in SHARD_ORDER if w < workers]:
        if action == "fetch":
            base[w] = server.version
            continue
        delta = torch.randn(101, generator=g)
        expected = server.push(delta, base[w])
        results = [s.apply_push(d, base[w]) for s, d in zip(shards, delta.split(51), strict=True)]
        assert [r.staleness for r in results] == [expected, expected]
        assert all(s.version == server.version for s in shards)
        assert torch.equal(torch.cat([s.theta for s in shards]), server.theta)
    assert server.staleness == staleness


# ---------------------------------------------------------------------------- easgd
SCRIPT_EASGD = [0, 0, 0, 1, 1, 2, 2, 2, 1, 0, 0, 0, 2, 1, 1, 1, 2, 2, 0]
# τ = 3: exchanges w0 w2 w1 w0 w1 w2, then w0's flush (7 steps); staleness: the exchanges by
# others since this worker's previous one.
STALENESS_EASGD = [(0, 0), (2, 1), (1, 2), (0, 2), (1, 1), (2, 3), (0, 2)]


def test_easgd_scripted_exchanges_match_the_reference_with_default_alpha():
    workers = 3
    replicas = ref.Replicas(workers, ref.sgd())
    expected = ref.easgd(replicas.models, replicas.step, SCRIPT_EASGD, tau=3, alpha=0.9 / workers)
    assert expected.pushes == STALENESS_EASGD
    cfg = references_cfg(strategy="easgd", workers=workers, servers=2, easgd_tau=3)
    assert_same_run(play(cfg, SCRIPT_EASGD), expected)
