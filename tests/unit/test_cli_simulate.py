"""``cloudburst simulate``: its flags, its one-line errors, a single run and a sweep, with
``cloudburst.sim.run.simulate`` replaced by one that writes canned summaries (no process,
no training)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from cloudburst import cli
from cloudburst.config import RunConfig
from cloudburst.config.simulation import SimulationConfig
from cloudburst.records.metrics import write_json_atomic
from cloudburst.sim.sweep import parse_sweep, sweep_report

SMALL = [
    "--dataset", "synthetic", "--train-size", "512", "--test-size", "32",
    "--batch-size", "8", "--steps", "5", "--no-progress",
]  # fmt: skip
CLOCK_FLAGS = """--step-time-s --step-time-per-sample-s --calibrate --step-time-jitter
--intra-node-link --server-apply-gbyte-per-s --modelled-params --modelled-step-time-s --profile
--sweep --strategies --seeds""".split()


def canned(cfg: RunConfig, sim: SimulationConfig) -> dict:
    """A summary as the simulator writes it: asgd at 4 workers with seed 1 never reaches the
    target (censored at its end, 50 virtual s)."""
    never = cfg.job.strategy == "asgd" and cfg.job.workers == 4 and cfg.training.seed == 1
    summary = {
        "strategy": cfg.job.strategy,
        "workers": cfg.job.workers,
        "servers": cfg.job.servers,
        "simulated": True,
        "final_test_accuracy": 0.8 if never else 0.9 + 0.01 * cfg.training.seed,
        "wall_time_s": 50.0,
        "target_accuracy": cfg.metrics.target_accuracy,
        "time_to_target_s": None if never else 10.0 * cfg.job.workers + cfg.training.seed,
        "samples": 0,
        "sent_bytes": 0,
        "mean_staleness_versions": None,
        "lost_workers": [],
        "clock_model": {"settings": sim.to_dict(), "time_unit": "virtual seconds"},
        "config": cfg.to_dict(),
    }
    write_json_atomic(Path(cfg.output.out) / "summary.json", summary)
    return summary


class SimulationFailed(RuntimeError):
    pass


@pytest.fixture
def simulated(monkeypatch):
    """Replace cloudburst.sim.run with a module whose simulate records its calls."""
    calls: list[tuple[RunConfig, SimulationConfig]] = []

    def simulate(cfg, sim):
        calls.append((cfg, sim))
        if cfg.training.lr == 7.0:  # a run that fails: its partial summary says so
            failed = {**canned(cfg, sim), "failed": "worker 1: loss is nan"}
            write_json_atomic(Path(cfg.output.out) / "summary.json", failed)
            raise SimulationFailed("the simulated job failed: worker 1: loss is nan")
        return canned(cfg, sim)

    module = types.ModuleType("cloudburst.sim.run")
    module.simulate = simulate
    module.SimulationFailed = SimulationFailed
    monkeypatch.setitem(sys.modules, "cloudburst.sim.run", module)
    return calls


def test_help_lists_the_clock_and_sweep_flags_and_train_has_none(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in [*CLOCK_FLAGS, "--strategy", "--workers", "--inter-node-link", "--config"]:
        assert flag in text
    assert "--resume" not in text
    assert "0.9 here" in text  # --target-accuracy's default under simulate
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    assert [flag for flag in CLOCK_FLAGS if flag in text] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep", "wrkers=2,4"], "sweep: unknown field 'wrkers'; did you mean 'workers'?"),
        (["--sweep", "workers"], "is not FIELD=V1,V2"),
        (["--sweep", "workers=2,two"], "workers: 'two' is not a valid int"),
        (["--sweep", "seed=0,1"], "use --seeds"),
        (["--sweep", "inject_fault=a,b"], "is a list and cannot be swept"),
        (["--sweep", "workers=0,2"], "workers: 0 is not allowed"),
        (["--step-time-jitter", "normal:1"], "is not lognormal:CV or pareto:ALPHA"),
        (["--step-time-s", "1", "--calibrate"], "calibrate: cannot be combined"),
        (["--strategy", "sync", "--strategies", "sync,asgd"], "give --strategy"),
        (["--seeds", "0,x"], "seeds: 'x' is not allowed"),
        (["--workers", "0"], "workers: 0 is not allowed"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, message, simulated, tmp_path, capsys):
    code = cli.main(["simulate", *SMALL, "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("cloudburst: invalid config: ")
    assert simulated == []  # nothing ran


def test_a_single_run_calls_simulate_and_prints_virtual_seconds(
    simulated, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["simulate", *SMALL, "--strategy", "asgd", "--workers", "3"]
    code = cli.main([*argv, "--profile", "resnet50-v100", "--step-time-jitter", "pareto:3"])
    assert code == 0
    [(cfg, sim)] = simulated
    assert cfg.job.strategy == "asgd" and cfg.job.workers == 3 and cfg.job.servers == 1
    assert cfg.metrics.target_accuracy == 0.9  # simulate's default
    assert sim.profile == "resnet50-v100" and sim.step_time_jitter == "pareto:3"
    out = Path(cfg.output.out)
    assert out.parent.name == "runs" and out.name.startswith("sim-asgd-")
    assert (out / ".cloudburst-run").is_file()  # the run directory was prepared
    table = capsys.readouterr().out
    assert "virtual s" in table and "wall s" not in table


@pytest.mark.slow
def test_a_sweep_writes_the_table_json_and_plots(simulated, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["simulate", *SMALL, "--out", str(out), "--step-time-s", "0.1"]
    argv += ["--sweep", "workers=2,4", "--strategies", "sync,asgd", "--seeds", "0,1"]
    assert cli.main(argv) == 0
    assert len(simulated) == 8
    assert {(c.job.strategy, c.job.workers, c.training.seed) for c, _ in simulated} == {
        (s, w, k) for s in ("sync", "asgd") for w in (2, 4) for k in (0, 1)
    }
    assert all(sim.step_time_s == 0.1 for _, sim in simulated)
    assert (out / "asgd-workers=4-seed1" / "summary.json").is_file()
    for name in ("sweep.md", "sweep.json", "sweep_time_to_target.png", "sweep_accuracy.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    report = json.loads((out / "sweep.json").read_text())
    assert report["field"] == "workers" and report["target_accuracy"] == 0.9
    assert report["not_reached"] == 1
    cells = {(c["strategy"], c["value"]): c for c in report["cells"]}
    assert set(cells) == {("sync", 2), ("sync", 4), ("asgd", 2), ("asgd", 4)}
    assert cells["sync", 4]["time_to_target_mean_s"] == pytest.approx(40.5)
    assert cells["sync", 4]["final_accuracy_mean"] == pytest.approx(0.905)
    censored = cells["asgd", 4]
    assert (censored["reached"], censored["not_reached"]) == (1, 1)
    assert censored["time_to_target_mean_s"] == 40.0  # the censored run is not averaged in
    assert censored["not_reached_by_s"] == 50.0
    table = (out / "sweep.md").read_text()
    assert "| asgd | 4 | 40.0; 1 of 2 > 50.0, not reached | 1/2 |" in table
    assert "| sync | 2 | 20.5 ± 0.7 | 2/2 | 0.9050 ± 0.0071 | 0,1 |" in table
    assert "1 did not reach 0.9" in table
    printed = capsys.readouterr()
    assert "| sync | 4 |" in printed.out
    assert "1 of 8 runs did not reach" in printed.err


def test_a_clock_field_can_be_swept_and_the_report_remade_from_the_summaries_alone(
    simulated, tmp_path
):
    out = tmp_path / "sweep"
    argv = ["simulate", *SMALL, "--out", str(out), "--inter-node-link", "1"]
    assert cli.main([*argv, "--sweep", "intra-node-link=100:0.01,none"]) == 0
    assert [sim.intra_node_link for _, sim in simulated] == ["100,0.01", None]
    assert all(cfg.cluster.inter_node_link == "1" for cfg, _ in simulated)
    report = json.loads((out / "sweep.json").read_text())
    assert [c["value"] for c in report["cells"]] == ["100,0.01", None]
    assert (out / "sync-intra_node_link=100-0.01-seed0" / "summary.json").is_file()
    (out / "sweep.json").unlink()
    again = sweep_report(out, "intra_node_link")
    assert again.pop("plots") and json.loads((out / "sweep.json").read_text()) == report


def test_strategies_alone_make_a_sweep_without_a_field(simulated, tmp_path):
    out = tmp_path / "s"
    assert cli.main(["simulate", *SMALL, "--out", str(out), "--strategies", "sync,gossip"]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["gossip-seed0", "sync-seed0"]
    report = json.loads((out / "sweep.json").read_text())
    assert report["field"] is None and len(report["cells"]) == 2


def test_parse_sweep_types_values_by_field():
    assert parse_sweep("workers=2,4,128") == ("workers", [2, 4, 128])
    assert parse_sweep("lr=0.1,0.05") == ("lr", [0.1, 0.05])
    assert parse_sweep("step-time-s=0.1,none") == ("step_time_s", [0.1, None])
    assert parse_sweep("gossip_push_sum=true,false") == ("gossip_push_sum", [True, False])
    assert parse_sweep("inter_node_link=1:2,10") == ("inter_node_link", ["1,2", "10"])


def test_plot_labels_a_simulated_runs_time_as_virtual(tmp_path):
    from cloudburst.cli.plot import plot_runs, time_axis_label

    runs = []
    for name, simulated in (("sim", True), ("real", False)):
        run = tmp_path / name
        (run / "metrics").mkdir(parents=True)
        record = {"event": "eval", "time_s": 1.0, "samples": 64, "test_accuracy": 0.5}
        (run / "metrics" / "rank0.jsonl").write_text(json.dumps(record) + "\n")
        summary = {"strategy": "sync", "workers": 2, "servers": 0, "simulated": simulated}
        (run / "summary.json").write_text(json.dumps(summary))
        runs.append(str(run))
    assert time_axis_label(runs[:1]) == "virtual time (s)"
    assert time_axis_label(runs[1:]) == "wall time (s)"
    assert "virtual for simulated runs" in time_axis_label(runs)
    assert plot_runs(runs[:1], str(tmp_path / "c.png")).is_file()


def test_a_failed_run_exits_1_with_one_line_and_a_sweep_goes_on(simulated, tmp_path, capsys):
    code = cli.main(["simulate", *SMALL, "--out", str(tmp_path / "o"), "--lr", "7"])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "cloudburst: the simulated job failed: worker 1: loss is nan"
    ]
    # a sweep runs the rest and lists the failed run
    out = tmp_path / "sweep"
    assert cli.main(["simulate", *SMALL, "--out", str(out), "--sweep", "lr=0.1,7"]) == 1
    assert len(simulated) == 1 + 2
    report = json.loads((out / "sweep.json").read_text())
    assert [c["value"] for c in report["cells"]] == [0.1]
    assert report["failed"] == [{"run": "sync-lr=7.0-seed0", "failed": "worker 1: loss is nan"}]
    assert "failed, not in the table: sync-lr=7.0-seed0" in (out / "sweep.md").read_text()
    assert "1 of 2 runs failed" in capsys.readouterr().err
