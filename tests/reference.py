"""Independent single-process references of cloudburst's algorithms, in plain PyTorch.

Each reference simulates W workers in one process, one after the other in an order the caller
scripts, and follows ALGORITHMS.md literally, with nothing taken from cloudburst: no strategy,
server, comm or flatten code is imported here, so a test that compares cloudburst with a
reference compares two independent implementations.

The references own the *communication* semantics only. Training is the caller's: a
``local_step(worker, step)`` callback advances one replica by one optimizer step (its own data,
its own optimizer), exactly as that worker's training loop would. :class:`Replicas` builds such
a callback for the small problem below, which the distributed tests also train on (same seeded
data and initial θ in every process), so that both sides compute the same gradients.

References (ALGORITHMS.md section in brackets):

- :func:`large_batch_sgd` — sync (§1): one SGD step on the concatenation of the W batches.
- :class:`ParameterServer`, :func:`asgd` — the add rule θ ← θ + λΔ, version clock and
  staleness, with a scripted order of the workers' steps (§2, n_fetch = n_push = n_sync).
- :func:`easgd` — elastic averaging against a centre, in a scripted order (§4).
- :func:`daso` — node-local gradient averages, a global merge S steps after each sync with
  the weight 2S, the rotating sender and the node broadcast (§3).
- :func:`local_sgd` — average the replicas every H steps (§5).
- :func:`diloco` — outer SGD with Nesterov momentum on the averaged pseudo-gradient (§5).
- :func:`gossip_pull` — pull averaging with a fixed peer schedule, workers in a fixed order (§4).

Every replica's θ is returned after each of its local steps (a trajectory), so a test can
compare whole runs, not just their end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

#: ``local_step(worker, step)``: one optimizer step of worker ``worker``'s replica; ``step``
#: counts that worker's local steps from 1.
LocalStep = Callable[[int, int], None]

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
        self,
        workers: int,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        seed: int = 0,
        batch_size: int = 8,
    ):
        self.models = [tiny_model(seed) for _ in range(workers)]
        self.optimizers = [make_optimizer(m) for m in self.models]
        self.batch_size = batch_size

    def step(self, worker: int, step: int) -> None:
        x, y = batch(worker, step, self.batch_size)
        train_step(self.models[worker], self.optimizers[worker], x, y)


def sgd(lr: float = 0.1, momentum: float = 0.9) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)


def adamw(lr: float = 0.01) -> Callable[[nn.Module], torch.optim.Optimizer]:
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
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        train_step(model, optimizer, x, y)
        history.append(flat(model))
    return history


# ---------------------------------------------------------------------------- 2. asgd
@dataclass
class ParameterServer:
    """One unsharded parameter server with the add rule θ ← θ + λΔ and a version clock.

    ``push`` applies one push computed against ``base_version``; its staleness is the number of
    pushes applied since that version. Pushes are applied one at a time, in call order.
    """

    theta: torch.Tensor
    lam: float
    version: int = 0
    staleness: list[int] = field(default_factory=list)  # of every push, in order

    def fetch(self) -> tuple[torch.Tensor, int]:
        return self.theta.clone(), self.version

    def push(self, delta: torch.Tensor, base_version: int) -> int:
        staleness = self.version - base_version
        self.theta = self.theta.add(delta, alpha=self.lam)
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
    worker order.
    """
    server = ParameterServer(flat(models[0]).clone(), lam)
    base: list[torch.Tensor] = []
    version: list[int] = []
    for m in models:
        theta, v = server.fetch()
        set_flat(m, theta)
        base.append(theta)
        version.append(v)
    steps = [0] * len(models)
    run = PsRun([], [], [[] for _ in models])

    def push(w: int) -> None:
        local = flat(models[w])
        run.pushes.append((w, server.push(local - base[w], version[w])))
        run.server.append(server.theta.clone())
        base[w] = local

    for w in script:
        steps[w] += 1
        local_step(w, steps[w])
        if steps[w] % n_sync == 0:
            push(w)
            base[w], version[w] = server.fetch()
            set_flat(models[w], base[w])
        run.replicas[w].append(flat(models[w]))
    if flush:
        for w in range(len(models)):
            if steps[w] % n_sync:
                push(w)
    run.final = [flat(m) for m in models]
    return run


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
    a worker with steps since its last exchange makes one more at the end, in worker order.
    """
    centre = flat(models[0]).clone()
    for m in models:
        set_flat(m, centre)
    exchanges = 0
    seen = [0] * len(models)
    steps = [0] * len(models)
    run = PsRun([], [], [[] for _ in models])

    def exchange(w: int) -> None:
        nonlocal centre, exchanges
        theta = flat(models[w])
        e = alpha * (theta - centre)
        set_flat(models[w], theta - e)
        centre = centre + e
        run.pushes.append((w, exchanges - seen[w]))
        run.server.append(centre.clone())
        exchanges += 1
        seen[w] = exchanges

    for w in script:
        steps[w] += 1
        local_step(w, steps[w])
        if steps[w] % tau == 0:
            exchange(w)
        run.replicas[w].append(flat(models[w]))
    if flush:
        for w in range(len(models)):
            if steps[w] % tau:
                exchange(w)
    run.final = [flat(m) for m in models]
    return run


# ---------------------------------------------------------------------------- 5. local SGD
#: ``reduce(vectors)``: the sum of the workers' vectors as a (compressed) all-reduce delivers it.
Reduce = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def local_sgd(
    models: Sequence[nn.Module],
    local_step: LocalStep,
    steps: int,
    period: int,
    reduce: Reduce | None = None,
) -> list[list[torch.Tensor]]:
    """Local SGD: every worker takes its own steps; after every H = ``period``-th step all
    replicas are replaced by their average (optimizer states stay local). At the end, steps
    since the last average are averaged once more. Returns θ of each worker after each step
    (the final average replaces the last entry).

    With ``reduce`` (compression, §8): the workers send their drifts d_i = θ_ref − θ_i from the
    last average θ_ref (the initial θ at first); θ_ref ← θ_ref − reduce(d)/W replaces every
    replica."""
    history: list[list[torch.Tensor]] = [[] for _ in models]
    reference = flat(models[0])
    for step in range(1, steps + 1):
        for w in range(len(models)):
            local_step(w, step)
        if step % period == 0 or step == steps:
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
) -> list[list[torch.Tensor]]:
    """DiLoCo: the local optimizers are the inner ones; after every H-th step (and at the end
    for a partial period) the pseudo-gradient g = θ_global − mean_w θ_w goes through an outer
    SGD with momentum μ: b ← g on the first outer step, b ← μb + g after; the step is
    d = g + μb with Nesterov, d = b without; θ_global ← θ_global − lr·d; every replica then
    restarts from θ_global. Returns θ of each worker after each step. With ``reduce``
    (compression): g = reduce(θ_global − θ_w for each w)/W, each worker's pseudo-gradient
    sent."""
    theta_global = flat(models[0]).clone()
    buf: torch.Tensor | None = None
    history: list[list[torch.Tensor]] = [[] for _ in models]
    for step in range(1, steps + 1):
        for w in range(len(models)):
            local_step(w, step)
        if step % period == 0 or step == steps:
            if reduce is None:
                g = theta_global - mean([flat(m) for m in models])
            else:
                g = reduce([theta_global - flat(m) for m in models]) / len(models)
            buf = g.clone() if buf is None else outer_momentum * buf + g
            d = g + outer_momentum * buf if nesterov else buf
            theta_global = theta_global - outer_lr * d
            for m in models:
                set_flat(m, theta_global)
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
def quantise_round_trip(x: torch.Tensor, method: str, block: int = 256) -> torch.Tensor:
    """What a receiver sees of ``x`` sent block-wise quantised (docs/algorithms.md#compression):
    blocks of ``block`` values, one scale each, the block's absmax mapped to 127 (int8, codes
    rounded to nearest) or to 448 (fp8 e4m3); an all-zero block has scale 1."""
    values = x.reshape(-1).float()
    pad = (-values.numel()) % block
    blocks = torch.cat([values, values.new_zeros(pad)]).view(-1, block)
    top = 127.0 if method == "int8" else 448.0
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    if method == "int8":
        codes = (blocks / scale).round().clamp(-top, top)
    else:
        codes = (blocks / scale).clamp(-top, top).to(torch.float8_e4m3fn).float()
    return (codes * scale).reshape(-1)[: values.numel()].view_as(x)


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
    values = x.reshape(-1).abs().float()
    pad = (-values.numel()) % block
    absmax = torch.cat([values, values.new_zeros(pad)]).view(-1, block).amax(dim=1)
    per_block = absmax / 254 if method == "int8" else absmax / 16
    return per_block.repeat_interleave(block)[: values.numel()].view_as(x)


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
    top = 127.0 if method == "int8" else 448.0
    size, n = len(vectors), vectors[0].numel()
    pad = (-n) % block

    def rounded(x: torch.Tensor) -> torch.Tensor:  # C⁻¹(C(x)), x a multiple of `block` long
        rows = x.view(-1, block)
        peak = rows.abs().amax(dim=1)
        scale = torch.where(peak > 0, peak / top, torch.ones_like(peak))[:, None]
        if method == "int8":
            codes = (rows / scale).round().clamp(-top, top).to(torch.int8)
        else:
            codes = (rows / scale).clamp(-top, top).to(torch.float8_e4m3fn)
        return (codes.float() * scale).reshape(-1)

    blocks = (n + pad) // block
    runs = [blocks // size + (1 if j < blocks % size else 0) for j in range(size)]
    sent, new_sent = [], []
    for x, e in zip(vectors, sent_residuals, strict=True):
        x = torch.cat([x.reshape(-1).float(), x.new_zeros(pad)])
        if e is not None:
            x = x + torch.cat([e.reshape(-1), e.new_zeros(pad)])
        c = rounded(x)
        sent.append(c.split([r * block for r in runs]))
        new_sent.append((x - c)[:n])
    result, new_owner = [], []
    for j in range(size):
        total = torch.zeros(runs[j] * block)
        for i in range(size):
            total += sent[i][j]
        if owner_residuals[j] is not None:
            total = total + owner_residuals[j]
        c = rounded(total)
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
        new = theta + lr * update
        if method == "gap":
            size = delta.abs()
            mean_step = size if mean_step is None else beta * mean_step + (1 - beta) * size
        theta = new
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
