"""Independent single-process references of cloudburst's algorithms, in plain PyTorch.

Each reference simulates W workers in one process, in an order the caller scripts, following
ALGORITHMS.md literally; nothing is imported from cloudburst (no strategy, server, comm or
flatten code), so a comparison is between two independent implementations. The references own
the communication only: a ``local_step(worker, step)`` callback (:class:`Replicas` builds one
for the tiny problem below, which the distributed tests also train on) advances one replica by
one optimizer step. Every replica's θ is returned after each of its local steps.

The last section gives what a whole CLI run on the parity problem must end with. The raw
synthetic split is the package's; the rest is computed here from the documented rule: worker
``w`` of ``W`` trains on the contiguous ``w``-th of ``W`` equal shards (remainder unused), each
epoch a permutation of it seeded by ``seed·1000 + w``, the last incomplete batch dropped; the
models (the MNIST-1D paper's MLP and CNN) are built after ``torch.manual_seed(seed)``. ``nan``
names (worker, step) pairs whose loss an injected ``nan:RANK@STEP`` makes NaN: that step is not
applied (the optimizer does not step; the data stream moves on)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import nn

#: ``local_step(worker, step)``: one optimizer step of worker ``worker``'s replica; ``step``
#: counts that worker's local steps from 1.
LocalStep = Callable[[int, int], None]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]

FEATURES, HIDDEN, CLASSES = 5, 8, 3  # the tiny problem
NUMEL = FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES  # 75 parameters


# ---------------------------------------------------------------------------- the problem
def tiny_model(seed: int = 0) -> nn.Module:
    """A 5 → 8 → 3 MLP whose initial θ depends only on ``seed`` (not on the global RNG)."""
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batch(worker: int, step: int, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Worker ``worker``'s mini-batch at its local step ``step``: the same in every process."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 1009 * worker + step)
    x = torch.randn(size, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    return x, y


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y) -> float:
    """One plain training step (the user's loop): cross-entropy, backward, optimizer step."""
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def flat(model: nn.Module) -> torch.Tensor:
    """The parameters as one new vector, in ``model.parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model: nn.Module, vector: torch.Tensor) -> None:
    """Copy ``vector`` into the parameters (in place: optimizers keep their state)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    assert offset == vector.numel(), "vector and model differ in size"


class Replicas:
    """W replicas of :func:`tiny_model` (same initial θ), each with its own optimizer, trained
    on ``batch(worker, step)``; :meth:`step` is the ``local_step`` callback of the references."""

    def __init__(
        self, workers: int, make_optimizer: MakeOptimizer, seed: int = 0, batch_size: int = 8
    ):
        self.models = [tiny_model(seed) for _ in range(workers)]
        self.optimizers = [make_optimizer(m) for m in self.models]
        self.batch_size = batch_size

    def step(self, worker: int, step: int) -> None:
        x, y = batch(worker, step, self.batch_size)
        train_step(self.models[worker], self.optimizers[worker], x, y)


def sgd(lr: float = 0.1, momentum: float = 0.9) -> MakeOptimizer:
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)


def adamw(lr: float = 0.01) -> MakeOptimizer:
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr)


def mean(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(vectors)).sum(0) / len(vectors)


# ---------------------------------------------------------------------------- 1. sync
def large_batch_sgd(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    workers: int,
    steps: int,
    batch_size: int = 8,
) -> list[torch.Tensor]:
    """Synchronous data parallelism's reference: SGD where step s sees the concatenation of
    every worker's batch s. Returns θ after each step."""
    history = []
    for step in range(1, steps + 1):
        batches = [batch(w, step, batch_size) for w in range(workers)]
        train_step(model, optimizer, *(torch.cat(part) for part in zip(*batches, strict=True)))
        history.append(flat(model))
    return history


# ---------------------------------------------------------------------------- 2. asgd
class Server:
    """θ on the parameter servers with its version clock. A push computed against version
    ``base`` has staleness ``version − base`` (``staleness``: of every applied push, in order);
    staler than ``max_staleness`` it is dropped, else applied with the factor
    s = 1/max(1, staleness) when scaling (1 otherwise): add: θ ← θ + λ·s·Δ (λ = ``lr``); sgd /
    adagrad: that torch optimizer steps θ with the gradient −s·Δ. Pushes are applied one at a
    time, in call order."""

    def __init__(self, theta, rule="add", lr=1.0, momentum=0.0, max_staleness=None, scaling=False):
        self.theta = nn.Parameter(theta.clone(), requires_grad=False)
        self.rule, self.lr, self.scaling, self.max_staleness = rule, lr, scaling, max_staleness
        self.version = self.dropped = 0
        self.staleness: list[int] = []
        if rule == "sgd":
            self.opt = torch.optim.SGD([self.theta], lr=lr, momentum=momentum)
        elif rule == "adagrad":
            self.opt = torch.optim.Adagrad([self.theta], lr=lr)

    def fetch(self) -> tuple[torch.Tensor, int]:
        return self.theta.detach().clone(), self.version

    def push(self, delta: torch.Tensor, base: int) -> int | None:
        """Applies (or drops) one push; its staleness, None when dropped."""
        staleness = self.version - base
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.dropped += 1
            return None
        scale = 1.0 / max(1, staleness) if self.scaling else 1.0
        with torch.no_grad():
            if self.rule == "add":
                self.theta.add_(delta, alpha=self.lr * scale)
            else:
                self.theta.grad = delta.mul(-scale)
                self.opt.step()
                self.theta.grad = None
        self.version += 1
        self.staleness.append(staleness)
        return staleness


@dataclass
class PsRun:
    """What a parameter-server reference did: the server's θ after every push, each push as
    (worker, staleness), each worker's θ after each of its local steps (after any push and
    fetch of that step), and each worker's θ at the end (after the final pushes)."""

    server: list[torch.Tensor]
    pushes: list[tuple[int, int]]
    replicas: list[list[torch.Tensor]]
    final: list[torch.Tensor] = field(default_factory=list)


def _scripted(models, local_step, script, every: int, sync, flush: bool, run: PsRun) -> PsRun:
    """Worker ``w``'s local steps in ``script`` order, each followed by ``sync(w, False)`` after
    every ``every``-th of them and recorded in ``run.replicas``; with ``flush``, each worker
    with steps since its last sync calls ``sync(w, True)`` at the end, in worker order."""
    steps = [0] * len(models)
    for w in script:
        steps[w] += 1
        local_step(w, steps[w])
        if steps[w] % every == 0:
            sync(w, False)
        run.replicas[w].append(flat(models[w]))
    if flush:
        for w in range(len(models)):
            if steps[w] % every:
                sync(w, True)
    run.final = [flat(m) for m in models]
    return run


def asgd(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    script: Sequence[int],
    n_sync: int,
    lam: float,
    flush: bool = True,
) -> PsRun:
    """Asynchronous SGD with one parameter server (GPU A-SGD: n_fetch = n_push = n_sync).

    The server starts from worker 0's θ; every worker first fetches it. ``script`` lists whose
    local step comes next (one entry per step). After every n_sync-th local step the worker
    pushes Δ = θ_local − θ_at_last_fetch and fetches θ (which now includes its own push). With
    ``flush``, each worker that has unpushed steps at the end pushes them (no fetch), in
    worker order."""
    server = Server(flat(models[0]), lr=lam)
    theta, v = server.fetch()
    for m in models:
        set_flat(m, theta)
    base, version = [theta] * len(models), [v] * len(models)
    run = PsRun([], [], [[] for _ in models])

    def push(w: int, last: bool) -> None:
        local = flat(models[w])
        run.pushes.append((w, server.push(local - base[w], version[w])))
        run.server.append(server.fetch()[0])
        base[w] = local
        if not last:
            base[w], version[w] = server.fetch()
            set_flat(models[w], base[w])

    return _scripted(models, local_step, script, n_sync, push, flush, run)


# ---------------------------------------------------------------------------- 4. easgd
def easgd(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    script: Sequence[int],
    tau: int,
    alpha: float,
    flush: bool = True,
) -> PsRun:
    """Elastic averaging SGD: a centre θ̃ (worker 0's initial θ), which every replica starts
    from; after every τ-th local step worker i computes e = α(θ_i − θ̃), sets θ_i ← θ_i − e
    and θ̃ ← θ̃ + e, atomically (the exchanges are applied in script order). ``pushes`` lists
    (worker, number of exchanges by others since this worker's previous one). With ``flush``,
    a worker with steps since its last exchange makes one more at the end, in worker order."""
    centre = flat(models[0]).clone()
    for m in models:
        set_flat(m, centre)
    exchanges = 0
    seen = [0] * len(models)
    run = PsRun([], [], [[] for _ in models])

    def exchange(w: int, last: bool) -> None:
        nonlocal centre, exchanges
        theta = flat(models[w])
        e = alpha * (theta - centre)
        set_flat(models[w], theta - e)
        centre = centre + e
        run.pushes.append((w, exchanges - seen[w]))
        run.server.append(centre.clone())
        exchanges += 1
        seen[w] = exchanges

    return _scripted(models, local_step, script, tau, exchange, flush, run)


# ---------------------------------------------------------------------------- 5. local SGD
#: ``reduce(vectors)``: the sum of the workers' vectors as a (compressed) all-reduce delivers it.
Reduce = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def local_sgd(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    steps: int,
    period: int,
    reduce: Reduce | None = None,
    warmup_steps: int = 0,
) -> list[list[torch.Tensor]]:
    """Local SGD: every worker takes its own steps; after every H = ``period``-th step, and
    after each of the first ``warmup_steps`` (post-local SGD), all replicas are replaced by
    their average (optimizer states stay local). At the end, steps since the last average are
    averaged once more. Returns θ of each worker after each step (the final average replaces
    the last entry).

    With ``reduce`` (compression, §8): the workers send their drifts d_i = θ_ref − θ_i from the
    last average θ_ref (the initial θ at first); θ_ref ← θ_ref − reduce(d)/W replaces every
    replica."""
    history: list[list[torch.Tensor]] = [[] for _ in models]
    reference = flat(models[0])
    for step in range(1, steps + 1):
        for w in range(len(models)):
            local_step(w, step)
        if step <= warmup_steps or step % period == 0 or step == steps:
            if reduce is None:
                average = mean([flat(m) for m in models])
            else:
                drift = reduce([reference - flat(m) for m in models]) / len(models)
                average = reference = reference - drift
            for m in models:
                set_flat(m, average)
        for w, m in enumerate(models):
            history[w].append(flat(m))
    return history


def diloco(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    steps: int,
    period: int,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool = True,
    reduce: Reduce | None = None,
    warmup_steps: int = 0,
    after_outer: Callable[[int], None] | None = None,
) -> list[list[torch.Tensor]]:
    """DiLoCo: the local optimizers are the inner ones. After each of the first
    ``warmup_steps`` steps every replica and θ_global become the replicas' average (no outer
    step); then, counting from there, after every H-th step (and at the end for a partial
    period) the pseudo-gradient g = θ_global − mean_w θ_w goes through an outer SGD with
    momentum μ: b ← g on the first outer step, b ← μb + g after; the step is d = g + μb with
    Nesterov, d = b without; θ_global ← θ_global − lr·d; every replica then restarts from
    θ_global (and ``after_outer(step)`` runs). Returns θ of each worker after each step. With
    ``reduce`` (compression): g = reduce(θ_global − θ_w for each w)/W, each worker's
    pseudo-gradient sent."""
    theta_global = flat(models[0]).clone()
    buf: torch.Tensor | None = None
    history: list[list[torch.Tensor]] = [[] for _ in models]
    for step in range(1, steps + 1):
        for w in range(len(models)):
            local_step(w, step)
        if step <= warmup_steps:
            theta_global = mean([flat(m) for m in models])
            for m in models:
                set_flat(m, theta_global)
        elif (step - warmup_steps) % period == 0 or step == steps:
            if reduce is None:
                g = theta_global - mean([flat(m) for m in models])
            else:
                g = reduce([theta_global - flat(m) for m in models]) / len(models)
            buf = g.clone() if buf is None else outer_momentum * buf + g
            d = g + outer_momentum * buf if nesterov else buf
            theta_global = theta_global - outer_lr * d
            for m in models:
                set_flat(m, theta_global)
            if after_outer is not None:
                after_outer(step)
        for w, m in enumerate(models):
            history[w].append(flat(m))
    return history


# ---------------------------------------------------------------------------- 3. DASO
def daso(
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    nodes: int,
    steps: int,
    global_skip: int,
    wait: int,
    local_skip: int = 1,
) -> list[list[torch.Tensor]]:
    """DASO in its cycling phase with a fixed B = ``global_skip`` and S = ``wait``, in fp32
    (§3). Ranks are contiguous: node n holds ranks n·G .. n·G + G − 1. Each step every rank
    computes its gradient on ``data(rank, step)``; on steps t with t mod L = 0 the gradients
    are averaged inside each node; every rank's optimizer steps. Then, if a sync is pending
    and t ≥ its merge step, it is merged; if t mod B = 0 (a pending one merged first), the
    k-th sync starts: local rank k mod G of every node sends its θ, to be merged at t + S
    (at once if S = 0). A merge: node n's sender takes θ ← (2S·θ_sender + Σ_nodes θ_sent) /
    (2S + P) and broadcasts it to its node. At the end a pending sync is merged, then one
    blocking average (S = 0) by the next sender in the rotation. Returns θ of each rank after
    each step, the final average replacing the last entry."""
    world = len(models)
    per_node = world // nodes
    assert per_node * nodes == world, "every node has the same number of ranks"
    syncs = 0
    pending: tuple[list[torch.Tensor], int, int, int] | None = None  # sent, merge_at, S, sender

    def start(s: int, step: int) -> None:
        nonlocal syncs, pending
        sender = syncs % per_node
        syncs += 1
        sent = [flat(models[n * per_node + sender]) for n in range(nodes)]
        pending = (sent, step + s, s, sender)

    def merge() -> None:
        nonlocal pending
        (sent, _, s, sender), pending = pending, None
        total = torch.stack(sent).sum(0)
        for n in range(nodes):
            local = flat(models[n * per_node + sender])
            merged = (2 * s * local + total) / (2 * s + nodes)
            for r in range(n * per_node, (n + 1) * per_node):
                set_flat(models[r], merged)

    history: list[list[torch.Tensor]] = [[] for _ in models]
    for step in range(1, steps + 1):
        for r, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            x, y = data(r, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        if step % local_skip == 0:
            for n in range(nodes):
                ranks = models[n * per_node : (n + 1) * per_node]
                for params in zip(*(m.parameters() for m in ranks), strict=True):
                    average = torch.stack([p.grad for p in params]).sum(0) / per_node
                    for p in params:
                        p.grad.copy_(average)
        for optimizer in optimizers:
            optimizer.step()
        if pending is not None and step >= pending[1]:
            merge()
        if step % global_skip == 0:
            if pending is not None:
                merge()
            start(wait, step)
            if wait == 0:
                merge()
        for r, model in enumerate(models):
            history[r].append(flat(model))
    if pending is not None:
        merge()
    start(0, steps)
    merge()
    for r, model in enumerate(models):
        history[r][-1] = flat(model)
    return history


# ---------------------------------------------------------------------------- compression
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flat, in fp32, zero-padded to whole blocks: one row a block."""
    values = x.reshape(-1).float()
    return torch.cat([values, values.new_zeros((-values.numel()) % block)]).view(-1, block)


def quantise_round_trip(x: torch.Tensor, method: str, block: int = 256) -> torch.Tensor:
    """What a receiver sees of ``x`` sent block-wise quantised (docs/algorithms.md#compression):
    blocks of ``block`` values, one scale each, the block's absmax mapped to 127 (int8, codes
    rounded to nearest) or to 448 (fp8 e4m3); an all-zero block has scale 1."""
    blocks = _blocks(x, block)
    top = 127.0 if method == "int8" else 448.0
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    if method == "int8":
        codes = (blocks / scale).round().clamp(-top, top)
    else:
        codes = (blocks / scale).clamp(-top, top).to(torch.float8_e4m3fn).float()
    return (codes * scale).reshape(-1)[: x.numel()].view_as(x)


class QuantisedSum:
    """A :data:`Reduce` for two workers' quantised all-reduce (an all-gather of the quantised
    vectors, §8's form for W ≤ 2) with error feedback: worker i sends C(v_i + e_i), keeps
    e_i ← v_i + e_i − C⁻¹(C(v_i + e_i)); the sum is Σ_i C⁻¹(C(v_i + e_i)) in worker order."""

    def __init__(self, method: str, feedback: bool = True):
        self.method, self.feedback = method, feedback
        self.residuals: dict[int, torch.Tensor] = {}

    def __call__(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        assert len(vectors) <= 2, "from W = 3 on the sum is re-quantised by chunk owners"
        total = None
        for i, v in enumerate(vectors):
            x = v + self.residuals[i] if i in self.residuals else v.clone()
            sent = quantise_round_trip(x, self.method)
            if self.feedback:
                self.residuals[i] = x - sent
            total = sent.clone() if total is None else total + sent
        return total


def rounding_bound(x: torch.Tensor, method: str, block: int = 256) -> torch.Tensor:
    """The most one block-wise rounding of ``x`` can be off, per value: absmax/254 of its
    block (int8: half a step), absmax/16 (fp8: 3 mantissa bits, at the block's top)."""
    absmax = _blocks(x, block).abs().amax(dim=1)
    per_block = absmax / 254 if method == "int8" else absmax / 16
    return per_block.repeat_interleave(block)[: x.numel()].view_as(x)


# ---------------------------------------------------------------------------- gossip
@dataclass
class GossipRun:
    """θ of each worker after each of its steps, and for each pull (worker, peer, lag), where
    lag is the puller's step minus the step of the peer's θ it received."""

    replicas: list[list[torch.Tensor]]
    pulls: list[tuple[int, int, int]]


def gossip_pull(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    steps: int,
    peer: Callable[[int, int], int],
    every: int = 1,
    order: Sequence[int] | None = None,
    full_step: bool = True,
) -> GossipRun:
    """Gossip, pull variant: every worker publishes θ at each step boundary; after every
    k-th (``every``) local step, in its round r (from 0) worker i pulls θ_j, j = peer(i, r), as
    j last published it and sets θ_i ← θ_i + (θ_j − θ_i^b)/2, θ_i^b its own last published θ
    (``full_step``: the boundaries averaged, its step since kept in full), else
    θ_i ← (θ_i + θ_j)/2. Each step, workers act one after the other in ``order`` (default
    0..W−1), so a pull sees the peers before it in this step and the others at their
    previous step."""
    order = list(range(len(models))) if order is None else list(order)
    published = [(flat(m), 0) for m in models]  # (θ, step it was taken at)
    rounds = [0] * len(models)
    run = GossipRun([[] for _ in models], [])
    for step in range(1, steps + 1):
        for w in order:
            local_step(w, step)
            theta = flat(models[w])
            if step % every == 0:
                j = peer(w, rounds[w])
                rounds[w] += 1
                peer_theta, peer_step = published[j]
                if full_step:
                    theta = theta + 0.5 * peer_theta - 0.5 * published[w][0]
                else:
                    theta = (theta + peer_theta) / 2
                set_flat(models[w], theta)
                run.pulls.append((w, j, step - peer_step))
            published[w] = (theta, step)
            run.replicas[w].append(theta)
    return run


# -------------------------------------------------------------------------- 8. quantised all-reduce
def quantised_all_reduce(
    vectors: Sequence[torch.Tensor],
    method: str,
    sent_residuals: list[torch.Tensor | None],
    owner_residuals: list[torch.Tensor | None],
    block: int = 256,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """ALGORITHMS.md §8 for W = len(vectors) ≥ 3 ranks, one after the other: rank i sends
    x_i + e_i quantised per block (absmax ↦ 127 for int8, 448 for fp8 e4m3, scale 1 for a
    zero block); the blocks are cut into W runs as even as whole blocks allow (the first runs
    one block more); owner j sums the dequantised run j of ranks 0..W−1 in fp32, in that order,
    adds its residual, quantises, and every rank takes the owners' dequantised runs. Returns
    (the result every rank holds, the new sender residuals, the new owner residuals)."""
    size, n = len(vectors), vectors[0].numel()
    pad = (-n) % block
    blocks = (n + pad) // block
    runs = [blocks // size + (1 if j < blocks % size else 0) for j in range(size)]
    sent, new_sent = [], []
    for x, e in zip(vectors, sent_residuals, strict=True):
        x = torch.cat([x.reshape(-1).float(), x.new_zeros(pad)])
        if e is not None:
            x = x + torch.cat([e.reshape(-1), e.new_zeros(pad)])
        c = quantise_round_trip(x, method, block)
        sent.append(c.split([r * block for r in runs]))
        new_sent.append((x - c)[:n])
    result, new_owner = [], []
    for j in range(size):
        total = torch.zeros(runs[j] * block)
        for i in range(size):
            total += sent[i][j]
        if owner_residuals[j] is not None:
            total = total + owner_residuals[j]
        c = quantise_round_trip(total, method, block)
        result.append(c)
        new_owner.append(total - c)
    return torch.cat(result)[:n], new_sent, new_owner


# ---------------------------------------------------------------------------- staleness (§6, §7)
def compensated_server(
    theta0: torch.Tensor,
    script: Sequence[tuple],
    method: str,
    lr: float = 1.0,
    local_lr: float = 0.1,
    dc_lambda: float = 0.04,
    threshold: int = 1,
    window: int | None = None,
    beta: float = 0.95,
    eps: float = 1e-7,
) -> tuple[torch.Tensor, list[int]]:
    """One shard under the add rule θ ← θ + lr·Δ̃ with a staleness compensation (§6), in a
    scripted order: ``("fetch", w)`` (w takes the current version) or ``("push", w, Δ)``.
    Every θ the shard held is kept (``window``: only the last ``window`` versions may be
    looked up; an older base version reads the oldest of them). Methods: none, scale (1/τ),
    delay-adaptive (1 while τ ≤ threshold, else threshold/τ), dc and dc-adaptive (g = −Δ/η,
    g̃ = g + λ·g²·(θ_now − θ_then), Δ̃ = −η·g̃; adaptive: m ← β·m + (1−β)·g², λ = λ0/√(m + ε)),
    gap (Δ̃ = Δ / (1 + |θ_now − θ_then| / C), C the running mean of the earlier pushes' |Δ|,
    started at the first push's; 1 where C is 0). Returns (θ, each push's staleness)."""
    history = [theta0.clone().float()]
    theta = history[0].clone()
    fetched: dict = {}
    mean_square = torch.zeros_like(theta)
    mean_step = None
    stalenesses = []
    for event in script:
        if event[0] == "fetch":
            fetched[event[1]] = len(history) - 1
            continue
        _, worker, delta = event
        now = len(history) - 1
        base = fetched[worker]
        tau = now - base
        stalenesses.append(tau)
        if window is not None:
            base = max(base, now - window + 1)
        then = history[base]
        if method == "none":
            update = delta
        elif method == "scale":
            update = delta * (1.0 / max(1, tau))
        elif method == "delay-adaptive":
            update = delta * (1.0 if tau <= threshold else threshold / tau)
        elif method in ("dc", "dc-adaptive"):
            g = -delta / local_lr
            if method == "dc-adaptive":
                mean_square = beta * mean_square + (1 - beta) * g * g
                lam = dc_lambda / torch.sqrt(mean_square + eps)
            else:
                lam = dc_lambda
            update = -local_lr * (g + lam * g * g * (theta - then))
        elif method == "gap":
            if mean_step is None:
                penalty = torch.ones_like(theta)
            else:
                ratio = (theta - then).abs() / mean_step
                penalty = 1 + torch.where(mean_step > 0, ratio, torch.zeros_like(ratio))
            update = delta / penalty
        else:
            raise ValueError(method)
        theta = theta + lr * update
        if method == "gap":
            size = delta.abs()
            mean_step = size if mean_step is None else beta * mean_step + (1 - beta) * size
        history.append(theta.clone())
    return theta, stalenesses


def delayed_nesterov_server(
    theta0: torch.Tensor,
    pseudo_gradients: Sequence[torch.Tensor],
    lr: float,
    beta: float,
    period: int,
    c: float = 0.0,
) -> torch.Tensor:
    """Asynchronous DiLoCo's outer rule (§7; Liu et al. 2024, Algorithm DN), pushes applied
    in the given order: the pseudo-gradients g are summed into a; every ``period``-th push
    the momentum takes their mean (m ← β·m + a/N) and θ moves by η·(1 − cN + c)·β·m; every
    push moves θ by η·g/N (plus η·c·β·m between momentum updates)."""
    theta = theta0.clone().float()
    m = torch.zeros_like(theta)
    acc = torch.zeros_like(theta)
    for t, g in enumerate(pseudo_gradients):
        acc = acc + g
        if (t + 1) % period == 0:
            m = beta * m + acc / period
            theta = theta - lr * (1 - c * period + c) * beta * m
            acc = torch.zeros_like(theta)
        else:
            theta = theta - lr * c * beta * m
        theta = theta - lr / period * g
    return theta


# ---------------------------------------------------------------------------- whole runs on the
# parity problem (the synthetic split, the MNIST-1D CNN or MLP, the flags of COMMON)
# The flags every parity run shares; the simulations' defaults are the same values.
SEED, BATCH, LR, MOMENTUM = 3, 16, 0.05, 0.9
COMMON = ["--dataset", "synthetic", "--model", "cnn", "--batch-size", str(BATCH), "--lr", str(LR),
          "--momentum", str(MOMENTUM), "--seed", str(SEED), "--no-progress",
          "--eval-every-s", "1000"]  # fmt: skip
PARITY_LENGTH, PARITY_CLASSES = 40, 10


class MLP(nn.Module):
    """The MNIST-1D paper's MLP: 40 → 100 → 100 → 10, ReLU."""

    def __init__(self, length: int = PARITY_LENGTH, classes: int = PARITY_CLASSES, hidden=100):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, classes))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """The MNIST-1D paper's CNN: convolutions of 25 channels, kernels 5, 3, 3, stride 2,
    padding 1, ReLU after each, and a linear head on the flattened 25 × 5 features."""

    def __init__(self, length: int = PARITY_LENGTH, classes: int = PARITY_CLASSES, channels=25):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.linear = nn.Linear(channels * 5, classes)  # 40 → 19 → 10 → 5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x.reshape(x.shape[0], 1, -1)).relu()
        h = self.conv2(h).relu()
        return self.linear(self.conv3(h).relu().flatten(1))


def fresh_model(model: str = "cnn", seed: int = SEED) -> nn.Module:
    """Model ``model`` (``cnn`` or ``mlp``) with the initial θ every rank of a run starts from."""
    torch.manual_seed(seed)
    if model == "cnn":
        return CNN()
    if model == "mlp":
        return MLP()
    raise ValueError(f"no reference definition of model {model!r}")


def parity_numel(model: str = "cnn") -> int:
    """The number of parameters of :func:`fresh_model` ``model``."""
    return sum(p.numel() for p in fresh_model(model).parameters())


class Batches:
    """One worker's endless mini-batches: each epoch a permutation of the shard drawn from a
    generator seeded with ``seed·1_000_003 + epoch``; ``batch`` rows each, the rest of an
    epoch dropped. ``state_dict``: the position (epoch, batch index), as a checkpoint keeps it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, seed: int):
        self.x, self.y, self.batch, self.seed = x, y, batch, seed
        self.epoch, self.index = 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index == self.x.shape[0] // self.batch:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.x.shape[0], generator=g)
        rows = order[self.index * self.batch : (self.index + 1) * self.batch]
        self.index += 1
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def streams(workers: int, batch: int = BATCH, seed: int = SEED, test_size=1000) -> list[Batches]:
    """Each worker's batches: the contiguous, equal ``w``-th share of the raw synthetic training
    split (40 features, 10 classes; the remainder unused)."""
    from cloudburst.data import load_dataset  # the input, not the rule

    # (synthetic data draws its training samples after all labels: the test size matters)
    data = load_dataset("synthetic", 4000, test_size)
    per = data.x_train.shape[0] // workers
    return [Batches(data.x_train[w * per : (w + 1) * per], data.y_train[w * per : (w + 1) * per],
                    batch, seed * 1000 + w) for w in range(workers)]  # fmt: skip


def trained(out, model: str = "cnn") -> nn.Module:
    """The model a run saved (``OUT/model.pt``)."""
    from cloudburst.records.checkpoint import load_model_into

    m = fresh_model(model, seed=0)
    load_model_into(out / "model.pt", m)
    return m


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_params_differ(a: nn.Module, b: nn.Module, at_least: float = 1e-3) -> None:
    """The two models differ by more than the parity tolerance (a flag changed the run)."""
    gap = max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    assert gap > at_least, f"the models differ by only {gap:g}"


def _loss(model: nn.Module, batch, autocast: bool = False) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return nn.functional.cross_entropy(model(x), y)


def sync_sgd(
    steps: int,
    workers: int,
    model: str = "cnn",
    optimizer: str = "sgd",
    lr: float = LR,
    momentum: float = MOMENTUM,
    weight_decay: float = 0.0,
    cosine: bool = False,
    autocast: bool = False,
    nan: Iterable[tuple[int, int]] = (),
    test_size: int = 1000,
) -> nn.Module:
    """Synchronous SGD: one model, each step on the workers' batches together (the mean of
    their gradients is the gradient of the concatenated batch). A NaN on any worker makes the
    averaged gradient NaN: that step is skipped by everyone."""
    m = fresh_model(model)
    if optimizer == "adam":
        opt = torch.optim.Adam(m.parameters(), lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if cosine else None
    skip = {step for _, step in nan}
    data = streams(workers, test_size=test_size)
    for step in range(1, steps + 1):
        batches = [next(s) for s in data]
        opt.zero_grad()
        _loss(m, [torch.cat(part) for part in zip(*batches, strict=True)], autocast).backward()
        if step not in skip:
            opt.step()
        if sched is not None:
            sched.step()
    return m


class ParityReplicas:
    """``workers`` replicas of :func:`fresh_model`, each with SGD (lr LR, momentum MOMENTUM)
    or AdamW (lr ``adamw_lr``, β1 = MOMENTUM); :meth:`step` is a ``local_step`` callback. A
    replica of ``ranks_per_replica`` workers (a node replica) steps on its G workers' batches
    together (G streams, in rank order); a (worker, step) in ``nan`` is not applied."""

    def __init__(self, workers, model="cnn", ranks_per_replica=1, nan=(), adamw_lr=0.0):
        base = fresh_model(model)
        self.models = [copy.deepcopy(base) for _ in range(workers)]
        self.optimizers = [
            torch.optim.AdamW(m.parameters(), lr=adamw_lr, betas=(MOMENTUM, 0.999), weight_decay=0)
            if adamw_lr
            else sgd(LR, MOMENTUM)(m)
            for m in self.models
        ]
        self.data = streams(workers * ranks_per_replica)
        self.per, self.nan = ranks_per_replica, set(nan)

    def step(self, w: int, step: int) -> None:
        batches = [next(s) for s in self.data[w * self.per : (w + 1) * self.per]]
        self.optimizers[w].zero_grad()
        _loss(self.models[w], [torch.cat(part) for part in zip(*batches, strict=True)]).backward()
        if (w, step) not in self.nan:
            self.optimizers[w].step()


def parity_local_sgd(
    steps: int, workers: int, period: int, warmup_steps: int = 0, model: str = "cnn",
    nan: Iterable[tuple[int, int]] = (), ranks_per_replica: int = 1,
) -> tuple[nn.Module, int]:  # fmt: skip
    """:func:`local_sgd` (post-local SGD with ``warmup_steps``) of ``workers`` replicas of
    ``ranks_per_replica`` workers each (:class:`ParityReplicas`). Returns (worker 0's replica,
    number of averages)."""
    r = ParityReplicas(workers, model, ranks_per_replica, nan)
    local_sgd(r.models, r.step, steps, period, warmup_steps=warmup_steps)
    due = [s for s in range(1, steps + 1) if s <= warmup_steps or s % period == 0 or s == steps]
    return r.models[0], len(due)


def parity_diloco(
    steps: int, workers: int, period: int, outer_lr: float, outer_momentum: float,
    nesterov: bool, model: str = "cnn", ranks_per_replica: int = 1, warmup_steps: int = 0,
    adamw_lr: float = 0.0, desloc: tuple[int, int] = (0, 0),
) -> tuple[nn.Module, int]:  # fmt: skip
    """:func:`diloco` of :class:`ParityReplicas` (inner AdamW of lr ``adamw_lr`` when set, SGD
    otherwise). DES-LOC (``desloc`` = (K1, K2)): every K1 (K2) periods, after that step's outer
    step, each parameter's Adam exp_avg (exp_avg_sq) becomes the replicas' average of it.
    Returns (θ_global as a model, outer steps)."""
    r = ParityReplicas(workers, model, ranks_per_replica, adamw_lr=adamw_lr)
    outer_steps = []

    def after_outer(step: int) -> None:
        outer_steps.append(step)
        for key, every in zip(("exp_avg", "exp_avg_sq"), desloc, strict=True):
            if every and (step - warmup_steps) % (period * every) == 0:
                for params in zip(*(m.parameters() for m in r.models), strict=True):
                    states = [o.state[p][key] for o, p in zip(r.optimizers, params, strict=True)]
                    average = mean(states)
                    for s in states:
                        s.copy_(average)

    diloco(r.models, r.step, steps, period, outer_lr, outer_momentum, nesterov,
           warmup_steps=warmup_steps, after_outer=after_outer)  # fmt: skip
    return r.models[0], len(outer_steps)


def fragment_ranges(model: nn.Module, fragments: int) -> list[tuple[int, int]]:
    """Streaming DiLoCo's split, as documented: whole parameter tensors in module order, F
    runs balanced by element count — run k ends at the tensor boundary nearest to (k+1)/F of
    the elements (leaving at least one tensor for each later run). [start, stop) in θ."""
    ends, total = [], 0
    for p in model.parameters():
        total += p.numel()
        ends.append(total)
    cuts, first = [], 1
    for k in range(1, fragments):
        target = total * k / fragments
        candidates = range(first, len(ends) - (fragments - k) + 1)
        best = min(candidates, key=lambda i: (abs(ends[i - 1] - target), i))
        cuts.append(best)
        first = best + 1
    elements = [0, *ends]
    return [(elements[a], elements[b]) for a, b in pairwise([0, *cuts, len(ends)])]


def streaming_diloco(
    replicas: Sequence[nn.Module],
    local_step: LocalStep,
    steps: int,
    period: int,
    fragments: int,
    delay: int,
    alpha: float,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
) -> tuple[list[list[torch.Tensor]], int]:
    """Streaming DiLoCo (Douillard et al. 2025): θ is cut into F fragments; fragment k is sent
    after the steps t with t mod H = ((k+1)·H // F) mod H (the sum of the replicas' fragment
    as it is then) and applied τ = ``delay`` steps later: the pseudo-gradient g = θ_g,k − sum/W
    goes through fragment k's own outer SGD (b ← g, then b ← μb + g; d = g + μb with Nesterov,
    else b; θ_g,k ← θ_g,k − lr·d), and every replica's fragment becomes
    α·(its fragment now) + (1 − α)·θ_g,k. At the end, fragments still in flight are applied,
    then every fragment not replaced by θ_g,k at the last step gets one more outer step with
    no delay and no mixing. Returns (θ of each worker after each step, the end replacing the
    last entry; fragment syncs)."""
    workers, history = len(replicas), [[] for _ in replicas]
    ranges = fragment_ranges(replicas[0], fragments)
    theta = [flat(replicas[0])[a:b].clone() for a, b in ranges]
    momentum: list[torch.Tensor | None] = [None] * fragments
    offsets = [((k + 1) * period // fragments) % period for k in range(fragments)]
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}
    last_replaced = [0] * fragments
    syncs = 0

    def start(k: int, step: int, wait: int) -> None:
        nonlocal syncs
        a, b = ranges[k]
        in_flight[k] = (step + wait, sum(flat(m)[a:b] for m in replicas))
        syncs += 1

    def apply(k: int, step: int, mix: float) -> None:
        a, b = ranges[k]
        _, total = in_flight.pop(k)
        g = theta[k] - total / workers
        momentum[k] = g.clone() if momentum[k] is None else outer_momentum * momentum[k] + g
        d = g + outer_momentum * momentum[k] if nesterov and outer_momentum > 0 else momentum[k]
        theta[k] = theta[k] - outer_lr * d
        for m in replicas:
            vector = flat(m)
            vector[a:b] = mix * vector[a:b] + (1 - mix) * theta[k] if mix else theta[k]
            set_flat(m, vector)
        if not mix:
            last_replaced[k] = step

    for step in range(1, steps + 1):
        for w in range(workers):
            local_step(w, step)
        for k in range(fragments):
            if step % period == offsets[k]:
                start(k, step, delay)
        for k in sorted(in_flight):
            if in_flight[k][0] == step:
                apply(k, step, alpha)
        for w, m in enumerate(replicas):
            history[w].append(flat(m))
    for k in sorted(in_flight):
        apply(k, steps, alpha)
    for k in range(fragments):
        if last_replaced[k] != steps:
            start(k, steps, 0)
            apply(k, steps, 0.0)
    for w, m in enumerate(replicas):
        history[w][-1] = flat(m)
    return history, syncs


def parity_streaming_diloco(steps: int, workers: int, model: str = "cnn", **settings):
    """:func:`streaming_diloco` of :class:`ParityReplicas`: (worker 0's replica, syncs)."""
    r = ParityReplicas(workers, model)
    _, syncs = streaming_diloco(r.models, r.step, steps, **settings)
    return r.models[0], syncs


class AsgdWorker:
    """One asgd worker against the servers (``server``: :class:`Server`'s settings).

    Every ``n_push`` steps it pushes Δ = θ_local − θ_ref (its progress since the last push or
    fetch); every ``n_fetch`` steps it fetches θ (after its push, when both are due), keeping
    the progress it has not pushed yet; when it finishes it pushes what is left."""

    def __init__(self, n_fetch: int, n_push: int, model: str = "cnn", **server):
        self.n_fetch, self.n_push, self.model_name = n_fetch, n_push, model
        self.model = fresh_model(model)
        self.opt = sgd(LR, MOMENTUM)(self.model)
        self.server = Server(flat(self.model), **server)
        [self.data] = streams(1)
        self.reference, self.base, self.step = flat(self.model), 0, 0

    def train(self, steps: int, checkpoint_at: int | None = None) -> dict | None:
        """``steps`` more steps; returns what a checkpoint after step ``checkpoint_at``
        holds (the local optimizer, the data position, the step)."""
        saved = None
        for _ in range(steps):
            self.step += 1
            self.opt.zero_grad()
            _loss(self.model, next(self.data)).backward()
            self.opt.step()
            push, fetch = self.step % self.n_push == 0, self.step % self.n_fetch == 0
            local = flat(self.model)
            if push:
                self.server.push(local - self.reference, self.base)
            if fetch:
                pending = 0 if push else local - self.reference
                self._fetch(pending)
            elif push:
                self.reference = local
            if self.step == checkpoint_at:
                saved = {
                    "optimizer": copy.deepcopy(self.opt.state_dict()),
                    "stream": self.data.state_dict(),
                    "step": self.step,
                }
        return saved

    def _fetch(self, pending) -> None:
        set_flat(self.model, self.server.theta.detach() + pending)
        self.reference, self.base = self.server.theta.detach().clone(), self.server.version

    def finish(self) -> None:
        if self.step % self.n_push:
            self.server.push(flat(self.model) - self.reference, self.base)

    def resume(self, checkpoint: dict) -> None:
        """A resumed run: the worker's optimizer, data position and step from its checkpoint,
        its θ from the servers (which kept theirs)."""
        self.opt.load_state_dict(checkpoint["optimizer"])
        self.data.load_state_dict(checkpoint["stream"])
        self.step = checkpoint["step"]
        self._fetch(0)

    def global_model(self) -> nn.Module:
        out = fresh_model(self.model_name)
        set_flat(out, self.server.theta.detach())
        return out


def asgd_one_worker(
    steps: int, n_fetch: int, n_push: int, model: str = "cnn", **server
) -> tuple[nn.Module, Server]:
    """A whole run of one asgd worker: (the servers' θ as a model, the server)."""
    worker = AsgdWorker(n_fetch, n_push, model, **server)
    worker.train(steps)
    worker.finish()
    return worker.global_model(), worker.server


def easgd_one_worker(steps: int, tau: int, alpha: float, model: str = "cnn") -> nn.Module:
    """One EASGD worker (:func:`easgd`): every τ steps (and at the end) e = α(θ_i − θ̃);
    θ_i −= e; θ̃ += e. Returns the centre θ̃ as a model."""
    r = ParityReplicas(1, model)
    out = fresh_model(model)
    set_flat(out, easgd(r.models, r.step, [0] * steps, tau, alpha).server[-1])
    return out


def asgd_one_round(
    steps: int, replicas: int, ranks_per_replica: int, server_lr: float, model: str = "cnn"
) -> nn.Module:
    """asgd where every replica pushes once, after ``steps`` local steps (n_sync = steps): the
    add rule θ ← θ + λ·Δ_i makes the servers' θ the same in any push order,
    θ0 + λ·Σ_i (θ_i − θ0). Node replicas step on their G workers' batches together."""
    r = ParityReplicas(replicas, model, ranks_per_replica)
    theta0 = flat(r.models[0]).clone()
    for step in range(1, steps + 1):
        for w in range(replicas):
            r.step(w, step)
    out = fresh_model(model)
    set_flat(out, theta0 + server_lr * sum(flat(m) - theta0 for m in r.models))
    return out
