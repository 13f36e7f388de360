#!/usr/bin/env bash
# One device call for every GPU check of the project (the H200 has no network; the repo is on PYTHONPATH).
# Each step has its own time limit; the combined log and the JSON/PNG results land in $OUT (8 files at most
# come back, so the per-script folders are bundled into one archive).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-device_out}
mkdir -p "$OUT"
LOG="$OUT/all.log"
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"
step gpu_tests 110 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_integration.py tests/test_flash_attn_patch.py ${GPU_TESTS_EXTRA:-}
step model_check 140 python3 benchmarks/model_check.py --offset-sigma "${MODEL_OFFSET_SIGMA:-512}" --out "$OUT/model"
step auto_check 140 python3 benchmarks/auto_check.py --out "$OUT/auto_check.json"
[ -n "${SKIP_AUDIT:-}" ] || step audit 80 python3 -m gproj_patch audit --device cuda --no-progress --json "$OUT/audit_cuda.json" --plot "$OUT/audit_cuda.png"
[ -n "${SKIP_TIMING:-}" ] || step timing 100 python3 benchmarks/device_check.py --skip-suite --out "$OUT/timing"
(cd "$OUT" && tar czf bundle.tgz model timing 2>/dev/null && rm -rf model timing)
grep -E "^=== " "$LOG"
