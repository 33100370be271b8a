"""The language-model workload (issue 29): the GPT on text:stdlib, DiLoCo's own setting.

    .venv/bin/python benchmarks/lm.py [--quick] [--seeds N] [--steps T] [--force]
    .venv/bin/python benchmarks/lm.py --virtual-only      # the virtual-cluster table alone

Real runs (W = 4, equal tokens, sync's A/A beside): final test loss, bytes, wall time; claim:
DiLoCo at its defaults − sync ≤ 0.05 nats on seeds 2-4. Virtual cluster: GPT-2 small at
llm.c's A100 throughput, W = 8 to 64: virtual s per step and bytes per worker-step. Details:
benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAND_IN_PARAMS = 124_439_808  # GPT-2 small, tied embeddings
TOKENS_PER_S = 10e9 / 5400 / 8  # llm.c discussion 481: 10 B tokens, 90 min, 8 A100s
STAND_IN_BATCH_TOKENS = 16 * 1024
VIRTUAL_STEP_S = STAND_IN_BATCH_TOKENS / TOKENS_PER_S
COMMON = "--model gpt --dataset text:stdlib --workers 4 --log-every-steps 20".split()
ARMS = {
    "sync": ["--strategy", "sync"],
    "local_sgd H=16": ["--strategy", "local_sgd", "--period", "16"],
    "diloco (defaults, H=8)": ["--strategy", "diloco"],
    "diloco H=16": ["--strategy", "diloco", "--period", "16"],
    "diloco H=64": ["--strategy", "diloco", "--period", "64"],
    "streaming int8 H=16": "--strategy diloco --period 16 --fragments 4 --compress int8".split(),
    "async_diloco H=16": ["--strategy", "async_diloco", "--period", "16"],
}
CLAIM_NATS = 0.05
CLAIM_ARM = "diloco (defaults, H=8)"
FIRST_HELD_OUT_SEED = 2  # seeds 0 and 1 chose the GPT's DiLoCo defaults (docs/lm.md)


def _params(spec: str) -> int:
    from cloudburst.models import build_model

    return sum(p.numel() for p in build_model(spec, (64,), 256, 0).parameters())


def virtual_rows(quick: bool) -> list[list[object]]:

    from cloudburst.config import RunConfig
    from cloudburst.config.simulation import SimulationConfig
    from cloudburst.sim.run import simulate

    rows, steps = [], 64
    arms = {"sync": dict(strategy="sync"), "diloco H=16": dict(strategy="diloco", period=16),
            "diloco H=64": dict(strategy="diloco", period=64), "streaming int8 H=16":
            dict(strategy="diloco", period=16, fragments=4, compress="int8")}  # fmt: skip
    for gbit in (1, 10):
        for workers in (8, 16) if quick else (8, 16, 32, 64):
            for name, kw in arms.items():
                cfg = RunConfig(
                    model="gpt:layers=1,width=16,heads=2", dataset="text:stdlib", workers=workers,
                    nodes=workers, inter_node_link=f"{gbit},1", steps=steps, batch_size=2,
                    context=64, eval_every_s=1e6, checkpoint_every=0, overwrite=True,
                    out=str(Path("runs/bench/lm-virtual") / f"{name}-{workers}-{gbit}"), **kw,
                )  # fmt: skip
                cfg = cfg.replace(progress=False)
                sim = SimulationConfig(step_time_s=VIRTUAL_STEP_S, modelled_params=STAND_IN_PARAMS)
                s = simulate(cfg, sim)
                per_step = s["wall_time_s"] / steps
                # the counters hold the tiny GPT's bytes; the clock charged GPT-2's
                scale = STAND_IN_PARAMS / _params(cfg.model.model)
                sent = s["sent_bytes"] * scale / (workers * steps)
                rows.append(
                    [f"{gbit} Gbit/s", workers, name, f"{per_step:.3f}",
                     f"{VIRTUAL_STEP_S / per_step:.2f}", f"{sent / 1e6:.1f}"]
                )  # fmt: skip
                print("  virtual", rows[-1], flush=True)
    return rows


def main() -> None:
    import harness
    from harness import Arm, fmt

    def add(p) -> None:
        p.add_argument("--steps", type=int, default=None, help="steps per worker (default 300)")
        p.add_argument("--virtual-only", action="store_true", help="only the virtual cluster")
        p.add_argument("--real-only", action="store_true", help="only the real runs")
        p.add_argument("--extra", default="", help="train flags for every real arm (--device cuda)")

    args, prov = harness.start(__doc__, add)
    steps = args.steps or (40 if args.quick else 300)
    n = args.seeds or (1 if args.quick else 3)
    seeds = range(FIRST_HELD_OUT_SEED, FIRST_HELD_OUT_SEED + n)
    report = harness.Report(
        "lm", "A small GPT on the standard library: sync vs the DiLoCo family", prov
    )
    report.settings(harness.about(__doc__) + f"\n\nSteps per worker: {steps}; seeds {list(seeds)}.")
    runs = []
    if not args.virtual_only:
        extra = args.extra.split()
        arms = [Arm(n, [*COMMON, *argv, "--steps", str(steps), *extra]) for n, argv in ARMS.items()]
        root = prov.runs_dir("lm")

        def run(arm: Arm, seed: int):
            out = root / harness.slug(arm.name) / f"seed{seed}"
            return harness.run_train(arm, seed, out, timeout_s=3600)

        runs = harness.interleave(arms, seeds, control="sync", run=run, prov=prov)
        by = harness.by_arm(runs)
        rows = []
        for name, rs in by.items():
            ok = [r for r in rs if not r.failed]
            loss = harness.median(r.summary.get("final_test_loss") for r in ok)
            rows.append([
                name, f"{len(ok)}/{len(rs)}", fmt(loss, 4),
                fmt(None if loss is None else loss / math.log(2), 4),
                fmt(harness.median(r.summary.get("sent_bytes", 0) / 1e6 for r in ok), 1),
                fmt(harness.median(r.summary.get("wall_time_s") for r in ok), 1),
                "; ".join(r.failed for r in rs if r.failed) or "",
            ])  # fmt: skip
        report.section("Real runs, W = 4, equal tokens (medians over seeds)").table(
            "arm | runs | test loss (nats/byte) | bits/byte | MB sent | wall s | failures", rows
        )

        def losses(arm: str) -> tuple[list[float], list[float]]:  # paired by seed with sync
            pairs = [(d.summary["final_test_loss"], s.summary["final_test_loss"])
                     for d in by.get(arm, []) for s in by.get("sync", [])
                     if d.seed == s.seed and not d.failed and not s.failed]  # fmt: skip
            return [p[0] for p in pairs], [p[1] for p in pairs]

        pairs, aa = losses(CLAIM_ARM), losses(harness.aa_name("sync"))
        if pairs[0]:
            diff, lo, hi = harness.difference_interval(*pairs, paired=True)
            aa_diff = harness.difference_interval(*aa, paired=True)[0] if aa[0] else None
            report.claim("diloco at its defaults − sync: final test loss (nats)", round(diff, 4),
                         f"≤ {CLAIM_NATS}", diff <= CLAIM_NATS,
                         aa=None if aa_diff is None else round(aa_diff, 4),
                         interval=(lo, hi) if len(pairs[0]) > 1 else None,
                         seeds=len(pairs[0]))  # fmt: skip
    report.text(f"Real runs' extra flags: `{args.extra or 'none'}`.")
    if args.real_only:
        report.write(runs)
        return
    report.section("Virtual cluster: GPT-2 small at llm.c's A100 throughput (virtual s per step, "
                   "compute 0.071 s)").table(
        "link | W | arm | virtual s/step | compute share | GPT-2 MB sent per worker-step",
        virtual_rows(args.quick),
    ).text(
        "What may not carry over: the GPT here has 0.12 M parameters and sees 0.31 M tokens per "
        "worker; DiLoCo's published settings train 150 M+ parameter models for 10^9+ tokens, "
        "where H in the hundreds works and the outer step is tuned at that scale. Byte-level "
        "tokens on Python source are far more predictable than web text. The virtual table "
        "charges GPT-2's bytes at a throughput measured by one implementation on A100s; the "
        "maths behind it is the tiny GPT's, so it says nothing about GPT-2's loss."
    )  # fmt: skip
    report.write(runs)
    print(json.dumps([c.row() for c in report.claims]))


if __name__ == "__main__":
    main()
