"""Single-process simulations of each strategy's arithmetic, written from the algorithms'
descriptions (README, ALGORITHMS.md), not from cloudburst's code: what a run must end with.

Independent of the package's data and model code: the raw synthetic split is the package's
(the input), but the sharding and the batch order are computed here from the documented rule
(worker ``w`` of ``W`` trains on the contiguous ``w``-th of ``W`` equal shards, the remainder
unused; each epoch a fresh permutation of the shard seeded by ``seed·1000 + w``, the last
incomplete batch dropped), and the models are defined here (the MNIST-1D paper's MLP and CNN,
built after ``torch.manual_seed(seed)``: the same seed, the same initial θ). A sharding bug
(every worker given the same shard, say) therefore fails the parity tests. Each worker's
local optimizer is plain PyTorch. ``nan`` names (worker, step) pairs whose loss an injected
``nan:RANK@STEP`` fault makes NaN: that worker's step is not applied (its optimizer does not
step; its data stream moves on).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from cloudburst.records.checkpoint import load_model_into
from cloudburst.data import load_dataset

# The flags every parity run shares; the simulations' defaults are the same values.
SEED, BATCH, LR, MOMENTUM = 3, 16, 0.05, 0.9
COMMON = ["--dataset", "synthetic", "--model", "cnn", "--batch-size", str(BATCH), "--lr", str(LR),
          "--momentum", str(MOMENTUM), "--seed", str(SEED), "--no-progress",
          "--eval-every-s", "1000"]  # fmt: skip


def _data(test_size: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw synthetic training split (40 features, 10 classes): the input, not the rule."""
    # (synthetic data draws its training samples after all labels: the test size matters)
    data = load_dataset("synthetic", 4000, test_size)
    return data.x_train, data.y_train


LENGTH, CLASSES = 40, 10


class MLP(nn.Module):
    """The MNIST-1D paper's MLP: 40 → 100 → 100 → 10, ReLU."""

    def __init__(self, length: int = LENGTH, classes: int = CLASSES, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, classes))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """The MNIST-1D paper's CNN: convolutions of 25 channels, kernels 5, 3, 3, stride 2,
    padding 1, ReLU after each, and a linear head on the flattened 25 × 5 features."""

    def __init__(self, length: int = LENGTH, classes: int = CLASSES, channels: int = 25):
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


class Batches:
    """One worker's endless mini-batches: each epoch a permutation of the shard drawn from a
    generator seeded with ``seed·1_000_003 + epoch``; ``batch`` rows each, the rest of an
    epoch dropped. ``state_dict``: the position (epoch, batch index), as a checkpoint keeps it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, seed: int):
        self.x, self.y, self.batch, self.seed = x, y, batch, seed
        self.epoch, self.index = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index == self.x.shape[0] // self.batch:
            self.epoch, self.index = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = (self.epoch, torch.randperm(self.x.shape[0], generator=g))
        rows = self._order[1][self.index * self.batch : (self.index + 1) * self.batch]
        self.index += 1
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def shard(x: torch.Tensor, y: torch.Tensor, worker: int, workers: int):
    """Worker ``worker``'s contiguous, equal share of (x, y) (the remainder unused)."""
    per = x.shape[0] // workers
    return x[worker * per : (worker + 1) * per], y[worker * per : (worker + 1) * per]


def trained(out, model: str = "cnn") -> nn.Module:
    """The model a run saved (``OUT/model.pt``)."""
    m = fresh_model(model, seed=0)
    load_model_into(out / "model.pt", m)
    return m


def streams(
    workers: int, batch: int = BATCH, seed: int = SEED, test_size: int = 1000
) -> list[Batches]:
    x, y = _data(test_size)
    return [Batches(*shard(x, y, w, workers), batch, seed * 1000 + w) for w in range(workers)]


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_params_differ(a: nn.Module, b: nn.Module, at_least: float = 1e-3) -> None:
    """The two models differ by more than the parity tolerance (a flag changed the run)."""
    gap = max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    assert gap > at_least, f"the models differ by only {gap:g}"


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _assign(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        i = 0
        for p in model.parameters():
            p.copy_(flat[i : i + p.numel()].view_as(p))
            i += p.numel()


def _loss(model: nn.Module, batch, autocast: bool = False) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return nn.functional.cross_entropy(model(x), y)


def _sgd(model: nn.Module, lr: float = LR, momentum: float = MOMENTUM) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


# ---------------------------------------------------------------------------- sync
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
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        _loss(m, (x, y), autocast).backward()
        if step not in skip:
            opt.step()
        if sched is not None:
            sched.step()
    return m


# ---------------------------------------------------------------------------- local SGD, DiLoCo
def _replicas(workers: int, model: str) -> tuple[list[nn.Module], list[torch.optim.SGD]]:
    base = fresh_model(model)
    replicas = [copy.deepcopy(base) for _ in range(workers)]
    return replicas, [_sgd(r) for r in replicas]


def _local_steps(replicas, opts, data, step: int, nan: set[tuple[int, int]]) -> None:
    """Each replica's step on its own batch; a node replica (``data`` holds G streams per
    replica: the node's workers, in rank order) on its G workers' batches together."""
    per = len(data) // len(replicas)
    for w, (r, opt) in enumerate(zip(replicas, opts, strict=True)):
        batches = [next(s) for s in data[w * per : (w + 1) * per]]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        opt.zero_grad()
        _loss(r, (x, y)).backward()
        if (w, step) not in nan:
            opt.step()


def _mean(replicas: list[nn.Module]) -> torch.Tensor:
    return torch.stack([_flat(r) for r in replicas]).sum(0) / len(replicas)


def local_sgd(
    steps: int,
    workers: int,
    period: int,
    warmup_steps: int = 0,
    model: str = "cnn",
    nan: Iterable[tuple[int, int]] = (),
    ranks_per_replica: int = 1,
) -> tuple[nn.Module, int]:
    """Post-local SGD: every replica steps on its own batch; the replicas are averaged after
    every step of the warm-up, then every ``period`` steps, and once more at the end if the
    last step was not an averaging one. ``workers`` replicas of ``ranks_per_replica`` workers
    each (a node replica: the node's batches together). Returns (worker 0's replica, number
    of averages)."""
    replicas, opts = _replicas(workers, model)
    data, nan, averages = streams(workers * ranks_per_replica), set(nan), 0

    def due(step: int) -> bool:
        return step <= warmup_steps or step % period == 0

    for step in range(1, steps + 1):
        _local_steps(replicas, opts, data, step, nan)
        if due(step):
            mean = _mean(replicas)
            for r in replicas:
                _assign(r, mean)
            averages += 1
    if not due(steps):
        mean = _mean(replicas)
        for r in replicas:
            _assign(r, mean)
        averages += 1
    return replicas[0], averages


def diloco(
    steps: int,
    workers: int,
    period: int,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
    model: str = "cnn",
    ranks_per_replica: int = 1,
    warmup_steps: int = 0,
    adamw_lr: float = 0.0,
    desloc: tuple[int, int] = (0, 0),
) -> tuple[nn.Module, int]:
    """DiLoCo (inner AdamW of lr ``adamw_lr``, β1 = MOMENTUM, when set; SGD otherwise). DES-LOC
    (``desloc`` = (K1, K2)): every K1 (K2) periods, after that step's outer step, each
    parameter's Adam exp_avg (exp_avg_sq) becomes the replicas' average of it.
    After each of the first ``warmup_steps`` steps every replica and θ_global
    become the replicas' average (no outer optimizer); then, counting from there, every
    ``period`` steps (and at the end) the outer optimizer (SGD with
    momentum, Nesterov or not) steps θ_global with the pseudo-gradient θ_global − mean of the
    replicas; every replica restarts from θ_global. ``workers`` replicas of
    ``ranks_per_replica`` workers each, as for :func:`local_sgd`. Returns (θ_global as a
    model, outer steps)."""
    replicas, opts = _replicas(workers, model)
    if adamw_lr:
        opts = [torch.optim.AdamW(r.parameters(), lr=adamw_lr, betas=(MOMENTUM, 0.999),
                                  weight_decay=0.0) for r in replicas]  # fmt: skip
    data = streams(workers * ranks_per_replica)
    theta = nn.Parameter(_flat(replicas[0]).clone())
    outer = torch.optim.SGD(
        [theta], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
    )
    outer_steps = 0

    def outer_step() -> None:
        nonlocal outer_steps
        theta.grad = theta.detach() - _mean(replicas)
        outer.step()
        for r in replicas:
            _assign(r, theta.detach())
        outer_steps += 1

    for step in range(1, steps + 1):
        _local_steps(replicas, opts, data, step, set())
        if step <= warmup_steps:
            mean = _mean(replicas)
            theta.data.copy_(mean)
            for r in replicas:
                _assign(r, mean)
        elif (step - warmup_steps) % period == 0:
            outer_step()
            for key, every in zip(("exp_avg", "exp_avg_sq"), desloc, strict=True):
                if every and (step - warmup_steps) % (period * every) == 0:
                    for params in zip(*(r.parameters() for r in replicas), strict=True):
                        states = [o.state[p][key] for o, p in zip(opts, params, strict=True)]
                        mean = torch.stack(states).sum(0) / len(states)
                        for s in states:
                            s.copy_(mean)
    if steps > warmup_steps and (steps - warmup_steps) % period:
        outer_step()
    return replicas[0], outer_steps


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
    tensor_bounds = [0, *cuts, len(ends)]
    elements = [0, *ends]
    return [
        (elements[a], elements[b])
        for a, b in zip(tensor_bounds[:-1], tensor_bounds[1:], strict=True)
    ]


def streaming_diloco(
    steps: int,
    workers: int,
    period: int,
    fragments: int,
    delay: int,
    alpha: float,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
    model: str = "cnn",
) -> tuple[nn.Module, int]:
    """Streaming DiLoCo (Douillard et al. 2025): θ is cut into F fragments; fragment k is sent
    after the steps t with t mod H = ((k+1)·H // F) mod H (the sum of the replicas' fragment
    as it is then) and applied τ = ``delay`` steps later: the pseudo-gradient g = θ_g,k − sum/W
    goes through fragment k's own outer SGD (b ← g, then b ← μb + g; d = g + μb with Nesterov,
    else b; θ_g,k ← θ_g,k − lr·d), and every replica's fragment becomes
    α·(its fragment now) + (1 − α)·θ_g,k. At the end, fragments still in flight are applied,
    then every fragment not replaced by θ_g,k at the last step gets one more outer step with
    no delay and no mixing. Returns (worker 0's replica, fragment syncs)."""
    replicas, opts = _replicas(workers, model)
    data = streams(workers)
    ranges = fragment_ranges(replicas[0], fragments)
    theta = [_flat(replicas[0])[a:b].clone() for a, b in ranges]
    momentum: list[torch.Tensor | None] = [None] * fragments
    offsets = [((k + 1) * period // fragments) % period for k in range(fragments)]
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}
    last_replaced = [0] * fragments
    syncs = 0

    def start(k: int, step: int, wait: int) -> None:
        nonlocal syncs
        a, b = ranges[k]
        in_flight[k] = (step + wait, sum(_flat(r)[a:b] for r in replicas))
        syncs += 1

    def apply(k: int, step: int, mix: float) -> None:
        a, b = ranges[k]
        _, total = in_flight.pop(k)
        g = theta[k] - total / workers
        momentum[k] = g.clone() if momentum[k] is None else outer_momentum * momentum[k] + g
        d = g + outer_momentum * momentum[k] if nesterov and outer_momentum > 0 else momentum[k]
        theta[k] = theta[k] - outer_lr * d
        for r in replicas:
            vector = _flat(r)
            vector[a:b] = mix * vector[a:b] + (1 - mix) * theta[k] if mix else theta[k]
            _assign(r, vector)
        if not mix:
            last_replaced[k] = step

    for step in range(1, steps + 1):
        _local_steps(replicas, opts, data, step, set())
        for k in range(fragments):
            if step % period == offsets[k]:
                start(k, step, delay)
        for k in sorted(in_flight):
            if in_flight[k][0] == step:
                apply(k, step, alpha)
    for k in sorted(in_flight):
        apply(k, steps, alpha)
    for k in range(fragments):
        if last_replaced[k] != steps:
            start(k, steps, 0)
            apply(k, steps, 0.0)
    return replicas[0], syncs


# ---------------------------------------------------------------------------- parameter servers
class Server:
    """θ on the parameter servers with its version clock. A push computed against version
    ``base`` has staleness ``version − base``; staler than ``max_staleness`` it is dropped,
    else applied with the factor s = 1/max(1, staleness) when scaling (1 otherwise):
    add: θ += λ·s·Δ; sgd / adagrad: that torch optimizer steps θ with the gradient −s·Δ."""

    def __init__(self, theta, rule, lr, momentum=0.0, max_staleness=None, scaling=False):
        self.theta = nn.Parameter(theta.clone(), requires_grad=False)
        self.rule, self.lr, self.scaling, self.max_staleness = rule, lr, scaling, max_staleness
        self.version = self.dropped = self.staleness_sum = self.staleness_max = 0
        if rule == "sgd":
            self.opt = torch.optim.SGD([self.theta], lr=lr, momentum=momentum)
        elif rule == "adagrad":
            self.opt = torch.optim.Adagrad([self.theta], lr=lr)

    def push(self, delta: torch.Tensor, base: int) -> None:
        staleness = self.version - base
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.dropped += 1
            return
        scale = 1.0 / max(1, staleness) if self.scaling else 1.0
        with torch.no_grad():
            if self.rule == "add":
                self.theta.add_(delta, alpha=self.lr * scale)
            else:
                self.theta.grad = delta.mul(-scale)
                self.opt.step()
                self.theta.grad = None
        self.version += 1
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)


class AsgdWorker:
    """One asgd worker against the servers (``server``: :class:`Server`'s settings).

    Every ``n_push`` steps it pushes Δ = θ_local − θ_ref (its progress since the last push or
    fetch); every ``n_fetch`` steps it fetches θ (after its push, when both are due), keeping
    the progress it has not pushed yet; when it finishes it pushes what is left."""

    def __init__(self, n_fetch: int, n_push: int, model: str = "cnn", **server):
        self.n_fetch, self.n_push, self.model_name = n_fetch, n_push, model
        self.model = fresh_model(model)
        self.opt = _sgd(self.model)
        self.server = Server(_flat(self.model), **server)
        [self.data] = streams(1)
        self.reference, self.base, self.step = _flat(self.model), 0, 0

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
            local = _flat(self.model)
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
        _assign(self.model, self.server.theta.detach() + pending)
        self.reference, self.base = self.server.theta.detach().clone(), self.server.version

    def finish(self) -> None:
        if self.step % self.n_push:
            self.server.push(_flat(self.model) - self.reference, self.base)

    def resume(self, checkpoint: dict) -> None:
        """A resumed run: the worker's optimizer, data position and step from its checkpoint,
        its θ from the servers (which kept theirs)."""
        self.opt.load_state_dict(checkpoint["optimizer"])
        self.data.load_state_dict(checkpoint["stream"])
        self.step = checkpoint["step"]
        self._fetch(0)

    def global_model(self) -> nn.Module:
        out = fresh_model(self.model_name)
        _assign(out, self.server.theta.detach())
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
    """One EASGD worker: every τ steps (and at the end) e = α(θ_i − θ̃); θ_i −= e; θ̃ += e.
    Returns the centre θ̃ as a model."""
    m = fresh_model(model)
    opt = _sgd(m)
    centre = _flat(m)
    [data] = streams(1)

    def exchange() -> None:
        nonlocal centre
        local = _flat(m)
        e = (local - centre) * alpha
        _assign(m, local - e)
        centre = centre + e

    for step in range(1, steps + 1):
        opt.zero_grad()
        _loss(m, next(data)).backward()
        opt.step()
        if step % tau == 0:
            exchange()
    if steps % tau:
        exchange()
    out = fresh_model(model)
    _assign(out, centre)
    return out


def asgd_one_round(
    steps: int, replicas: int, ranks_per_replica: int, server_lr: float, model: str = "cnn"
) -> nn.Module:
    """asgd where every replica pushes once, after ``steps`` local steps (n_sync = steps): the
    add rule θ ← θ + λ·Δ_i makes the servers' θ the same in any push order,
    θ0 + λ·Σ_i (θ_i − θ0). Node replicas step on their G workers' batches together."""
    models, opts = _replicas(replicas, model)
    theta0 = _flat(models[0]).clone()
    data = streams(replicas * ranks_per_replica)
    for step in range(1, steps + 1):
        _local_steps(models, opts, data, step, set())
    out = fresh_model(model)
    _assign(out, theta0 + server_lr * sum(_flat(m) - theta0 for m in models))
    return out
