#!/usr/bin/env bash
# The GPU checks, as ONE command for a lent accelerator machine (a lease is 15 minutes for a
# whole session, so everything that needs a GPU runs here in one go). Prepared for the
# workplace's nvidia-h200 image (python3.12 with a CUDA torch, no network); not yet run,
# because the session that wrote it had no device.
#
# Before the call, on the development machine (pydantic is not in that image):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic pydantic-core annotated-types typing-inspection
# Then: run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=590)
set -uo pipefail
OUT=${OUT:-/tmp/cephalo-device-check}
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/summary.log"; }

log "device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/summary.log"
if [ -d .whl ]; then
  python3 -I -m pip install -q --no-index --find-links .whl pydantic 2>&1 | tail -2
fi
python3 -I -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd /tmp  # never run from the checkout: its operator/ folder must not shadow the stdlib
REPO=$OLDPWD

log "GPU tests"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/trainer" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3

log "engine overhead at GPT-1.3B scale (TFLOPS, MFU)"
timeout 160 python3 "$REPO/bench/engine_overhead.py" --device cuda --preset gpt-1.3b --batch 8 \
  --rounds 4 2>&1 | tee "$OUT/engine-overhead.log" | tail -8

log "profile of this GPU for gpt-1.3b (the planner's input)"
cat > /tmp/gpt13.yaml <<'YAML'
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: h200-profile}
spec:
  model: {preset: gpt-1.3b}
  globalBatchSize: 64
  planner: {profileMicroBatchSizes: [1, 2, 4, 8]}
YAML
timeout 100 python3 -m cephalo.trainer.profile --job /tmp/gpt13.yaml --device cuda \
  --output "$OUT/profile-h200-gpt-1.3b.json" --cache-dir none 2>&1 | tail -3
python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print(p['product'], [(q['micro_batch_size'], round(q['block_forward_seconds']*1e3,2), q['compute_memory_bytes']) for q in p['points']])" \
  "$OUT/profile-h200-gpt-1.3b.json" 2>&1 | tee -a "$OUT/summary.log"

log "cephalo run on the GPU"
timeout 100 cephalo run "$REPO/examples/quickstart.yaml" --devices cuda --steps 20 2>&1 \
  | grep -v '^\[' | tail -12 | tee -a "$OUT/summary.log"

log "cost-model accuracy on this GPU (issue 4: the same comparison as on CPU)"
timeout 150 python3 "$REPO/bench/cost_model.py" --device cuda --quick \
  --presets gpt-small,llama-tiny 2>&1 | tee "$OUT/cost-model.log" | tail -16
