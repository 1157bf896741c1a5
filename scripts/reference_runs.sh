#!/usr/bin/env bash
# The reference runs of a GPU host with vLLM installed (inventory/container.yml): the lab's client
# beside `vllm bench serve` on every traffic kind (closed loops of fixed and variable lengths,
# Poisson and gamma arrivals, chat), the twin's reference set (open loops up to saturation, a
# scenario's own traffic, small token budgets, a long-prefill threshold) and real vLLM's engine
# step times by batch composition; the GPU's power and energy counter logged all along. Phases
# share one server start where their flags agree, and keep what they took in STORE between calls.
#
#   MODEL=/models/llama-3-8b VLLM_VENV=/opt/vllm bash scripts/reference_runs.sh PHASE [PHASE ...]
#
# PHASE: start (vLLM with its defaults), parity-a (closed loops of 1-512 users), parity-b (1024
#        users, a ShareGPT-format file at 64 and 256 users, Poisson at two rates, gamma with
#        burstiness 0.5, chat at 64 users), repeats (runs of each tool taking turns: 64 users and
#        the ShareGPT file at 64, three of the bench and five of the lab, as repeats-closed; Poisson
#        at 30 and 45 req/s, three of each, as repeats-open; parity.csv gives medians),
#        parity-schedule (Poisson at the two rates and gamma arrivals, a minute each, the lab
#        replaying each bench run's own send times: one arrival schedule on both sides), open
#        (Poisson up to saturation, the realtime-chat traffic at four rates), fixedfile (closed
#        loops of 1, 16 and 64 users on a ShareGPT-format file of the lab's fixed-length prompts,
#        both tools), frontend (the ShareGPT file at 128, 256 and 512 users, both tools: the API
#        server near its core's limit), stream and admit (the API server's costs apart: long replies
#        at 64-512 users, long prompts at 1-64, the bench alone), api4 (restarts with
#        api-server-count=4: long replies at 256 and 512 users, realtime-chat at 48 req/s), budget
#        (restarts with max-num-batched-tokens=2048: Poisson and the ShareGPT file), threshold (restarts with long-prefill-token-threshold=256),
#        loop (a restart with scripts/gc_probe in the API server and the bench: their event loops'
#        lag every 20 ms beside Poisson at the higher rate on one schedule, then the ShareGPT file
#        at 256 users; the probe's lines in STORE/probe), steps
#        (stops the server; bench_step_times.py), idle (30 s of the idle GPU's power), stop, pack.
# MODEL (required) is the model folder (config and tokenizer; weights are dummy). VLLM_VENV and
# LAB_ROOT go to the inventory; STORE (default /tmp/reference) keeps everything; OUT (default
# /tmp/out) gets the packed results; RATES overrides the parity Poisson rates (default 25,40);
# INVENTORY and BACKEND (default inventory/container.yml, vllm) another host or the twin; CASES
# parity-schedule's cases (each takes about four minutes: one a call where calls are limited), RUNS
# its turns (two pairs by default) and OPEN_S its seconds of arrivals (60).
set -uo pipefail
: "${MODEL:?MODEL is required: the model folder on this host}"
store=${STORE:-/tmp/reference}
out=${OUT:-/tmp/out}
py=${LAB_PYTHON:-python3}
mkdir -p "$store" "$out"
export LC_ALL=C.UTF-8 LAB_MAKE_VLLM_VENV=${VLLM_VENV:-} LAB_MAKE_LAB_ROOT=${LAB_ROOT:-}
inv=${INVENTORY:-inventory/container.yml}
parity() { "$py" scripts/bench_client_parity.py "$1" --inventory "$inv" --backend "${BACKEND:-vllm}" \
             --model "$MODEL" --out "$store/$2" "${@:3}"; }
# The URL of the server a phase's store started (open measures on parity's server, not its own).
url_of() { "$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["url"])' "$store/$1/server.json"; }
rates=${RATES:-25,40}
r1=${rates%,*}; r2=${rates#*,}

# The power log runs in a session of its own, so it outlives each call and covers every phase.
if ! { [ -f "$store/power.pid" ] && kill -0 "$(cat "$store/power.pid")" 2>/dev/null; }; then
  setsid nohup "$py" scripts/gpu_power_log.py "$store/power.csv" --every-ms 250 >/dev/null 2>&1 &
  echo $! > "$store/power.pid"
fi

for phase in "$@"; do
  echo "== $phase $(date -u +%FT%TZ)"
  case $phase in
    start) parity start parity ;;
    parity-a) parity measure parity --cases closed:1,closed:16,closed:64,closed:256,closed:512 \
                --requests-per-user 3 --min-requests 24 ;;
    parity-b) parity measure parity --cases closed:1024,sharegpt:64,sharegpt:256,poisson:$r1,poisson:$r2,gamma:30:0.5,chat:64 \
                --requests-per-user 2 --sharegpt-per-user 4 --open-s 20 --min-requests 24
              parity csv parity ;;
    # Runs of each tool taking turns, where one run of each left the difference unsure: three of
    # the bench, five of the lab (whose spread over five is the precision its examples quote).
    # Closed loops and open loops are two phases, each within one call of ten minutes.
    repeats|repeats-closed)
      parity measure parity-repeats --url "$(url_of parity)" --runs bench+lab+bench+lab+bench+lab+lab+lab \
        --cases closed:64,sharegpt:64 --sharegpt-per-user 10 --requests-per-user 4 --min-requests 64 ;;&
    repeats|repeats-open)
      parity measure parity-repeats --url "$(url_of parity)" --runs bench+lab+bench+lab+bench+lab \
        --cases poisson:30,poisson:45 --open-s 30
      parity csv parity-repeats ;;
    repeats-closed) ;;
    # Open loops on one arrival schedule: each lab run replays the send times and lengths of the
    # bench run just before it, so the two differ only by their client and the server's own
    # run-to-run spread; a minute of arrivals each, twice, at two rates and gamma arrivals.
    parity-schedule)
      parity measure parity-schedule --url "$(url_of parity)" --open-s "${OPEN_S:-60}" \
        --runs "${RUNS:-bench+lab:schedule=bench+bench+lab:schedule=bench}" \
        --cases "${CASES:-poisson:$r1,poisson:$r2,gamma:30:0.5}"
      parity csv parity-schedule ;;
    # The lab's own fixed-length prompts in a ShareGPT-format file, sent by both: the closed loops'
    # TTFT gap with the prompt's text the same on both sides.
    fixedfile) parity measure parity-fixedfile --url "$(url_of parity)" \
                 --cases filefixed:1,filefixed:16,filefixed:64 --requests-per-user 3 --min-requests 24 ;;
    # The API server near and past its one core: the ShareGPT file at 128, 256 and 512 users.
    frontend) parity measure twin-frontend --url "$(url_of parity)" --sharegpt-per-user 4 \
                --cases sharegpt:128,sharegpt:256,sharegpt:512 ;;
    # The API server's costs taken apart, the bench alone: streaming (64-token prompts, 512-token
    # replies) at 64-512 users, where its one event loop's work per streamed token sets the
    # throughput it can carry; admission (2048-token prompts, 8-token replies) at 1-64 users,
    # where each prompt's tokenizing and hand-off to the engine queue behind one another.
    stream) parity measure twin-stream --url "$(url_of parity)" --runs bench --input-len 64 \
              --output-len 512 --requests-per-user 2 --min-requests 128 \
              --cases closed:64,closed:128,closed:256,closed:512 ;;
    admit) parity measure twin-admit --url "$(url_of parity)" --runs bench --input-len 2048 \
             --output-len 8 --requests-per-user 4 --min-requests 16 \
             --cases closed:1,closed:16,closed:64 ;;
    # Four API-server processes (--api-server-count 4): the streaming case where one loop binds,
    # and the realtime-chat traffic past one process's limit.
    api4) parity stop parity
          parity start twin-api4 --set serve.api-server-count=4
          parity measure twin-api4 --runs bench --set serve.api-server-count=4 --input-len 64 \
            --output-len 512 --requests-per-user 2 --cases closed:256,closed:512
          parity measure twin-api4 --runs lab --set serve.api-server-count=4 --open-s 25 \
            --cases realtime-chat/poisson:48 ;;
    open) parity measure twin-open --url "$(url_of parity)" --runs bench --open-s 20 \
            --cases poisson:10,poisson:50,poisson:60
          parity measure twin-open --url "$(url_of parity)" --runs lab --open-s 25 \
            --cases realtime-chat/poisson:20,realtime-chat/poisson:30,realtime-chat/poisson:36,realtime-chat/poisson:42 ;;
    budget|threshold)
      flag=$([ "$phase" = budget ] && echo max-num-batched-tokens=2048 || echo long-prefill-token-threshold=256)
      parity stop parity
      parity start "twin-$phase" --set "serve.$flag"
      parity measure "twin-$phase" --runs bench --set "serve.$flag" --open-s 20 --sharegpt-per-user 4 \
        --cases poisson:$r1,poisson:$r2,sharegpt:64 ;;
    # Which event loop holds a stream: vLLM's API server's or the client's. The probe is picked up
    # by every Python process started with its folder on PYTHONPATH (the playbooks pass the
    # environment on) whose command line matches LAB_GC_PROBE_MATCH: `vllm serve`, and this
    # script's parity process, which runs `vllm bench serve` in itself (its loop is the bench's).
    loop) parity stop parity
          export PYTHONPATH=$PWD/scripts/gc_probe${PYTHONPATH:+:$PYTHONPATH} LAB_GC_PROBE=$store/probe \
                 LAB_GC_PROBE_MATCH='(^|\s)serve(\s|$)|bench_client_parity\.py'
          parity start parity
          parity measure twin-loop --url "$(url_of parity)" --open-s "${OPEN_S:-60}" \
            --runs bench+lab:schedule=bench --cases poisson:$r2
          parity measure twin-loop --url "$(url_of parity)" --runs lab+bench --sharegpt-per-user 3 \
            --cases sharegpt:256
          unset LAB_GC_PROBE ;;
    steps) parity stop parity
           "$py" scripts/bench_step_times.py --model "$MODEL" --out "$store/steps.jsonl" --time-limit-s 200 ;;
    idle) sleep 30 ;;
    stop) parity stop parity ;;
    # In parts of at most 15 MiB: what a job's output folder takes back may be limited per file.
    pack) tar -C "$store" -cf - --exclude '*.pid' . | xz -T0 -6 | split -b 15M -d -a 1 - "$out/reference.tar.xz."
          ls -la "$out" ;;
    *) echo "reference_runs.sh: unknown phase $phase" >&2; exit 2 ;;
  esac
done
