#!/usr/bin/env bash
# Every check that needs a GPU, as ONE `run` call of at most 8 minutes, install included: a
# device lease is 15 minutes for a whole session, the machine's start included, so there is
# no second try to plan on. The most valuable checks come first; each has its own timeout,
# cut to what is left of the budget, and its figures are written to $OUT as they come, so a
# run stopped at any point still returns everything measured up to then.
#
# Prepared for the workplace's 'cuda' image, which the nvidia-h100-x1 and nvidia-h200 kinds
# share (python3.12 with a CUDA torch, nvidia-ml-py, no network); expect one H100 (~78 GiB).
# Before the call, on the development machine (pydantic is not in that image):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic pydantic-core annotated-types typing-inspection
# Then: run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=500).
# CEPHALO_DEVICE_BUDGET_SECONDS (default 470) is the whole script's budget.
set -uo pipefail
OUT=${OUT:-/tmp/cephalo-device-check}
mkdir -p "$OUT"
BUDGET=${CEPHALO_DEVICE_BUDGET_SECONDS:-470}
START=$SECONDS
log() { echo "== $* (t=$((SECONDS - START)) s)" | tee -a "$OUT/summary.log"; }

# step NAME SECONDS LOGFILE CMD...: run CMD with min(SECONDS, what is left) as its timeout,
# its whole output in $OUT/LOGFILE, its last lines and exit status in the summary.
step() {
  local name=$1 want=$2 file=$3; shift 3
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 20 ]; then
    log "SKIPPED $name: ${left} s of the budget left"; return 0
  fi
  log "$name (timeout ${limit} s)"
  # -k: a command that turns SIGTERM into a checkpoint (the CLI) is killed 10 s later.
  timeout -k 10 "$limit" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  grep -v '^\[' "$OUT/$file" | tail -14 | tee -a "$OUT/summary.log"
  log "$name: exit $rc$( { [ $rc = 124 ] || [ $rc = 137 ]; } && echo ' (timed out)')"
}

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/summary.log"
if [ -d .whl ]; then
  python3 -I -m pip install -q --no-index --find-links .whl pydantic 2>&1 | tail -2
fi
python3 -I -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd /tmp  # never run from the checkout: its operator/ folder must not shadow the stdlib
REPO=$OLDPWD
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1 \
  | tee -a "$OUT/summary.log"
# Preflight: an install that cannot import the trainer, the profiler or the probe stops the
# check at once, saying what is missing, instead of every step failing on its own timeout.
if ! timeout -k 5 60 python3 -c '
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

# 1. The GPU tests (CUDA paths of the engine, checkpoints, the profiler). Test modules that
# import what the image lacks (transformers, moto, ...) must not stop the rest.
step "GPU tests" 90 gpu-tests.log \
  python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
  "$REPO/tests/trainer" "$REPO/tests/unit"

# 2. The NCCL path: one real NCCL rank through the trainer's own collectives (all-gather,
# reduce-scatter of uneven shards), then 3. the planner's input measured on this GPU.
cat > /tmp/gpt13.yaml <<'YAML'
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: h200-profile}
spec:
  model: {preset: gpt-1.3b}
  globalBatchSize: 64
  planner: {profileMicroBatchSizes: [1, 2, 4, 8]}
YAML
step "profile of this GPU for gpt-1.3b (the planner's input)" 70 profile.log \
  python3 -m cephalo.trainer.profile --job /tmp/gpt13.yaml --device cuda \
  --output "$OUT/profile-h200-gpt-1.3b.json" --cache-dir none
python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print(p['product'], [(q['micro_batch_size'], round(q['block_forward_seconds']*1e3,2), q['compute_memory_bytes']) for q in p['points']])" \
  "$OUT/profile-h200-gpt-1.3b.json" 2>&1 | tee -a "$OUT/summary.log"

# 4. The main job on the GPU: `cephalo run` plans, launches an NCCL rank, trains, checkpoints.
step "cephalo run on the GPU (NCCL)" 80 cephalo-run.log \
  cephalo run "$REPO/examples/quickstart.yaml" --devices cuda --steps 20

# 5. fp32, bf16 and fp16 (dynamic loss scale) with the engine on this GPU (issue 36): gpt-1.3b,
# batch 8 x 512 tokens, 8 steps alternated across the precisions: step time, TFLOP/s, MFU
# against the catalog's peak per precision, loss agreement with fp32, fp16's scale and
# skipped steps. Three ~23 GB engines; the seeded weights are drawn once (~30 s).
step "fp32 / bf16 / fp16 on one GPU, gpt-1.3b (MFU, loss agreement)" 90 precisions.log \
  python3 "$REPO/bench/precision_device.py" --device cuda --preset gpt-1.3b --batch 8 \
  --steps 8 --output "$OUT/precisions-gpt-1.3b.json"

# 6. Cephalo vs FSDP2 on one GPU, gpt-1.3b, 4 microbatches of 2 x 512 tokens: step time,
# TFLOP/s, MFU and peak memory per contender. Each holds ~23 GB; the first draws the seeded
# weights on one CPU core (~30 s).
step "Cephalo vs FSDP2 on one GPU, gpt-1.3b, fp32" 130 fsdp2-gpt-1.3b-fp32.log \
  python3 "$REPO/bench/fsdp2.py" --device cuda --preset gpt-1.3b --rounds 3

# What is left of the budget: bf16, the engine's overhead, the cost model on this GPU, fp16
# end to end.
step "Cephalo vs FSDP2 on one GPU, gpt-1.3b, bf16 autocast" 90 fsdp2-gpt-1.3b-bf16.log \
  python3 "$REPO/bench/fsdp2.py" --device cuda --preset gpt-1.3b --precision bf16 --rounds 3
step "engine overhead at GPT-1.3B scale (TFLOPS, MFU)" 90 engine-overhead.log \
  python3 "$REPO/bench/engine_overhead.py" --device cuda --preset gpt-1.3b --batch 8 --rounds 3
step "cost-model accuracy on this GPU" 90 cost-model.log \
  python3 "$REPO/bench/cost_model.py" --device cuda --quick --presets gpt-small,llama-tiny
# Last, as time allows: the job end to end in fp16 (its loss scale agreed over NCCL).
cat > /tmp/quickstart-fp16.yaml <<'YAML'
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
step "cephalo run on the GPU in fp16 (NCCL, loss scaling)" 60 cephalo-run-fp16.log \
  cephalo run /tmp/quickstart-fp16.yaml --devices cuda --steps 20
log "done"
