"""A strategy is a complete plug-in: two written into a temporary package outside cloudburst,
registered with ``register_strategy`` and run on the virtual cluster — a worker-side one (θ
averaged every step) and a server-side one (its own shard rule, summary field and column) —
against the built-in sync and asgd runs."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from cloudburst.config import RunConfig
from cloudburst.loop.summary import format_summary
from cloudburst.strategies import REGISTRY, register_strategy
from tests.support import run_sim, saved_state

pytestmark = pytest.mark.slow

PLUGIN = {
    "__init__.py": '''
        from cloudburst.strategies.asgd import Asgd
        from cloudburst.strategies.spec import StrategySpec


        class Average(StrategySpec):
            """Every worker steps on its own batch, then θ is averaged over the workers."""

            name = "toy_average"
            worker = "toy_plugin.worker:AverageWorker"


        class HalfPush(Asgd):
            """asgd's workers; the shards add half of each push, and report their pushes."""

            name = "toy_half"
            rule = "toy_plugin.rule:from_config"
            summary = "toy_plugin.rule:summary"
            report_columns = (("pushes", "toy_pushes", "{}"),)
    ''',
    "worker.py": """
        from cloudburst.comm.collectives import all_reduce_sum
        from cloudburst.comm.flat import assign_flat, flatten_params
        from cloudburst.strategies.base import Strategy
        from toy_plugin import Average


        class AverageWorker(Average, Strategy):
            def wrap(self, model, optimizer):
                self.model = model
                return model

            def after_step(self, samples):
                self.local_steps += 1
                flat = flatten_params(self.model)
                all_reduce_sum(flat, self.ctx.workers_group, self.stats, comm=self.ctx.comm)
                assign_flat(self.model, flat.div_(self.cfg.job.workers))

            def global_params(self):
                return self.replica_params()
    """,
    "rule.py": """
        from cloudburst.strategies.asgd.rules import AddRule


        class HalfRule(AddRule):
            name = "half"

            def alpha(self, factor):
                return 0.5 * factor


        def from_config(cfg):
            return HalfRule(cfg.asgd.server_lr)


        def summary(servers):
            return {"toy_pushes": sum(s["version"] for s in servers)}
    """,
}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    package = tmp_path / "plugin" / "toy_plugin"
    package.mkdir(parents=True)
    for name, text in PLUGIN.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(package.parent))
    import toy_plugin

    for spec in (toy_plugin.Average, toy_plugin.HalfPush):
        monkeypatch.setitem(REGISTRY, spec.name, spec)  # a new key: removed at the test's end
        register_strategy(spec)
    yield toy_plugin
    for name in [m for m in sys.modules if m.partition(".")[0] == "toy_plugin"]:
        del sys.modules[name]  # its modules go with its path


def run(tmp_path, name: str, strategy: str, **kw) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tmp_path / name
    cfg = RunConfig(strategy=strategy, dataset="synthetic", model="mlp", batch_size=16,
                    momentum=0.0, seed=3, eval_every_s=1000.0, out=str(out), **kw)  # fmt: skip
    return run_sim(cfg), saved_state(out)


def test_a_worker_plugin_averaging_every_step_trains_as_sync(plugin, tmp_path):
    # Plain SGD: averaging θ_i = θ − η g_i after each step is θ − η·mean(g), sync's step.
    toy, toy_model = run(tmp_path, "toy", "toy_average", workers=3, steps=12, lr=0.1)
    sync, sync_model = run(tmp_path, "sync", "sync", workers=3, steps=12, lr=0.1)
    torch.testing.assert_close(toy_model, sync_model, rtol=0, atol=1e-5)  # same keys, close
    assert toy["strategy"] == "toy_average" and toy["samples"] == sync["samples"] == 3 * 12 * 16
    assert "mean_staleness_versions" not in toy  # no shards, no shard fields
    assert toy["sent_bytes"] == sync["sent_bytes"] > 0  # one ring all-reduce of θ a step each


def test_a_server_rule_plugin_steps_its_shards_and_writes_its_summary(plugin, tmp_path):
    # One worker pushing after every step: θ ← θ + ½Δ = θ − (η/2)g, SGD at half the lr —
    # the worker's rebuilt θ (an overlapped reply) as the shard's, or the two would part.
    half, half_model = run(tmp_path, "half", "toy_half", workers=1, steps=10, lr=0.2,
                           server_lr=1.0, n_fetch=1, n_push=1)  # fmt: skip
    sgd, sgd_model = run(tmp_path, "sgd", "sync", workers=1, steps=10, lr=0.1)
    torch.testing.assert_close(half_model, sgd_model, rtol=0, atol=1e-5)
    assert half["toy_pushes"] == 10 and "max_staleness_versions" not in half
    table = format_summary([half, sgd]).splitlines()
    assert table[0].split()[-2:] == ["pushes", "lost"]
    assert table[1].split()[-2:] == ["10", "[]"] and table[2].split()[-2:] == ["-", "[]"]
