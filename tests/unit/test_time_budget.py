"""``--max-train-time-s``: the config, lockstep workers' agreement (on ThreadComm threads) and
whole jobs on the virtual cluster, where every stopping step is exact."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cloudburst.comm.stats import CommStats
from cloudburst.config import ConfigError, RunConfig, Straggler
from cloudburst.loop.budget import MAX_CHECK_INTERVAL, TimeBudget
from tests.support import FakeNamespace, ThreadComm, on_comm_threads, rank_events, run_sim


# ---------------------------------------------------------------------------- config
def test_no_budget_by_default_and_text_is_refused():
    """(A budget set: test_cli_flags_generated; negative or infinite ones: test_config_ranges.)"""
    assert RunConfig().training.max_train_time_s == 0
    with pytest.raises(ConfigError, match=r"^max_train_time_s: '10' is not allowed; use a number"):
        RunConfig(max_train_time_s="10")


# ---------------------------------------------------------------------------- the agreement
# Two lockstep workers, each on a thread whose transport is a ThreadComm (its clock reads 0:
# the checks take no time). Worker 0's clock is the one agreed on; worker 1 contributes 0.
def _both_workers(budget_s: float, steps: int, step_s, rates=(1.0, 1.0)) -> list[SimpleNamespace]:
    """Both workers run up to ``steps`` steps, step k taking ``step_s(k)``, worker k's own clock
    ``rates[k]`` × that time, asking the budget after each; each one's last step, the steps
    that checked, its budget, strategy and all-reduces (transport calls)."""

    def worker(index: int, comm: ThreadComm) -> SimpleNamespace:
        now, checked, last = [0.0], [], steps
        training = SimpleNamespace(max_train_time_s=budget_s)
        ctx = FakeNamespace(cfg=SimpleNamespace(training=training), comm=comm, num_workers=2,
                            worker_index=index, num_servers=0, link=None, num_nodes=1,
                            elapsed_s=lambda: rates[index] * now[0])  # fmt: skip
        strategy = SimpleNamespace(lockstep=True, stats=CommStats())
        budget = TimeBudget(ctx, strategy)
        for step in range(1, steps + 1):
            now[0] += step_s(step)
            before = budget.checks
            if budget.over(step, steps):
                last = step
                checked.append(step)
                break
            if budget.checks > before:
                checked.append(step)
        all_reduces = sum(call[0] == "all_reduce" for call in comm.calls)
        return SimpleNamespace(last=last, checked=checked, budget=budget, strategy=strategy,
                               all_reduces=all_reduces)  # fmt: skip

    return on_comm_threads(2, worker)


def test_lockstep_workers_check_rarely_and_stop_at_the_first_step_past_the_budget():
    w0, w1 = _both_workers(7.005, 100_000, lambda step: 0.01)
    assert w0.last == 701  # 7.01 s: the first step whose end is past 7.005 s
    assert w0.budget.stopped_by() == "time_budget"
    # Checks: the first two steps (the pace), every MAX_CHECK_INTERVAL steps while the end
    # is far, then at halvings of what is left, every step at the very end.
    checked = w0.checked
    assert checked[:3] == [1, 2, 2 + MAX_CHECK_INTERVAL] and checked[-3:] == [699, 700, 701]
    assert len(checked) == w0.all_reduces <= 701 // MAX_CHECK_INTERVAL + 12
    assert all(b - a <= MAX_CHECK_INTERVAL for a, b in zip(checked, checked[1:], strict=False))
    assert w0.strategy.stats.sent_bytes > 0  # the check is traffic, counted
    assert (w1.last, w1.checked) == (w0.last, w0.checked)


def test_lockstep_checks_still_stop_at_the_first_step_past_when_steps_slow_down_less_than_2x():
    # 1.9x slower steps from step 300 on: every time crossing 10 s is still checked.
    w0, _ = _both_workers(10.0, 100_000, lambda step: 0.019 if step >= 300 else 0.01)
    crossing = next(s for s in range(1, 100_000) if 2.99 + 0.019 * (s - 299) >= 10.0)
    assert w0.last == crossing


def test_no_budget_never_checks_and_the_last_step_is_never_checked():
    w0, _ = _both_workers(0.0, 50, lambda step: 1.0)
    assert (w0.last, w0.checked) == (50, [])
    w0, _ = _both_workers(1e9, 3, lambda step: 1.0)
    assert w0.last == 3 and w0.checked == [1, 2] and w0.budget.stopped_by() == "steps"


def test_lockstep_workers_stop_at_the_same_step_whatever_their_own_clocks_say():
    # Worker 1's own clock runs 1.5x worker 0's (it evaluated less, started later...): both
    # decide on worker 0's, checked at the same steps, and stop after the same step.
    w0, w1 = _both_workers(2.005, 1000, lambda step: 0.01, rates=(1.0, 1.5))
    assert {0: w0.last, 1: w1.last} == {0: 201, 1: 201}
    assert w0.all_reduces == w1.all_reduces


# ---------------------------------------------------------------------------- virtual cluster
def _sim(out: Path, strategy: str, workers: int, budget_s: float, **kw) -> dict:
    cfg = RunConfig(strategy=strategy, workers=workers, steps=kw.pop("steps", 200),
                    dataset="synthetic", model="mlp", batch_size=8, eval_every_s=1000.0,
                    log_every_steps=1, max_train_time_s=budget_s, out=str(out), **kw)  # fmt: skip
    return run_sim(cfg, server_apply_gbyte_per_s=1e6)  # steps of STEP_S = 0.01 s


@pytest.mark.parametrize(
    "strategy, servers, budget_s, done",
    [
        # W = 4, worker 3 twice as slow: every sync step takes 2T = 0.02 virtual s. A budget of
        # 0.305 s ends training after step 16 (0.32 s), on every rank.
        ("sync", 0, 0.305, {"0": 16, "1": 16, "2": 16, "3": 16}),
        # asgd: workers 0-2 take T = 0.01 s a step, worker 3 twice that; with 0.205 s the first
        # three stop after step 21, the straggler after step 11; the shard then finishes as
        # when the workers' steps run out.
        ("asgd", 1, 0.205, {"1": 21, "2": 21, "3": 21, "4": 11}),
    ],
)
def test_workers_stop_at_the_first_step_past_the_budget_on_the_clock_they_keep(
    tmp_path, strategy, servers, budget_s, done
):
    """Sync's lockstep workers stop together, asgd's each on its own clock."""
    summary = _sim(tmp_path, strategy, 4, budget_s, servers=servers,
                   stragglers=[Straggler(3, 2.0)])  # fmt: skip
    for rank, steps in done.items():
        records = rank_events(tmp_path, int(rank), "step")
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        assert records[-2]["time_s"] < budget_s <= records[-1]["time_s"]
    assert (summary["stopped_by"], summary["max_train_time_s"]) == ("time_budget", budget_s)
    assert summary["steps_done"] == done and summary["steps_per_worker"] == 200
    assert summary["samples"] == sum(done.values()) * 8


def test_a_budget_the_steps_end_before_changes_nothing(tmp_path):
    summary = _sim(tmp_path, "sync", 2, 100.0, steps=20)
    assert summary["stopped_by"] == "steps"
    assert summary["steps_done"] == {"0": 20, "1": 20}
