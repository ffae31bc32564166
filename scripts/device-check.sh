#!/usr/bin/env bash
# Every check that needs a GPU, as ONE `run` call of at most 8 minutes, install included, on
# ONE H100 (~78 GiB; an H200 has more): a device lease is 15 minutes for a whole session,
# the machine's start included, so there is no second try to plan on. The most valuable
# checks come first; each has its own timeout (`timeout -k`), cut to what is left of the
# budget, and its figures go to $OUT as they come, so a run stopped at any point still
# returns everything measured up to then. No step holds more than two gpt-1.3b states
# (~23 GB each) on the GPU at once.
#
# What comes back ($OUT, at most 8 files): summary.log (what a person reads), summary.jsonl
# (one JSON object per step: exit status, seconds, the step's figures; appended as each
# step ends, by scripts/device_check_summary.py) and logs.tar.gz (every step's whole log,
# re-made after each step).
#
# Prepared for the workplace's 'cuda' image, which the nvidia-h100-x1 and nvidia-h200 kinds
# share (python3.12 with a CUDA torch, nvidia-ml-py, no network). Before the call, on the
# development machine (pydantic is not in that image):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic pydantic-core annotated-types typing-inspection
# Then: run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=500).
#
# Dry run on the CPU (`--cpu`, or CEPHALO_DEVICE_CHECK_DEVICE=cpu): the same steps with tiny
# models over gloo, in the caller's environment (no install, no nvidia-smi), so that the
# script cannot break unseen (tests/trainer/test_device_check.py runs its cheapest step).
# CEPHALO_DEVICE_CHECK_ONLY=nccl,run runs only the named steps (keys: nccl run profile
# precisions fsdp2 gpu-tests fsdp2-bf16 overhead cost-model run-fp16); others are skipped.
# CEPHALO_DEVICE_CHECK_PYTHON (default python3) is the interpreter;
# CEPHALO_DEVICE_BUDGET_SECONDS (default 470) is the whole script's budget.
set -uo pipefail
DEVICE=${CEPHALO_DEVICE_CHECK_DEVICE:-cuda}
[ "${1:-}" = "--cpu" ] && DEVICE=cpu
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
  echo "device-check.sh: error: CEPHALO_DEVICE_CHECK_DEVICE=$DEVICE: give cuda or cpu" >&2
  exit 2
fi
PY=${CEPHALO_DEVICE_CHECK_PYTHON:-python3}
ONLY=${CEPHALO_DEVICE_CHECK_ONLY:-}
OUT=${OUT:-/tmp/cephalo-device-check}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/cephalo-device-check-work.XXXXXX)  # logs and figures, tarred to $OUT
trap 'rm -rf "$WORK"' EXIT
BUDGET=${CEPHALO_DEVICE_BUDGET_SECONDS:-470}
START=$SECONDS
REPO=$(cd "$(dirname "$0")/.." && pwd)
SUMMARY="$REPO/scripts/device_check_summary.py"
log() { echo "== $* (t=$((SECONDS - START)) s)" | tee -a "$OUT/summary.log"; }
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
# (checkpoints: large, and nothing to read in them)
pack() { tar -czf "$OUT/logs.tar.gz" --exclude=checkpoints -C "$WORK" . 2>/dev/null; }

# step KEY NAME SECONDS FIGURES CMD...: run CMD with min(SECONDS, what is left) as its
# timeout, its whole output in $WORK/KEY.log (FIGURES "stdout:F": its stdout alone in F, the
# figures; else FIGURES is the JSON file CMD writes, or "-" for none), its last lines and
# exit status in the summary, one line of summary.jsonl.
step() {
  local key=$1 name=$2 want=$3 figures=$4; shift 4
  if ! wanted "$key"; then log "SKIPPED $name: not in CEPHALO_DEVICE_CHECK_ONLY"; return 0; fi
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 20 ]; then
    log "SKIPPED $name: ${left} s of the budget left"; return 0
  fi
  log "$name (timeout ${limit} s)"
  local began=$SECONDS rc
  # -k: a command that turns SIGTERM into a checkpoint (the CLI) is killed 10 s later.
  if [[ $figures == stdout:* ]]; then
    figures=${figures#stdout:}
    timeout -k 10 "$limit" "$@" > "$figures" 2> "$WORK/$key.log"; rc=$?
  else
    timeout -k 10 "$limit" "$@" > "$WORK/$key.log" 2>&1; rc=$?
  fi
  grep -v '^\[' "$WORK/$key.log" | tail -14 | tee -a "$OUT/summary.log"
  log "$name: exit $rc$( { [ $rc = 124 ] || [ $rc = 137 ]; } && echo ' (timed out)')"
  local files=(); [ "$figures" = - ] || files=("$figures")
  "$PY" "$SUMMARY" step "$OUT/summary.jsonl" "$key" "$name" "$rc" "$((SECONDS - began))" \
    "$limit" "${files[@]}"
  pack
}

log "device-check on $DEVICE"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 \
    | tee -a "$OUT/summary.log"
  if [ -d "$REPO/.whl" ]; then
    "$PY" -I -m pip install -q --no-index --find-links "$REPO/.whl" pydantic 2>&1 | tail -2
  fi
  "$PY" -I -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1 | tail -2
fi
cd /tmp  # never run from the checkout: its operator/ folder must not shadow the stdlib
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1 \
  | tee -a "$OUT/summary.log"
# Preflight: an install that cannot import the trainer, the profiler or the probe stops the
# check at once, saying what is missing, instead of every step failing on its own timeout.
if ! timeout -k 5 60 "$PY" -c '
import importlib, sys
missing = []
for name in ("cephalo.trainer.run", "cephalo.trainer.profile", "cephalo.trainer.netprobe",
             "cephalo.trainer.profile_collectives", "cephalo.cli"):
    try:
        importlib.import_module(name)
    except Exception as err:  # ImportError, or a module that fails as it loads
        missing.append(f"{name}: {type(err).__name__}: {err}")
print("\n".join(missing) or "preflight: the trainer, the profiler and the probe import")
sys.exit(1 if missing else 0)' 2>&1 | tee -a "$OUT/summary.log"; then
  log "STOPPED: the install is incomplete (above); carry the missing wheels in .whl"
  exit 2
fi

# Sizes: the GPU's, and the dry run's tiny ones.
if [ "$DEVICE" = cuda ]; then
  PRESET=gpt-1.3b; MBS="[1, 2, 4, 8]"; RUN_STEPS=20; NCCL_ARGS=(); PREC_ARGS=(--batch 8 --steps 8)
  FSDP2_ARGS=(--preset gpt-1.3b --rounds 3); COST_PRESETS=gpt-small,llama-tiny
else
  PRESET=gpt-tiny; MBS="[1, 2]"; RUN_STEPS=3; NCCL_ARGS=(--elements 65536)
  PREC_ARGS=(--quick --threads 1); FSDP2_ARGS=(--quick --rounds 1 --micro-batches 1)
  COST_PRESETS=gpt-tiny
fi

# 1. Every collective the engine, the profiler and the probe issue, on one NCCL rank (at
# world size 1 the trainer's collectives short-circuit: bench/nccl_check.py issues the
# backend's calls itself, and the wait clock's CUDA events), then a 2-rank engine step on
# the one GPU over gloo (uneven shards) against CPU ranks. The probe
# (`python -m cephalo.trainer.netprobe`) and `cephalo profile --collectives` refuse fewer
# than 2 ranks (a link is measured between two) and one GPU gives one NCCL rank: not run.
step nccl "NCCL collectives at world size 1, 2 gloo ranks on one $DEVICE" 60 "$WORK/nccl.json" \
  "$PY" "$REPO/bench/nccl_check.py" --device "$DEVICE" "${NCCL_ARGS[@]}" \
  --output "$WORK/nccl.json"

# 2. The main job on the GPU: `cephalo run` plans, launches an NCCL rank, trains,
# checkpoints; then every rank's peak GPU memory against the plan (the trainer's line).
step run "cephalo run on the $DEVICE" 80 - \
  "$PY" -m cephalo.cli run "$REPO/examples/quickstart.yaml" --devices "$DEVICE" \
  --steps "$RUN_STEPS" --run-dir "$WORK/run"
if wanted run; then
  "$PY" "$SUMMARY" run-memory "$WORK/run" "$WORK/run-memory.json" 2>&1 | tail -3
  "$PY" "$SUMMARY" step "$OUT/summary.jsonl" run-memory \
    "peak GPU memory per rank against the plan" 0 0 0 "$WORK/run-memory.json"
  tee -a "$OUT/summary.log" < "$WORK/run-memory.json"
fi

# 3. The planner's input measured on this GPU (the profiler builds only the units it times).
cat > "$WORK/profile-job.yaml" <<YAML
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: device-check-profile}
spec:
  model: {preset: $PRESET}
  globalBatchSize: 64
  planner: {profileMicroBatchSizes: $MBS}
YAML
step profile "profile of this $DEVICE for $PRESET (the planner's input)" 60 "$WORK/profile.json" \
  "$PY" -m cephalo.trainer.profile --job "$WORK/profile-job.yaml" --device "$DEVICE" \
  --output "$WORK/profile.json" --cache-dir none

# 4. fp32, bf16 and fp16 (dynamic loss scale) with the engine (issue 36): gpt-1.3b, batch
# 8 x 512 tokens, 8 steps per precision: step time, TFLOP/s, MFU against the catalog's peak,
# loss agreement with fp32, fp16's scale and skipped steps, and each engine's peak memory
# against its estimate. ONE ~23 GB engine at a time (--alive 1: three side by side do not
# fit an H100 safely); the seeded weights are drawn once (~30 s) and copied.
step precisions "fp32 / bf16 / fp16, $PRESET, one engine at a time (MFU, memory)" 100 \
  "$WORK/precisions.json" \
  "$PY" "$REPO/bench/precision_device.py" --device "$DEVICE" --preset "$PRESET" --alive 1 \
  "${PREC_ARGS[@]}" --output "$WORK/precisions.json"

# 5. Cephalo vs FSDP2 on one GPU, gpt-1.3b, 4 microbatches of 2 x 512 tokens: step time,
# TFLOP/s, MFU and peak memory per contender. Two contenders (~23 GB each, side by side):
# the four of a full run would need ~92 GB.
step fsdp2 "Cephalo vs FSDP2 on one $DEVICE, fp32" 110 "stdout:$WORK/fsdp2.json" \
  "$PY" "$REPO/bench/fsdp2.py" --device "$DEVICE" "${FSDP2_ARGS[@]}" --json \
  --contenders "cephalo recompute,fsdp2 per-microbatch"

# 6. The GPU tests (CUDA paths of the engine, checkpoints, the profiler). Test modules that
# import what the image lacks (transformers, moto, ...) must not stop the rest. On the CPU
# they skip themselves: not run in the dry run.
if [ "$DEVICE" = cuda ]; then
  step gpu-tests "GPU tests" 60 - \
    "$PY" -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
    "$REPO/tests/trainer" "$REPO/tests/unit"
fi

# What is left of the budget: bf16, the engine's overhead, the cost model on this GPU, fp16
# end to end.
step fsdp2-bf16 "Cephalo vs FSDP2 on one $DEVICE, bf16 autocast" 80 \
  "stdout:$WORK/fsdp2-bf16.json" \
  "$PY" "$REPO/bench/fsdp2.py" --device "$DEVICE" "${FSDP2_ARGS[@]}" --precision bf16 \
  --json --contenders "cephalo recompute,fsdp2 per-microbatch"
step overhead "engine overhead at $PRESET scale (TFLOPS, MFU)" 60 - \
  "$PY" "$REPO/bench/engine_overhead.py" --device "$DEVICE" --preset "$PRESET" --batch 8 \
  --rounds 3
step cost-model "cost-model accuracy on this $DEVICE" 60 - \
  "$PY" "$REPO/bench/cost_model.py" --device "$DEVICE" --quick --presets "$COST_PRESETS"
# Last, as time allows: the job end to end in fp16 (its loss scale agreed over NCCL); fp16
# is a GPU precision.
if [ "$DEVICE" = cuda ]; then
  cat > "$WORK/quickstart-fp16.yaml" <<'YAML'
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: quickstart-fp16}
spec:
  model: {preset: gpt-small}
  globalBatchSize: 24
  precision: fp16
  training: {steps: 20, learningRate: 3.0e-3, warmupSteps: 3}
  data: {synthetic: {}}
  planner: {profileMicroBatchSizes: [1, 2, 4, 8]}
  checkpoint: {intervalSteps: 10}
YAML
  step run-fp16 "cephalo run on the GPU in fp16 (NCCL, loss scaling)" 60 - \
    "$PY" -m cephalo.cli run "$WORK/quickstart-fp16.yaml" --devices cuda --steps 20 \
    --run-dir "$WORK/run-fp16"
fi
pack
log "done"
