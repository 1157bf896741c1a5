# vLLM tuning lab. `make help` lists every target. Each target bootstraps .venv on first use.
SHELL := /bin/bash
.DEFAULT_GOAL := help

#= Every target that runs something (make VAR=value target)
SCENARIO  ?= default                  # scenario name (scenarios/<name>.yaml) or file
HARDWARE  ?=                          # hardware preset (scenarios/hardware/<name>.yaml); default h200
INVENTORY ?= inventory/local.yml      # Ansible inventory: where vLLM (or the twin) runs
BACKEND   ?= twin                     # twin (simulated, no GPU) | vllm (real) | predict (offline predictor)
EXPERIMENT ?=                         # experiment name: to resume it, or to rebuild its report
OUT       ?= reports                  # where the store and the reports go
SET       ?=                          # extra overrides, e.g. SET="serve.dtype=float16 load.shape.level=32"
MODEL     ?=                          # override serve.model, e.g. a model folder on the GPU host
DURATION  ?=                          # seconds per measured run (overrides load.stop.duration_s)
REPEATS   ?=                          # runs per point (default: the scenario's run.repeats)
RESUME    ?=                          # RESUME=1 continues EXPERIMENT (or the newest one of this kind)
SPREAD    ?=                          # SPREAD=1 spreads the points over every host of INVENTORY
DEADLINE  ?=                          # stop gracefully by then: 2026-12-01T05:30, 05:30 or 1h30m (exit 75, says how to resume)
PRECISION ?=                          # repeat each point until its 95% intervals are this narrow: default (±2% throughput, ±5% TTFT/TPOT p50) or throughput=2%,ttft=5%,max=8
LOADGEN_PROCESSES ?=                  # Locust processes per load-generator host (default: sized from the load)
LIVE      ?=                          # LIVE=1: serve Locust's web UI for the run in flight and print its URL
LIVE_HOST ?=                          # with LIVE=1: the address the web UI binds (default 127.0.0.1)
LAB_PYTHON ?=                         # use this Python (with the lab's dependencies) instead of .venv, e.g. on an air-gapped GPU host
PYTHON    ?= python3                  # the Python that creates .venv
#= Container hosts (inventory/container*.yml; also make provision, stop, teardown)
VLLM_VENV ?=                          # the environment vLLM is installed in (its bin/vllm); default: the Python running Ansible
LAB_ROOT  ?=                          # the lab's work folder on the host (default /tmp/vllm-lab)
#= make sweep
PARAM     ?=                          # engine flag to sweep, e.g. max-num-seqs
VALUES    ?=                          # comma-separated values for PARAM; default: a ladder for the hardware, the model and the load
#= make combo
PARAMS    ?=                          # 2-3 flags with default ladders, e.g. max-num-seqs,max-num-batched-tokens
GRID      ?=                          # values per flag, e.g. GRID="max-num-seqs=8,16,32 max-num-batched-tokens=2048,8192"
#= make tune
TRIALS    ?=                          # trials this worker runs (tune 20, autotune 40; per host with SPREAD=1)
OBJECTIVE ?=                          # goodput (default) | throughput or energy (tokens/J; subject to the SLO) | pareto (NSGA-II)
SPACE     ?=                          # search space, a name in scenarios/spaces/ or a YAML file (default: per hardware)
STUDY_STORAGE ?=                      # Optuna storage URL (default: the lab database), e.g. postgresql://host/db
SEED      ?=                          # sampler seed
CONFIRM   ?=                          # re-measure the best N configurations on CONFIRM_BACKEND
CONFIRM_BACKEND ?=                    # with CONFIRM=N: twin (default) | vllm
#= make autotune (also SEED, CONFIRM: the candidates measured; OBJECTIVE: capacity (default) | energy, tokens/J at the SLO capacity)
GPU_MINUTES ?=                        # wall minutes of the measuring backend, server starts counted (default 20)
#= make stress
SHAPE     ?=                          # ramp | step (staircases of runs) | spike | soak (one run)
LEVELS    ?=                          # offered loads in req/s, e.g. 2,4,8 (default: fractions of the predicted capacity)
#= make claims
CLAIMS    ?=                          # claim numbers, e.g. 1,3,5-8 (default: all nine)
#= make calibrate
PROFILE_OUT ?=                        # where the fitted twin profile goes
FIT_ONLY  ?=                          # FIT_ONLY=1 EXPERIMENT=...: refit from the store, measure nothing
REFERENCE ?=                          # vllm bench serve result files of the same machine, fitted too
FIT       ?=                          # all (default): every coefficient | host: the host's CPU scale alone | none: measure only
#= make report
PERIOD    ?=                          # a quarter, e.g. 2026Q4: the quarterly report
PDF       ?=                          # with PERIOD: PDF=0 skips the PDF (it needs Chromium)
#= make watch
URL       ?=                          # the deployment to probe (default: every instance of INVENTORY)
EVERY     ?=                          # seconds between probe rounds (default: one round)
COUNT     ?=                          # rounds of probes (with EVERY)
BASELINE  ?=                          # BASELINE=1 records a new baseline first
#= make bench
NAME      ?=                          # the benchmark (listed above), e.g. NAME=twin
ARGS      ?=                          # its own arguments, e.g. ARGS="fidelity speed"

# Every variable above reaches the lab as data, never as shell or make text: its text, unexpanded
# ($(value ...)), is exported as LAB_MAKE_<NAME>, the variable itself is not exported (make would
# expand it), and the recipes run `scripts/lab.py make <target>`, which reads them
# (vllm_lab/cli.py, make_argv). So EXPERIMENT='x; touch F' or PARAM='$(touch F)' is a name the lab
# refuses with a sentence, not a command.
LAB_VARIABLES := SCENARIO HARDWARE INVENTORY PARAM VALUES BACKEND DURATION EXPERIMENT OUT SET MODEL \
  REPEATS RESUME SPREAD LOADGEN_PROCESSES PARAMS GRID TRIALS OBJECTIVE SPACE STUDY_STORAGE SEED \
  CONFIRM CONFIRM_BACKEND SHAPE CLAIMS LEVELS PERIOD URL EVERY COUNT BASELINE PROFILE_OUT FIT_ONLY \
  REFERENCE FIT PDF VLLM_VENV LAB_ROOT NAME ARGS DEADLINE LIVE LIVE_HOST PRECISION GPU_MINUTES
$(foreach v,$(LAB_VARIABLES),$(eval export LAB_MAKE_$(v) := $$(value $(v)))$(eval unexport $(v)))
unexport PYTHON LAB_PYTHON

VENV := .venv
ifeq ($(strip $(value LAB_PYTHON)),)
export LAB_MAKE_PY := $(VENV)/bin/python
else
export LAB_MAKE_PY := $(strip $(value LAB_PYTHON))
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
endif
export LAB_MAKE_PYTHON := $(strip $(value PYTHON))
# The Python runs from the environment too: a quote or a ';' in LAB_PYTHON is a file name.
LAB   = "$$LAB_MAKE_PY" scripts/lab.py make

$(VENV)/.installed: pyproject.toml
	@echo "== setting up $(VENV) (first use only)"
	@"$$LAB_MAKE_PYTHON" -m venv $(VENV)
	@$(VENV)/bin/pip install -q --upgrade pip > $(VENV)/install.log 2>&1
	@$(VENV)/bin/pip install -q -e '.[dev]' >> $(VENV)/install.log 2>&1 \
	  || { tail -20 $(VENV)/install.log; echo "make: installing the lab into $(VENV) failed (log: $(VENV)/install.log)"; exit 1; }
	@touch $@

ifeq ($(strip $(value LAB_PYTHON)),)
venv: $(VENV)/.installed
else
venv: ; @"$$LAB_MAKE_PY" -c "import vllm_lab, locust, pydantic" || { echo "make: $$LAB_MAKE_PY lacks the lab's dependencies" >&2; exit 1; }
endif

##@ Getting started
.PHONY: help
help: ## Show every target with one line of help, then the variables each takes
	@if [ -t 1 ]; then b=$$'\033[1m'; c=$$'\033[36m'; r=$$'\033[0m'; else b= c= r=; fi; \
	awk -v b="$$b" -v c="$$c" -v r="$$r" 'BEGIN {FS = ":.*##"} \
	  /^##@/ {printf "\n%s%s%s\n", b, substr($$0, 5), r} \
	  /^[a-zA-Z_-]+:.*##/ {printf "  %s%-14s%s %s\n", c, $$1, r, $$2}' $(MAKEFILE_LIST); \
	echo; echo "$${b}Benchmarks$${r} (make bench NAME=<name> [ARGS=\"...\"]; scripts/bench_<name>.py):"; \
	for f in scripts/bench_*.py; do n=$${f#scripts/bench_}; n=$${n%.py}; \
	  printf "  %s%-14s%s %s\n" "$$c" "$${n//_/-}" "$$r" "$$(grep -m1 '^\"\"\"' "$$f" | cut -c4-)"; done; \
	awk -v b="$$b" -v r="$$r" '/^#= / {printf "\n%s%s:%s\n", b, substr($$0, 4), r} \
	  /^[A-Z_]+ +\?=/ {sub(/ +\?= */, " "); n=index($$0,"#"); printf "  %-17s %s\n", $$1, (n ? substr($$0, n+2) : "")}' \
	  $(MAKEFILE_LIST)

##@ The tuning method
.PHONY: baseline sweep calibrate report
baseline: venv ## Step 1: vLLM's defaults on the scenario's traffic, repeated (default 3)
	@$(LAB) baseline

sweep: venv ## Step 2: one flag over a ladder, e.g. make sweep PARAM=max-num-seqs [VALUES=8,16,32]
	@$(LAB) sweep

calibrate: venv ## Measure the calibration plan on BACKEND and fit a twin profile (PROFILE_OUT=path; FIT=host: another host of the profile's GPU)
	@$(LAB) calibrate

report: venv ## Rebuild an experiment's report from the store (EXPERIMENT=...); PERIOD=2026Q4: the quarterly report
	@$(LAB) report

##@ Combinations and stress
.PHONY: combo tune stress
combo: venv ## Step 3: a grid of 2-3 flags, e.g. make combo PARAMS=max-num-seqs,max-num-batched-tokens [GRID="flag=a,b ..."]
	@$(LAB) combo

tune: venv ## Step 3: Optuna search [TRIALS= OBJECTIVE= SPACE= STUDY_STORAGE= CONFIRM=N]; EXPERIMENT= joins a study
	@$(LAB) tune

stress: venv ## Step 4: make stress SHAPE=ramp|step|spike|soak [LEVELS=2,4,8]: knee, max sustainable load, spike, drift
	@$(LAB) stress

.PHONY: autotune
autotune: venv ## Flags by SLO capacity: search on the predictor, measure defaults + best within GPU_MINUTES [CONFIRM=N TRIALS= SPACE= OBJECTIVE=energy]
	@$(LAB) autotune

##@ The guide's claims
.PHONY: claims
claims: venv ## Measure the tuning guide's claims, a verdict each [CLAIMS=1,3 REPEATS= SPREAD=1]
	@$(LAB) claims

##@ Long-term monitoring
.PHONY: monitor watch findings status
monitor: venv ## Step 5: Prometheus scraping every instance, alert rules, exporters, Grafana where installable
	@$(LAB) monitor

watch: venv ## Probe a live deployment, store it, flag a regression vs its baseline [URL= EVERY= COUNT= BASELINE=1]
	@$(LAB) watch

findings: venv ## Troubleshooting findings of an experiment's runs (EXPERIMENT=..., default the newest)
	@$(LAB) findings

##@ Hosts
.PHONY: provision stop teardown
provision: venv ## Make INVENTORY's hosts ready to serve: checks, venv, vLLM, the lab, the model (provision.yml)
	@$(LAB) provision

stop: venv ## Stop every server on INVENTORY's hosts, whole process groups, GPUs checked free (stop.yml)
	@$(LAB) stop

teardown: venv ## Stop, then remove what provision and serving put on INVENTORY's hosts (teardown.yml)
	@$(LAB) teardown

status: venv ## What the lab is doing now (experiment, point, phase, since when), from any shell [OUT=]
	@$(LAB) status

##@ Scenarios
.PHONY: lint show
lint: venv ## Lint a scenario's vLLM flags (SCENARIO=...); `make lint SCENARIO=all` checks every runnable shipped one (not guide/)
	@$(LAB) lint

show: venv ## Print the resolved scenario (hardware preset + scenario + SET overrides)
	@$(LAB) show

##@ Development
.PHONY: test test-fast check clean bench
# make test hands each pytest-xdist worker whole test files (a file's module fixtures start once),
# the longest first (tests/conftest.py orders them); test-fast's tests are short and fixture-light,
# so they are dealt out one by one, a worker per CPU. The tests marked timing (millisecond margins
# on Locust's send times, the live twin against the predictor) run first, one at a time: beside a
# live-twin sweep, or even beside one another on a loaded 2-core machine, their margins do not
# hold. The process-free tests and those marked untimed (no live window) run beside them at the
# lowest CPU priority (scripts/run-idle.sh: an idle cpu cgroup, which also holds the servers they
# start in sessions of their own), in the cycles the timing tests leave idle.
test: venv ## Every test (10-15 min on 2 cores, 18 beside a busy process); installs the system packages it needs first, or says what is missing
	@bash scripts/test-setup.sh
	@# Bytecode once: the suite starts ~a thousand Python processes of the lab (servers, Locust, the
	@# CLI), which compile it afresh each time where PYTHONDONTWRITEBYTECODE is set.
	@"$$LAB_MAKE_PY" -m compileall -q vllm_lab tests scripts playbooks >/dev/null
	@# The timing tests alone, the untimed ones beside them (their output after) at idle priority:
	@# a timing test's process then takes a core back the moment it wakes (niced only, a CI run's
	@# agreement test waited 16 ms for one and read client-limited; in the idle class only, the
	@# servers the untimed tests start in sessions of their own competed as equals, and beside one
	@# more busy process the timing tests read client-limited); then the rest, whose live tests
	@# mostly wait on real-time windows: one worker more than there are CPUs keeps the cores busy.
	@rc=0; log=$$(mktemp); export LAB_TESTS_REQUIRE_ALL=1; \
	  (PYTHONDONTWRITEBYTECODE= bash scripts/run-idle.sh "$$LAB_MAKE_PY" -m pytest -q -m "not integration or untimed" \
	    -n auto --dist loadfile --no-loadscope-reorder >"$$log" 2>&1) & untimed=$$!; \
	  "$$LAB_MAKE_PY" -m pytest -q -m timing -p no:xdist || rc=$$?; \
	  wait $$untimed || rc=$$?; cat "$$log"; rm -f "$$log"; \
	  PYTEST_XDIST_AUTO_NUM_WORKERS=$${PYTEST_XDIST_AUTO_NUM_WORKERS:-$$(( $$(nproc) + 1 ))} \
	    "$$LAB_MAKE_PY" -m pytest -q -m "integration and not timing and not untimed" -n auto \
	    --dist loadfile --no-loadscope-reorder --durations=15 || rc=$$?; exit $$rc

test-fast: venv ## The tests that start no process (seconds; no set-up needed)
	@# Bytecode kept where PYTHONDONTWRITEBYTECODE is set: each worker otherwise compiles the tests'
	@# rewritten asserts, and any dependency installed without its .pyc, afresh (~3 s a worker).
	@PYTHONDONTWRITEBYTECODE= "$$LAB_MAKE_PY" -m pytest -q -n auto --dist load -m "not integration and not fidelity"

check: venv ## Static checks: ruff on the package, ansible-lint on the playbooks
	@$(VENV)/bin/ruff check vllm_lab scripts tests
	@if [ -d playbooks/roles ]; then $(VENV)/bin/ansible-lint playbooks; fi

bench: venv ## Run one benchmark: make bench NAME=twin [ARGS="fidelity speed"] (listed below)
	@$(LAB) bench

clean: ## Remove the virtual environment and caches (keeps reports/)
	rm -rf $(VENV) .pytest_cache build *.egg-info
