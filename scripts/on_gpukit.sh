#!/usr/bin/env bash
# One phase of the lab on a device machine with ../shared/gpu-kit (2 H200s: the device tool's
# nvidia-h200-x2), within one call's 10 minutes. The store lives in /tmp/lab between the calls of
# one warm machine; each phase copies it (and a log) to $OUT, which the device tool brings back.
#
#   run: source .gpukit/bin/install.sh >/dev/null && bash scripts/on_gpukit.sh PHASE   (carry .gpukit/bin)
#
# PHASE: claims (the guide's claims 1-6 and 8, two configurations at once, one per GPU),
#        tp (tensor-parallel-size 1,2 on the Llama-3-8B shape), tp70b (the 70B shape, which needs 2).
# BUDGET_S (default 520) bounds the phase: then the lab is interrupted as Ctrl-C would, so it
# stops its servers and keeps every finished run; calling the phase again resumes it.
set -uo pipefail
phase=${1:?usage: on_gpukit.sh claims|tp|tp70b}
budget=${BUDGET_S:-520}
store=/tmp/lab
out=${OUT:-/tmp/out}
mkdir -p "$store" "$out"
export LC_ALL=C.UTF-8
# Never let NCCL, PyTorch or NVSHMEM use NVLink multicast on a shared host (KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

model=$GPUKIT_MODEL
sets="serve.load-format=dummy workload.tokenizer=$GPUKIT_MODEL"
common=(LAB_PYTHON=python3 BACKEND=vllm OUT="$store" DURATION="${DURATION:-10}")

case $phase in
  # Claim 7 needs no run on vLLM 0.26 (swap-space is gone); claim 9 is the tp phase's sweep.
  claims) args=(claims CLAIMS=1-6,8 SPREAD=1 INVENTORY=inventory/gpukit-pair.yml EXPERIMENT=claims-h200) ;;
  tp) args=(sweep PARAM=tensor-parallel-size VALUES=1,2 INVENTORY=inventory/gpukit-x2.yml
            EXPERIMENT=tp-scaling-llama-3-8b)
      sets="$sets hardware.gpu_count=2 load.shape.level=256" ;;
  tp70b)
      # The 70B shape: the kit's tokenizer with a Llama-3-70B config (dummy weights, 131 GiB in bf16).
      model=/tmp/model-llama70b
      mkdir -p $model && cp "$GPUKIT_MODEL"/tokenizer* $model/
      python3 - "$GPUKIT_MODEL/config.json" $model/config.json <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
           num_key_value_heads=8)
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
EOF
      args=(sweep PARAM=tensor-parallel-size VALUES=1,2 INVENTORY=inventory/gpukit-x2.yml
            EXPERIMENT=tp-scaling-llama-3-70b)
      # The base runs on 2 GPUs (one cannot hold it); TP 1 is then recorded as refused before launch.
      sets="$sets hardware.gpu_count=2 load.shape.level=256 serve.tensor-parallel-size=2" ;;
  *) echo "on_gpukit.sh: unknown phase $phase (claims, tp or tp70b)" >&2; exit 2 ;;
esac

# The TP phases continue the committed example's store, so the runs it holds (TP 1 of the 8B
# shape) are resumed, not taken again.
seed=reports/examples/tp-scaling-h200
if [[ $phase == tp* && ! -e $store/lab.db ]]; then
  cp "$seed/lab.db" "$store/lab.db" && cp -r "$seed/lab.samples" "$store/"
fi

# Servers a killed call left behind (they run in their own sessions) would hold the GPUs.
if nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -q .; then
  python3 -c 'import sys; from pathlib import Path; from vllm_lab import serving
for inv in sys.argv[1:]: serving.stop(Path(inv))' inventory/gpukit-pair.yml inventory/gpukit-x2.yml || true
fi

set -m  # the lab runs in its own process group: the deadline interrupts all of it at once
make "${args[@]}" "${common[@]}" MODEL=$model SET="$sets" > "$out/$phase.log" 2>&1 &
job=$!
( sleep "$budget"; echo "on_gpukit.sh: deadline ($budget s): interrupting" >> "$out/$phase.log";
  kill -INT -- "-$job" 2>/dev/null ) &
watchdog=$!
wait $job; rc=$?
kill $watchdog 2>/dev/null
# A consistent copy of the store (WAL included), and the raw samples beside it.
python3 -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))' \
  "$store/lab.db" "$out/lab.db"
tar czf "$out/samples.tgz" -C "$store" --exclude .work --exclude 'lab.db*' . 2>/dev/null
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >> "$out/$phase.log" 2>&1
tail -25 "$out/$phase.log"
echo "phase $phase: rc $rc"
exit $rc
