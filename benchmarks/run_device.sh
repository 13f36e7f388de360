#!/usr/bin/env bash
# One device call for every GPU check of the project (the H200 has no network; the repo is on PYTHONPATH).
# Each step has its own time limit; the combined log and the JSON/PNG results land in $OUT (8 files at most
# come back, so the per-script folders are bundled into one archive).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-device_out}
mkdir -p "$OUT" "$OUT/model" "$OUT/timing" "$OUT/detector" "$OUT/steps"
LOG="$OUT/all.log"
. benchmarks/step.sh  # step NAME LIMIT CMD...
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"
# the integration files whole, then every other test with the gpu mark
[ -n "${SKIP_TESTS:-}" ] || step gpu_tests "${GPU_TESTS_LIMIT:-120}" python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/hooks/test_gpu_integration.py tests/integrations/test_flash_attn_patch.py tests/kernels/test_triton_gpu.py ${GPU_TESTS_EXTRA:-}
[ -n "${SKIP_TESTS:-}" ] || step gpu_marked "${GPU_MARKED_LIMIT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
    $(grep -l "mark.gpu" tests/*/test_*.py | grep -v -e test_gpu_integration -e test_flash_attn_patch -e test_triton_gpu)
[ -n "${SKIP_MODEL:-}" ] || step model_check 140 python3 benchmarks/model_check.py --offset-sigma "${MODEL_OFFSET_SIGMA:-512}" --out "$OUT/model"
[ -n "${SKIP_AUTO:-}" ] || step auto_check 140 python3 benchmarks/auto_check.py --out "$OUT/auto_check.json"
[ -n "${SKIP_AUDIT:-}" ] || step audit 80 python3 -m gproj_patch audit --device cuda --no-progress --json "$OUT/audit_cuda.json" --plot "$OUT/audit_cuda.png"
[ -z "${SWEEP_ARGS:-}" ] || step sweep "${SWEEP_LIMIT:-90}" python3 benchmarks/kernel_sweep.py $SWEEP_ARGS --out "$OUT/timing"
[ -n "${SKIP_GLUON:-}" ] || step gluon_check "${GLUON_LIMIT:-150}" python3 benchmarks/gluon_check.py --out "$OUT/timing"
[ -n "${SKIP_TIMING:-}" ] || step timing "${TIMING_LIMIT:-150}" python3 benchmarks/device_check.py ${TIMING_ARGS:---skip-suite} --out "$OUT/timing"
[ -n "${SKIP_DETECTOR:-}" ] || step detector_cost 80 python3 benchmarks/detector_cost.py --out "$OUT/detector"
[ -z "${HOST_TRACE:-}" ] || step host_trace 120 python3 benchmarks/host_trace.py --shape 1,2,128,64 --out "$OUT/steps"
[ -z "${HOST_TRACE:-}" ] || step host_trace_d128 120 python3 benchmarks/host_trace.py --modes gproj --shape 1,2,128,128 --stack --out "$OUT/steps"
[ -n "${SKIP_STEPS:-}" ] || step host_overhead 200 python3 benchmarks/host_overhead.py ${STEPS_ARGS:-} --out "$OUT/steps"
(cd "$OUT" && tar czf bundle.tgz model timing detector steps 2>/dev/null && rm -rf model timing detector steps)
grep -E "^=== " "$LOG"
