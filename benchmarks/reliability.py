"""Reliability (issues 5, 16): a fault × role × strategy table, and what the shard standby costs.

    .venv/bin/python benchmarks/reliability.py            # results/reliability.{md,json}
    .venv/bin/python benchmarks/reliability.py --quick    # smoke subset, runs/bench-quick/

Every cell is one real run, one seed, beside an undisturbed run of the same strategy: MNIST-1D,
the MLP, 3 workers (asgd/easgd + 2 server shards), batch 32, steps padded to 20 ms by sleeping
(5 ranks share 2 cores), a checkpoint every 20 steps/versions, ``--heartbeat-timeout-s 3
--comm-timeout-s 20``. Roles: a **worker** (the last one), the **evaluator** (worker 0; for
lockstep strategies rank 0, sync's **store host**), a **shard** (server 1) and asgd's **store
host** (server 0). Faults: ``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``nan`` (its loss), ``slow``
(every step 2×), after step ``FAULT_STEP``: a worker's by ``--inject-fault``, a server's by this
script's signal to its pid. Worker cells run with ``--max-restarts 1``; shard cells without
restarts, with ``--max-restarts 1`` and with ``--shard-standby``.

Columns: outcome (completed / restarted / rejoined / failed over / finished without the worker
/ failed with the resume command / hung = killed after ``TIMEOUT_S``); detection (s from the
fault to the first ``peer_lost``, ``failover``, ``standby_lost``, ``peer_dropped`` or the
restarted rank's new ``start``); recovery (s to the ``failover``, the restarted shard's last
``reconnect``, the rejoined worker's ``rejoin``, the restarted job's ``resume``, or a failed
job's end); progress lost (``pushes_lost`` for shards, fault step − resumed step for a
restarted lockstep job, the steps a lost worker never did); final accuracy beside the
undisturbed run's (one seed: a point of difference is noise). A record's time is its own
``wall`` clock where it has one, else when this script saw it (files polled every 0.1 s).

Not run: ``nan``/``slow`` of a shard (it computes no loss; the worker ``nan`` rows exercise its
rejection of a non-finite push); lockstep strategies other than sync (they share its watchdog
and restart path); easgd beyond a shard kill (it shares asgd's server loop and liveness).

The standby's cost: asgd, 4 workers, 2 shards, n_sync 1 (a push every step), without and with
``--shard-standby`` interleaved per seed with an A/A pair of the plain arm; pushes applied per
second = the shards' final version clocks ÷ wall time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

FAULT_STEP = 100
TIMEOUT_S = 120.0  # a run still going then hangs: killed and reported as such
HEARTBEAT_S = 3.0
STEPS = 300  # per run (--quick: 160)
COMMON = ["--dataset", "mnist1d", "--model", "mlp", "--workers", "3", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--min-step-time-s", "0.02",
          "--checkpoint-every", "20", "--heartbeat-timeout-s", str(HEARTBEAT_S),
          "--comm-timeout-s", "20", "--eval-every-s", "2"]  # fmt: skip
STRATEGY = {
    "sync": ["--strategy", "sync"],
    "asgd": ["--strategy", "asgd", "--servers", "2", "--n-sync", "4", "--server-lr", "0.25"],
    "easgd": ["--strategy", "easgd", "--servers", "2", "--easgd-tau", "4"],
}
RESTARTS, STANDBY = ["--max-restarts", "1"], ["--shard-standby"]
# (strategy, role, fault, recovery flags); the undisturbed runs are role "-" / fault "none".
CELLS = [
    *[(s, "-", "none", []) for s in ("sync", "asgd", "easgd")],
    *[("sync", "worker", f, RESTARTS) for f in ("kill", "stop", "nan", "slow")],
    ("sync", "evaluator / store host", "kill", RESTARTS),
    *[("asgd", "worker", f, RESTARTS) for f in ("kill", "stop", "nan", "slow")],
    ("asgd", "evaluator", "kill", RESTARTS),
    *[("asgd", "shard", "kill", flags) for flags in ([], RESTARTS, STANDBY)],
    *[("asgd", "shard", "stop", flags) for flags in ([], STANDBY)],
    *[("asgd", "store host", "kill", flags) for flags in ([], RESTARTS)],
    ("easgd", "shard", "kill", RESTARTS),
]
QUICK = {1, 8, 13, 14, 15}  # indices of CELLS run under --quick
DETECTED = ("peer_lost", "failover", "standby_lost", "peer_dropped")


def cell_name(strategy: str, role: str, fault: str, flags: list[str]) -> str:
    how = {(): "", tuple(RESTARTS): " +restarts", tuple(STANDBY): " +standby"}
    return f"{strategy} {role} {fault}{how[tuple(flags)]}".replace(" - none", " undisturbed")


class Records:
    """The records of a run's metrics files, each stamped with the time it was first seen."""

    def __init__(self, out: Path):
        self.out, self.offsets, self.seen = out, {}, []

    def poll(self) -> None:
        for path in sorted((self.out / "metrics").glob("rank*.jsonl")):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            chunk = chunk[: chunk.rfind(b"\n") + 1]  # complete lines only
            self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
            now = time.time()
            for line in chunk.decode(errors="ignore").splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                    record = json.loads(line)
                    self.seen.append((record.get("wall", now), record))  # its own clock first

    def find(self, event: str, **match: Any) -> list[tuple[float, dict]]:
        match["event"] = event
        return [(t, r) for t, r in self.seen if all(r.get(k) == v for k, v in match.items())]

    def times(self, event: str, **match: Any) -> list[float]:
        return [t for t, _ in self.find(event, **match)]


def run_cell(arm: harness.Arm, seed: int, root: Path) -> harness.Run:
    strategy, role, fault, flags = arm.argv
    first_worker, out = 2 if strategy != "sync" else 0, root / harness.slug(arm.name)  # 2 shards
    victim = {"worker": first_worker + 2, "shard": 1, "store host": 0}.get(role, first_worker)
    shutil.rmtree(out, ignore_errors=True)  # this script's own run directory, from a last run
    argv = [*COMMON, *STRATEGY[strategy], *flags, "--steps", str(STEPS), "--seed", str(seed)]
    by_signal = role in ("shard", "store host")
    if fault != "none" and not by_signal:
        spec = f"slow:{victim}:2" if fault == "slow" else f"{fault}:{victim}@{FAULT_STEP}"
        argv += ["--inject-fault", spec]
    cmd = [*harness.CLI, "train", *argv, "--out", str(out), "--no-progress"]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=harness.REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    rec, fault_t, hung = Records(out), None, False
    while proc.poll() is None:
        time.sleep(0.1)
        rec.poll()
        if time.time() - started > TIMEOUT_S:
            os.killpg(proc.pid, signal.SIGKILL)
            hung = True
            break
        if by_signal and fault_t is None and fault != "none":
            reached = [r for _, r in rec.find("step", rank=first_worker) if r["step"] >= FAULT_STEP]
            starts = rec.find("start", rank=victim)
            if reached and starts:
                os.kill(starts[0][1]["pid"], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                fault_t = time.time()
    _, stderr = proc.communicate()
    ended = time.time()
    rec.poll()
    s, fired = harness.read_summary(out), rec.find("fault", rank=victim)
    failed = "hung" if hung else f"exit {proc.returncode}" if proc.returncode else None
    run = harness.Run(arm.name, seed, round(ended - started, 3), s, failed=failed, out_dir=str(out))
    if not by_signal and fired:
        fault_t = fired[0][1]["wall"]
    run.values = v = {"outcome": outcome(rec, s, victim, fault, stderr, hung)}
    if fault_t is None:
        return run
    noticed = [t for e in DETECTED for t in rec.times(e)] + rec.times("start", rank=victim)[1:]
    v["detect_s"] = min(noticed) - fault_t if noticed else None
    recovered = (
        rec.times("failover")
        or rec.times("reconnect")[-1:]
        or [t for t, r in rec.find("rejoin") if r.get("worker") == victim]
        or rec.times("resume", rank=victim)[-1:]
        or ([ended] if s.get("failed") or run.failed else [])
    )
    v["recover_s"] = recovered[0] - fault_t if recovered else None
    resumes = rec.find("resume", rank=victim)
    if s.get("failed"):
        done = max((s.get("steps_done") or {0: 0}).values())
        v["lost"] = f"stopped at step {done} of {STEPS}; resumable"
    elif by_signal:
        v["lost"] = f"{s.get('pushes_lost', 0)} pushes" if s else "-"
    elif resumes and fired and "step" in resumes[-1][1]:
        v["lost"] = f"{fired[0][1]['step'] - resumes[-1][1]['step']} steps"
    elif victim in s.get("lost_workers", []) and fired:
        v["lost"] = f"{STEPS - fired[0][1]['step']} steps (its own)"
    return run


def outcome(rec, s, victim, fault, stderr, hung) -> str:
    if hung:
        return f"hung (killed after {TIMEOUT_S:g} s)"
    if s.get("failed"):
        return "failed, resume command printed" if "--resume" in stderr else "failed, no resume"
    if not s:
        return "failed, no summary"
    if s.get("shard_failovers"):
        return "failed over to the standby"
    if s.get("shard_restarts"):
        return "shard restarted in place"
    if victim in s.get("lost_workers", []):
        return "finished without the worker"
    if rec.find("rejoin"):
        return "worker rejoined"
    if len(rec.find("start", rank=victim)) > 1:
        return "restarted from a checkpoint"
    if fault == "nan":
        skipped = sum(r.get("steps_skipped_nonfinite", 0) for _, r in rec.find("final"))
        return f"completed, {skipped} step(s) skipped"
    return "completed"


def fault_table(prov: harness.Provenance, report: harness.Report, quick: bool) -> list:
    cells = [c for i, c in enumerate(CELLS) if i in QUICK or not quick]
    arms = [harness.Arm(cell_name(*c), c) for c in cells]
    root = prov.runs_dir("reliability")
    runs = harness.interleave(arms, [0], run=lambda a, s: run_cell(a, s, root), prov=prov)
    base = {r.arm.split()[0]: r.summary for r in runs if r.arm.endswith("undisturbed")}
    rows = [[strategy, role, fault, " ".join(flags) or "-", r.values["outcome"],
             r.values.get("detect_s"), r.values.get("recover_s"), r.values.get("lost", "-"),
             harness.pct(r.summary.get("final_test_accuracy")),
             harness.pct(base.get(strategy, {}).get("final_test_accuracy"))]
            for r, (strategy, role, fault, flags) in zip(runs, cells, strict=True)]  # fmt: skip
    report.section("Faults × roles × strategies")
    report.table("strategy | role | fault | flags | outcome | detection (s) | recovery (s) | "
                 "progress lost | final acc (%) | undisturbed (%)", rows)  # fmt: skip
    faulted = [r.values["detect_s"] for r in runs if r.values.get("detect_s") is not None]
    worst, bound = max(faulted, default=None), HEARTBEAT_S + 5
    report.claim(f"slowest detection (of {len(faulted)} faults noticed by a rank)",
                 worst, f"≤ {bound:g} s (heartbeat timeout + 5 s)",
                 None if worst is None else worst <= bound)  # fmt: skip
    hung = [r.arm for r in runs if r.failed == "hung"]
    report.claim("runs that hung", len(hung), "0", not hung, note=", ".join(hung))
    standby = [r for r in runs if r.arm.endswith("kill +standby")]
    lost = sum(r.summary.get("pushes_lost", 0) for r in standby)
    ok = lost == 0 and all(r.values["outcome"].startswith("failed over") for r in standby)
    name = "pushes lost when a shard is killed under --shard-standby"
    report.claim(name, lost if standby else None, "0 (and failed over)", ok if standby else None)
    return runs


def standby_cost(prov: harness.Provenance, report: harness.Report, quick: bool) -> list:
    common = ["--strategy", "asgd", "--workers", "4", "--servers", "2", "--n-sync", "1",
              "--dataset", "mnist1d", "--model", "mlp", "--batch-size", "32",
              "--steps", "40" if quick else "150", "--min-step-time-s", "0.02"]  # fmt: skip
    arms = [harness.Arm("plain", common), harness.Arm("standby", [*common, "--shard-standby"])]
    runs = harness.interleave(
        arms,
        [0] if quick else [0, 1, 2],
        control="plain",
        prov=prov,
        out_root=prov.runs_dir("reliability-standby"),
    )
    rate = {arm: [None if r.failed or not r.summary.get("wall_time_s")
                  else sum(r.summary.get("shard_versions", [])) / r.summary["wall_time_s"]
                  for r in rs] for arm, rs in harness.by_arm(runs).items()}  # fmt: skip
    report.section("The standby's throughput cost")
    rows = [[arm, len(v), *(f(x for x in v if x) for f in (min, max))]
            for arm, v in rate.items() if any(v)]  # fmt: skip
    report.table(["arm", "runs", "min pushes/s", "max pushes/s"], rows)
    harness.ratio_claim(report, "pushes/s with the standby ÷ without", rate["standby"],
                        rate["plain"], rate.get(harness.aa_name("plain")), "≥ 0.5",
                        lambda x: x >= 0.5)  # fmt: skip
    return runs


def main() -> None:
    global STEPS

    args, prov = harness.start(__doc__)
    STEPS = 160 if args.quick else 300
    report = harness.Report("reliability", "Reliability: faults × roles × strategies", prov)
    report.settings(harness.about(__doc__))
    runs = fault_table(prov, report, args.quick)
    report.write(runs + standby_cost(prov, report, args.quick))


if __name__ == "__main__":
    main()
