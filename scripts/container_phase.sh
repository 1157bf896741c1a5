#!/usr/bin/env bash
# One phase of the lab on a container GPU host with vLLM already installed (inventory/container.yml
# for one GPU; container-pair.yml, container-tp.yml for two), bounded in time: for a machine
# booked for a while, or a job with a wall-clock limit. The store lives in STORE between calls;
# each phase copies it (consistently) and a log to OUT.
#
#   MODEL=/models/llama-3-8b VLLM_VENV=/opt/vllm bash scripts/container_phase.sh PHASE
#
# The claims and autotune phases discard one run of the load after each server start
# (run.warmup_runs=1: the first run after a start reads slow on an H200).
# PHASE: sweep (make sweep PARAM, default max-num-seqs, on SCENARIO, default the default one, at USERS
#        closed-loop users, default 64, VALUES as given or the flag's ladder, with REPEATS, default 5,
#        and PRECISION, default "default"; PRECISION=...,max=5 keeps
#        each point to its first five runs; WARMUP_RUNS=1 discards a run after each start, for a
#        new experiment (the committed ones were taken without); one GPU; EXPERIMENT names it),
#        claims (the guide's claims 1-6 and 8, REPEATS runs an arm, default 3; two configurations at
#        once on a host of two GPUs; EXPERIMENT names it, default claims-h200-regimes),
#        tp (tensor-parallel-size 1,2 on the model at 256 users, two GPUs: REPEATS runs a point,
#        default 5, of DURATION s, default 30, after a discarded one; EXPERIMENT names it, default
#        tp-repeats-llama-3-8b), tp70b (the same on the Llama-3-70B shape, which needs 2),
#        baseline (make baseline: vLLM's defaults on SCENARIO, default the default one, REPEATS runs, default 5, of
#        DURATION s, default 30, after a discarded one: the run-to-run spread of one configuration;
#        EXPERIMENT names it, default h200-baseline-repeats),
#        calibrate (make calibrate's plan on vLLM's defaults in one server start and its eager run
#        in a second, then the profile fitted to it; EXPERIMENT names it, default h200-calibrate;
#        `wait` copies the store as soon as the runs are in, so the host may be let go while the
#        fit still runs; FIT=none measures only, and the next phase starts without waiting for
#        the fit, which `make calibrate FIT_ONLY=1` does later off the host),
#        autotune (make autotune on the realtime-chat traffic and SLO, one GPU: GPU_MINUTES, default
#        20, over as many phases as it takes; EXPERIMENT names it, default autotune-realtime-chat-h200),
#        stress (make stress SHAPE=step, default, at LEVELS req/s on SCENARIO, default realtime-chat:
#        one configuration's staircase, e.g. an autotune candidate's flags given in SET; EXPERIMENT
#        names it, default stress-<SHAPE>).
# SET (optional) adds overrides to the phase's own, e.g. SET="serve.api-server-count=2"; a flag
# given no value is vLLM's default, so the stress phase takes realtime-chat's traffic at vLLM's
# defaults with SET="serve.enforce-eager= serve.max-num-seqs= serve.max-num-batched-tokens=
# serve.gpu-memory-utilization= serve.block-size=".
# MODEL (required) is the model folder; with SET's load-format=dummy only its config and tokenizer
# are read. HARDWARE is the lab's preset of the host's GPU (default h200; h100-80g for an H100).
# VLLM_VENV and LAB_ROOT go to the inventory (see inventory/container.yml). STORE (default
# /tmp/lab), OUT (default /tmp/out), DURATION (s per run, default 10), LAB_PYTHON (the Python with
# the lab's dependencies, default python3). BUDGET_S (default 520) bounds the phase:
# then the lab is interrupted as Ctrl-C would, so it stops its servers and keeps every finished
# run; calling the phase again resumes it.
# DETACH=1 starts the phase detached (setsid) and returns at once, so a phase may outlast the
# call that starts it (a batch system's job steps, a shell that is closed); then
#   bash scripts/container_phase.sh wait [SECONDS]
# waits up to SECONDS (default 540) for it, copies the store to OUT as it stands, and exits 0 when
# the phase has ended well, 75 while it still runs, the phase's status otherwise.
set -uo pipefail
phase=${1:?usage: container_phase.sh sweep|claims|baseline|calibrate|tp|tp70b|autotune|stress|wait}
store=${STORE:-/tmp/lab}
out=${OUT:-/tmp/out}
mkdir -p "$store" "$out"

snapshot() {  # a consistent copy of the store (WAL included), and the raw samples beside it
  "${LAB_PYTHON:-python3}" -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))' \
    "$store/lab.db" "$out/lab.db"
  tar czf "$out/samples.tgz" -C "$store" --exclude .work --exclude 'lab.db*' --exclude 'phase.*' . 2>/dev/null
}

if [[ $phase == wait ]]; then
  pid=$(cat "$store/phase.pid" 2>/dev/null) || { echo "container_phase.sh: no detached phase in $store" >&2; exit 2; }
  for (( waited = 0; waited < ${2:-540}; waited += 5 )); do kill -0 "$pid" 2>/dev/null || break; sleep 5; done
  [[ -e $store/lab.db ]] && snapshot
  tail -n 5 "$out"/*.log
  if kill -0 "$pid" 2>/dev/null; then echo "phase still running (pid $pid)"; exit 75; fi
  rc=$(cat "$store/phase.rc" 2>/dev/null || echo 1)
  echo "phase ended: rc $rc"
  exit "$rc"
fi

: "${MODEL:?MODEL is required: the model folder on this host, e.g. MODEL=/models/llama-3-8b}"
budget=${BUDGET_S:-520}
deadline=$((budget - 20))s  # the lab stops itself by then; the interrupt below is the backstop
if [[ ${DETACH:-} == 1 ]]; then
  rm -f "$store/phase.rc"
  DETACH= setsid bash "$0" "$phase" > "$out/detached.log" 2>&1 < /dev/null &
  echo $! > "$store/phase.pid"
  echo "phase $phase detached (pid $!, $budget s at most): bash $0 wait [SECONDS] waits for it"
  exit 0
fi
export LC_ALL=C.UTF-8
# Never let NCCL, PyTorch or NVSHMEM use NVLink multicast where it is off (container-tp.yml says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

model=$MODEL
sets="serve.load-format=dummy workload.tokenizer=$MODEL"
common=(LAB_PYTHON="${LAB_PYTHON:-python3}" BACKEND=vllm OUT="$store" DURATION="${DURATION:-10}"
        VLLM_VENV="${VLLM_VENV:-}" LAB_ROOT="${LAB_ROOT:-}" DEADLINE="$deadline")

seed=  # the committed example's store a phase continues (below)
# The TP phases' points: REPEATS runs each, judged at PRECISION, a discarded run after each start.
tp_repeats=(REPEATS="${REPEATS:-5}" PRECISION="${PRECISION:-default}")
tp_sets="run.start_timeout_s=300 run.warmup_runs=${WARMUP_RUNS:-1}"
case $phase in
  # The lab's defaults (15-s runs) at a fixed user count; five runs per point in one server start
  # give each point its interval and the host's run-to-run noise.
  sweep) users=${USERS:-64} param=${PARAM:-max-num-seqs}
         args=(sweep PARAM="$param" ${VALUES:+VALUES="$VALUES"} ${SCENARIO:+SCENARIO="$SCENARIO"} HARDWARE="${HARDWARE:-h200}"
               INVENTORY=inventory/container.yml PRECISION="${PRECISION:-default}" REPEATS="${REPEATS:-5}"
               EXPERIMENT="${EXPERIMENT:-h200-sweep-$param-$users-users}")
         common=("${common[@]/#DURATION=*/DURATION=${DURATION:-15}}")
         sets="$sets load.shape.level=$users run.start_timeout_s=300${WARMUP_RUNS:+ run.warmup_runs=$WARMUP_RUNS}"
         # The committed max-num-seqs sweeps of the default scenario are resumed, not taken again.
         [[ $param == max-num-seqs && -z ${SCENARIO:-} ]] && seed=reports/examples/h200-llama8b ;;
  # Claim 7 needs no run on vLLM 0.26 (swap-space is gone); claim 9 is the tp phase's sweep.
  # Two configurations at once where the host has two GPUs, one after the other where it has one.
  claims) seed=reports/examples/claims-h200
          if (( $(nvidia-smi -L | grep -c '^GPU') >= 2 )); then hosts=(SPREAD=1 INVENTORY=inventory/container-pair.yml)
          else hosts=(INVENTORY=inventory/container.yml); fi
          args=(claims CLAIMS=1-6,8 REPEATS="${REPEATS:-3}" "${hosts[@]}" EXPERIMENT="${EXPERIMENT:-claims-h200-regimes}")
          sets="$sets run.start_timeout_s=300 run.warmup_runs=1" ;;
  # TP 1 and 2 at 256 users, REPEATS runs a point (default 5) of DURATION s (default 30) after a
  # discarded run: the ratio with its interval (the committed tp-scaling-* are one 10-s run each).
  tp) args=(sweep PARAM=tensor-parallel-size VALUES=1,2 INVENTORY=inventory/container-tp.yml
            EXPERIMENT="${EXPERIMENT:-tp-repeats-llama-3-8b}" "${tp_repeats[@]}")
      common=("${common[@]/#DURATION=*/DURATION=${DURATION:-30}}")
      sets="$sets hardware.gpu_count=2 load.shape.level=256 $tp_sets" ;;
  tp70b)
      # The 70B shape: MODEL's tokenizer with a Llama-3-70B config (dummy weights, 131 GiB in bf16).
      model=$store/llama-3-70b
      mkdir -p "$model" && cp "$MODEL"/tokenizer* "$model"/
      "${LAB_PYTHON:-python3}" - "$MODEL/config.json" "$model/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
           num_key_value_heads=8)
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
PY
      args=(sweep PARAM=tensor-parallel-size VALUES=1,2 INVENTORY=inventory/container-tp.yml
            EXPERIMENT="${EXPERIMENT:-tp-repeats-llama-3-70b}" "${tp_repeats[@]}")
      # The base runs on 2 GPUs (one cannot hold it); TP 1 is then recorded as refused before launch.
      common=("${common[@]/#DURATION=*/DURATION=${DURATION:-30}}")
      sets="$sets hardware.gpu_count=2 load.shape.level=256 serve.tensor-parallel-size=2 $tp_sets" ;;
  # One configuration repeated in one server start: its coefficient of variation is the host's noise.
  baseline) args=(baseline ${SCENARIO:+SCENARIO="$SCENARIO"} HARDWARE="${HARDWARE:-h200}" INVENTORY=inventory/container.yml REPEATS="${REPEATS:-5}"
                  EXPERIMENT="${EXPERIMENT:-h200-baseline-repeats}")
            common=("${common[@]/#DURATION=*/DURATION=${DURATION:-30}}")
            sets="$sets run.start_timeout_s=300 run.warmup_runs=1" ;;
  # Every run of the plan has its own size (requests or seconds of arrivals): DURATION plays no part.
  calibrate) args=(calibrate HARDWARE="${HARDWARE:-h200}" INVENTORY=inventory/container.yml EXPERIMENT="${EXPERIMENT:-h200-calibrate}"
                   ${FIT:+FIT="$FIT"})
             sets="$sets run.start_timeout_s=300 run.warmup_runs=1" ;;
  # The staircase's levels last DURATION (30 s unless set); the search runs on the predictor for
  # the H200 preset, then the defaults and the best candidates are measured here.
  autotune) args=(autotune SCENARIO=realtime-chat HARDWARE="${HARDWARE:-h200}" INVENTORY=inventory/container.yml
                  EXPERIMENT="${EXPERIMENT:-autotune-realtime-chat-h200}" GPU_MINUTES="${GPU_MINUTES:-20}"
                  CONFIRM="${CONFIRM:-2}")
      common=("${common[@]/#DURATION=*/DURATION=${DURATION:-30}}")
      sets="$sets run.start_timeout_s=300 run.warmup_runs=1" ;;
  # A staircase of one configuration: its levels last DURATION (30 s unless set) after a discarded run.
  stress) shape=${SHAPE:-step}
          args=(stress SCENARIO="${SCENARIO:-realtime-chat}" SHAPE="$shape" LEVELS="${LEVELS:-}"
                HARDWARE="${HARDWARE:-h200}" INVENTORY=inventory/container.yml EXPERIMENT="${EXPERIMENT:-stress-$shape}")
          common=("${common[@]/#DURATION=*/DURATION=${DURATION:-30}}")
          sets="$sets run.start_timeout_s=300 run.warmup_runs=1" ;;
  *) echo "container_phase.sh: unknown phase $phase (sweep, claims, baseline, calibrate, tp, tp70b, autotune or stress)" >&2; exit 2 ;;
esac

# The max-num-seqs sweep and the claims continue the committed example's store, so the points it
# holds are resumed, not taken again. Its plan names the model folder /models/llama-3-8b: give
# MODEL that path (a link to the folder will do).
if [[ -n $seed && ! -e $store/lab.db ]]; then
  cp "$seed/lab.db" "$store/lab.db" && cp -r "$seed/lab.samples" "$store/"
fi

# Servers a killed earlier call left behind (they run in their own process groups) would hold
# the GPUs: make stop ends them through the same inventories.
if nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -q .; then
  for inv in inventory/container.yml inventory/container-pair.yml inventory/container-tp.yml; do
    make stop INVENTORY=$inv "${common[@]}" || true
  done
fi

set -m  # the lab runs in its own process group: the deadline interrupts all of it at once
make "${args[@]}" "${common[@]}" MODEL="$model" SET="$sets${SET:+ $SET}" > "$out/$phase.log" 2>&1 &
job=$!
( sleep "$((budget + 25))"; echo "container_phase.sh: deadline ($budget s): interrupting" >> "$out/$phase.log";
  kill -INT -- "-$job" 2>/dev/null ) &
watchdog=$!
wait $job; rc=$?
kill $watchdog 2>/dev/null
echo "$rc" > "$store/phase.rc"
snapshot
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >> "$out/$phase.log" 2>&1
tail -25 "$out/$phase.log"
echo "phase $phase: rc $rc"
exit $rc
