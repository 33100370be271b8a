"""The GPT (cloudburst/models/gpt.py) and the language-model recipe: shapes, causality, tied
weights, the parameter count, the spec; AdamW, warm-up + cosine and clipping against their formulas;
the loss and bits-per-byte accounting; the recipe's defaults."""

from __future__ import annotations

import math

import pytest
import torch

from cloudburst.config import ConfigError, RunConfig
from cloudburst.data import Dataset, bits_per_byte, evaluate_dataset, lm_loss
from cloudburst.data.datasets import TokenWindows
from cloudburst.loop.train_step import clip_gradients, make_optimizer, make_scheduler
from cloudburst.models import ModelError, build_model
from cloudburst.models.gpt import GPT, parse_gpt_spec
from cloudburst.records.metrics import MetricsWriter, read_jsonl, time_to_target_loss

SPEC = "gpt:layers=2,width=32,heads=4"


def _gpt(context: int = 16, seed: int = 0) -> GPT:
    return build_model(SPEC, (context,), 256, seed)


def test_logits_have_one_row_per_position_and_token():
    model = _gpt()
    x = torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, 256)
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter windows are fine
    with pytest.raises(ValueError, match="longer than the context 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_a_later_token_changes_no_earlier_logit():
    model = _gpt().eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert (a[:, 9:] - b[:, 9:]).abs().amax(-1).min() > 1e-4  # every later position sees it


def test_output_layer_is_the_token_embedding_and_the_parameter_count_is_exact():
    model = _gpt(context=16)
    assert model.head.weight is model.tok.weight
    v, t, d, layers = 256, 16, 32, 2
    expected = v * d + t * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert sum(p.numel() for p in model.parameters()) == expected
    default = build_model("gpt", (64,), 256, 0)
    assert sum(p.numel() for p in default.parameters()) == 120_576  # docs/lm.md


def test_the_same_seed_builds_the_same_model_and_the_spec_is_checked():
    a, b, c = _gpt(seed=3), _gpt(seed=3), _gpt(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok.weight, c.tok.weight)
    assert parse_gpt_spec("gpt:layers=3") == {"layers": 3, "width": 64, "heads": 4}
    for bad, words in [
        ("gpt:depth=2", "not KEY=N"),
        ("gpt:layers=two", "not an integer"),
        ("gpt:width=30,heads=4", "not a multiple"),
        ("gpt:layers=0", ">= 1"),
    ]:
        with pytest.raises(ModelError, match=words):
            build_model(bad, (16,), 256, 0)
    with pytest.raises(ModelError, match="windows of tokens"):
        build_model("gpt", (3, 32, 32), 10, 0)


# ---------------------------------------------------------------------------- the recipe
def _cfg(**kw) -> RunConfig:
    return RunConfig(model="gpt", dataset="text:stdlib", **kw)


def test_gpt_runs_default_to_the_recipe_and_other_models_do_not():
    cfg = _cfg(strategy="diloco", workers=4)
    t = cfg.training
    assert (t.optimizer, t.lr, t.lr_schedule, t.warmup_steps) == ("adamw", 4.2e-3, "cosine", 30)
    assert (t.clip_grad_norm, t.weight_decay, t.batch_size, cfg.data.context) == (1.0, 0.1, 16, 64)
    # DiLoCo's outer step over the GPT is plain averaging (docs/lm.md); classifiers keep theirs.
    assert cfg.diloco.outer_lr == 1.0 and cfg.diloco.outer_momentum == 0.0 and cfg.diloco.nesterov
    given = _cfg(strategy="diloco", workers=4, diloco_outer_lr=0.7, diloco_outer_momentum=0.9)
    assert (given.diloco.outer_lr, given.diloco.outer_momentum) == (0.7, 0.9)
    assert cfg.training.steps == 300 and cfg.metrics.eval_every_s == 15.0
    plain = RunConfig()
    p = plain.training
    assert (p.optimizer, p.lr, p.clip_grad_norm, p.batch_size) == ("sgd", 0.1, 0, 64)
    assert p.epochs == 64.0 and plain.metrics.eval_every_s == 1.0
    assert _cfg(optimizer="sgd", lr=0.5).training.lr == 0.5  # a given value wins
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="language model; use --dataset text"):
        RunConfig(model="gpt")
    with pytest.raises(ConfigError, match="'cnn' is not a language model"):
        RunConfig(model="cnn", dataset="text:stdlib")


def test_adamw_decays_decoupled_from_the_adam_step():
    cfg = _cfg(lr=0.01, weight_decay=0.1, momentum=0.9)
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = make_optimizer(cfg, [theta])
    ref, m, v = theta.detach().clone(), torch.zeros(3), torch.zeros(3)
    for t in range(1, 4):
        grad = torch.tensor([0.5, -1.0, 2.0]) * t
        theta.grad = grad.clone()
        opt.step()
        ref = ref * (1 - 0.01 * 0.1)  # decoupled: not through the moments
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        ref = ref - 0.01 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
        torch.testing.assert_close(theta.detach(), ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("schedule, warmup", [("cosine", 4), ("constant", 4), ("cosine", 0)])
def test_linear_warmup_then_the_schedule(schedule, warmup):
    """Cosine decays from lr to 0 at the run's end (lr after k of the T steps past the
    warm-up: lr · (1 + cos(πk/T)) / 2); no warm-up and no schedule: no scheduler."""
    cfg = _cfg(lr=0.2, warmup_steps=warmup, lr_schedule=schedule)
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    sched = make_scheduler(cfg, opt, total_steps=12)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    warm = [0.2 * (1 / 4 + (1 - 1 / 4) * k / 4) for k in range(warmup)]
    t = 12 - warmup
    after = [0.1 * (1 + math.cos(math.pi * k / t)) for k in range(t + 1)]
    assert lrs == pytest.approx(warm + (after if schedule == "cosine" else [0.2] * 9), abs=1e-12)
    assert make_scheduler(RunConfig(), opt, 10) is None


def test_clipping_scales_the_global_norm_down_only():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([a, b], lr=1.0)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # norm 5
    clip_gradients(opt, 1.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.0, 0.8]))
    clip_gradients(opt, 2.0)  # already below: unchanged
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.0, 0.8]))
    a.grad = torch.tensor([30.0, 0.0])
    clip_gradients(opt, 0.0)  # off
    assert a.grad[0] == 30.0


# ---------------------------------------------------------------------------- loss accounting
class _Fixed(torch.nn.Module):
    """Logits that put probability p on the target token and spread 1 − p over the rest."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        rest = math.log((1 - self.p) / 255)
        logits = torch.full((*x.shape, 256), rest)
        return logits.scatter(-1, ((x + 1) % 256).unsqueeze(-1), math.log(self.p))


def test_test_loss_is_nats_per_token_and_bits_per_byte_its_base_2():
    x = torch.randint(0, 256, (5, 8), generator=torch.Generator().manual_seed(0))
    y = (x + 1) % 256
    test = TokenWindows(x, y)
    acc, loss = evaluate_dataset(_Fixed(0.25), test, None, batch=16)
    assert acc == 1.0 and loss == pytest.approx(math.log(4), abs=1e-6)
    assert bits_per_byte(loss) == pytest.approx(2.0, abs=1e-6)
    wrong = TokenWindows(x, (x + 2) % 256)  # the target gets (1 − p)/255
    acc, loss = evaluate_dataset(_Fixed(0.25), wrong, None, batch=8)
    assert acc == 0.0 and loss == pytest.approx(-math.log(0.75 / 255), abs=1e-6)
    # the mean is over all 40 tokens whatever the batch: 3 windows of one kind, 2 of the other
    mixed = TokenWindows(x, torch.cat([y[:3], ((x + 2) % 256)[3:]]))
    expected = (24 * math.log(4) - 16 * math.log(0.75 / 255)) / 40
    losses = [evaluate_dataset(_Fixed(0.25), mixed, None, batch=b)[1] for b in (8, 16, 1000)]
    assert losses == pytest.approx([expected] * 3, abs=1e-6)
    uniform = lm_loss(torch.zeros(2, 3, 256), torch.zeros(2, 3, dtype=torch.int64))
    assert uniform.item() == pytest.approx(math.log(256))  # equal logits: log V nats
    assert not Dataset(test, test, 256, (8,)).is_lm  # only a token stream for training is


def test_eval_records_of_a_language_model_carry_bits_per_byte(tmp_path):
    writer = MetricsWriter(tmp_path, 0, "worker0")
    writer.log("eval", time_s=1.0, test_loss=math.log(2))
    writer.language_model = True
    writer.log("eval", time_s=2.0, test_loss=math.log(2))
    writer.log("step", step=1, loss=1.0)
    writer.close()
    records = read_jsonl(tmp_path / "metrics" / "rank0.jsonl")
    assert "bits_per_byte" not in records[0] and "bits_per_byte" not in records[2]
    assert records[1]["bits_per_byte"] == pytest.approx(1.0)


def test_time_to_target_loss_must_hold_for_three_evaluations():
    evals = [[1.0, 3.0], [2.0, 2.0], [3.0, 2.1], [4.0, 1.9], [5.0, 1.8], [6.0, 2.0]]
    assert time_to_target_loss(evals, 2.0) == 4.0  # 2.0 at t=2 is broken by 2.1 at t=3
    assert time_to_target_loss(list(reversed(evals)), 2.0) == 4.0  # sorted by time
    assert time_to_target_loss(evals, 1.85) is None  # held once only
    assert time_to_target_loss(evals, 1.85, k=1) == 5.0
    assert time_to_target_loss(evals, None) is None
