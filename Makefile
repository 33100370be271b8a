# Set-up is part of every target: the virtual environment is created on first use, with torch
# pinned (an unpinned torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cloudburst-installed
TORCH  := torch==2.13.0

.PHONY: demo test test-fast lint bench bench-all bench-history bench-quick clean mutation \
	mutation-sample

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

## The main job: sync vs asgd on MNIST-1D, a comparison table and runs/demo/curves.png
demo: $(STAMP)
	$(BIN)/python -m cloudburst demo --out runs/demo

# The tests run one thread per process and write bytecode caches (__pycache__/, ignored by git)
# even where the environment sets PYTHONDONTWRITEBYTECODE: every test process and every job a
# test launches would otherwise compile cloudburst/ and tests/ again (~1.4 CPU-s of a small
# job's ~8.7, measured on the 2-core machine).
TESTENV := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1

## The whole test suite (unit, distributed, end-to-end) and the linter
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(TESTENV) $(BIN)/pytest -q

## The inner loop: the unit tests (no processes, comm faked) but the slow ones (30 s on 2 cores)
test-fast: $(STAMP)
	$(TESTENV) $(BIN)/pytest -q -m "unit and not spawns and not slow" tests/unit

## The evidence in an hour (benchmarks/README.md): the scripts behind the README's advice, at
## fewer seeds and arms, one after another, into runs/bench-hour/ (their results, then the advice
## they give, printed; the committed evidence is not touched). Keeps going past a failing script;
## fails at the end, naming it. Each entry: script[:args], ':' for spaces.
BENCH := experiments:accuracy:--first-seed:5:--seeds:3 experiments:stragglers:--seeds:3 \
	daso:--arms:sync,daso,local_sgd:--seeds:3 compress:--seeds:2 local_sgd transport overhead \
	lm:--seeds:1:--steps:200
# Timed end to end: 55.7 min (3,342 s) at f90e9ec, in a clean worktree on the 2-core machine,
# with two editing sessions beside it (load 2.6-4.3); exit 0. Per script (minutes, from the
# results' start times): accuracy 5.5, stragglers 11.1, daso 10.5, compress 13.5, local_sgd 5.4,
# transport + overhead 2.1, lm (with its virtual-cluster table) and the evidence 10.
## Every script at its own settings into benchmarks/results/, then the README's evidence
## (about 9 hours; the staleness, compensator and confirmation results' own commands are in
## their files' headers).
BENCH_ALL := reliability compress experiments:accuracy:--first-seed:5 experiments:stragglers \
	defaults daso powersgd local_sgd transport overhead throughput startup sim_fidelity sim_scale \
	sim_seeds \
	sim_published wire compress_scale lm lm_replicas node_replicas staleness staleness_rules per_sample \
	slow_link slow_link_levels slow_link_warmup lm_slow_link slow_link_levels:--workload:lm_slow_link \
	equal_time equal_time:--cell:pareto equal_time:--cell:slow-node \
	equal_time:--cell:pareto:--workers:64 async_diloco_w64
BENCH_FLAGS ?=
BENCH_TIMEOUT_S ?= 3600
EVIDENCE_FLAGS ?= --results runs/bench-hour --print
BENCH_RESULTS ?= $(CURDIR)/runs/bench-hour

bench: $(STAMP)
	@failed=""; for entry in $(BENCH); do \
		script=$${entry%%:*}; sub=$$(echo "$$entry" | sed -n 's/^[^:]*://p' | tr ':' ' '); \
		echo "== benchmarks/$$script.py $$sub $(BENCH_FLAGS)"; \
		CLOUDBURST_BENCH_RESULTS=$(BENCH_RESULTS) OMP_NUM_THREADS=1 timeout $(BENCH_TIMEOUT_S) \
			$(BIN)/python benchmarks/$$script.py $$sub $(BENCH_FLAGS) || failed="$$failed $$entry"; \
	done; \
	$(BIN)/python benchmarks/evidence.py $(EVIDENCE_FLAGS) || failed="$$failed evidence"; \
	if [ -n "$$failed" ]; then echo "make bench: FAILED:$$failed" >&2; exit 1; fi

bench-all: $(STAMP)
	@$(MAKE) --no-print-directory bench BENCH="$(BENCH_ALL)" BENCH_RESULTS= EVIDENCE_FLAGS=

## Re-make every history result (the package changed since its runs; docs/evidence.md names
## them) by the command its file records, one at a time, on an idle machine: hours (each file's
## header and benchmarks/README.md give its time). Keeps going past a failing one, fails at
## the end naming it; then the README's evidence.
bench-history: $(STAMP)
	@mkdir -p runs && $(BIN)/python benchmarks/evidence.py --history > runs/history.txt; \
	failed=""; while IFS= read -r cmd; do \
		echo "== $$cmd"; \
		eval "OMP_NUM_THREADS=1 timeout 14400 $(BIN)/python $$cmd" < /dev/null || \
			failed="$$failed; $$cmd"; \
	done < runs/history.txt; \
	$(BIN)/python benchmarks/evidence.py || failed="$$failed; evidence"; \
	if [ -n "$$failed" ]; then echo "make bench-history: FAILED$$failed" >&2; exit 1; fi

## Every script (BENCH_ALL) in --quick mode (a smoke test, ≤ 10 min: 6.1 min at 0703ae6, fewer
## scripts then; results under runs/bench-quick/, never evidence: the README is not touched)
bench-quick: $(STAMP)
	@$(MAKE) --no-print-directory bench BENCH="$(BENCH_ALL)" BENCH_FLAGS=--quick \
		BENCH_TIMEOUT_S=300 EVIDENCE_FLAGS="--results runs/bench-quick --print"

## Mutation score of the algorithmic core against the fast tests (benchmarks/results/mutation.md).
## mutmut mutates a copy (mutants/), two mutants at a time against the make test-fast tier.
## server.py, daso.py, asgd.py, gossip.py and sim/network.py also hold the server loop, DASO's
## collectives, the workers' transport and the virtual cluster's mailboxes: only their maths is
## run (mutants not named below stay "not checked", uncounted).
MUTANTS := 'cloudburst.comm.flat.*' 'cloudburst.comm.link.*' 'cloudburst.comm.costs.*' \
	'cloudburst.comm.nic.*' 'cloudburst.records.checkpoint.*' 'cloudburst.strategies.asgd.summary.*' \
	'cloudburst.strategies.asgd.shard.*' 'cloudburst.strategies.asgd.server.x_request_problem__*' \
	'cloudburst.strategies.local_sgd.worker.*' 'cloudburst.strategies.diloco.worker.*' \
	'cloudburst.strategies.easgd.worker.*' \
	'cloudburst.comm.compress.*' 'cloudburst.comm.quantise.*' 'cloudburst.comm.collectives.*' \
	'cloudburst.strategies.sync.worker.*' 'cloudburst.strategies.gossip.worker.x_p*' \
	'cloudburst.strategies.gossip.worker.x*PeerSchedule*' \
	'cloudburst.strategies.gossip.worker.x*GossipStrategy*after_step__*' \
	'cloudburst.strategies.gossip.worker.x*GossipStrategy*_fold_mailbox__*' \
	'cloudburst.strategies.gossip.worker.x*GossipStrategy*_publish__*' \
	'cloudburst.strategies.gossip.worker.x*GossipStrategy*_peer_rank__*' \
	'cloudburst.strategies.gossip.worker.x*GossipStrategy*consensus_distance__*' \
	'cloudburst.strategies.daso.worker.x_daso_merge__*' \
	'cloudburst.strategies.daso.worker.x*DasoSchedule*' \
	'cloudburst.strategies.daso.worker.x*DasoStrategy*after_step__*' \
	'cloudburst.strategies.daso.worker.x*DasoStrategy*_merge__*' \
	'cloudburst.strategies.daso.worker.x*DasoStrategy*_start_sync__*' \
	'cloudburst.sim.clock.x*ClockModel*' 'cloudburst.sim.clock.x_is_payload__*' \
	'cloudburst.sim.clock.x_resolve_step_time__*' \
	'cloudburst.sim.network.x*SimNetwork*post__*' 'cloudburst.sim.network.x*SimNetwork*take__*' \
	'cloudburst.sim.network.x*SimNetwork*_complete__*' \
	'cloudburst.sim.network.x*SimNetwork*_all_to_all__*' \
	'cloudburst.sim.network.x*SimNetwork*_wire*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*wrap__*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*after_step__*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*_round__*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*_account_push__*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*_flush__*' \
	'cloudburst.strategies.asgd.worker.x*AsgdStrategy*global_params__*'

mutation: $(STAMP)
	rm -rf mutants && mkdir mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(MUTANTS) > mutants/run.log 2>&1
	@$(BIN)/mutmut results --all true | awk -F': ' '$$2 != "not checked" { \
		f = $$1; sub(/^ +/, "", f); sub(/\.[^.]*$$/, "", f); n[f, $$2]++; files[f]; \
		all++; dead += $$2 == "killed" || $$2 == "timeout"; if ($$2 != "killed") print } \
	END { for (f in files) printf "%-34s killed %3d  timeout %2d  survived %3d  no tests %3d\n", \
		f, n[f, "killed"], n[f, "timeout"], n[f, "survived"], n[f, "no tests"] | "sort"; \
		close("sort"); printf "score: %d of %d mutants killed or timed out (%.1f %%)\n", \
		dead, all, 100 * dead / all }'

## The same score estimated in about 40 minutes: three modules in full, 500 mutants sampled from
## the rest (benchmarks/mutation_sample.py; a Clopper-Pearson interval for the whole score).
mutation-sample: $(STAMP)
	rm -rf mutants && mkdir mutants
	$(BIN)/python benchmarks/mutation_sample.py --out mutants/mutation_sample.json

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
