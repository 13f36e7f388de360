#!/usr/bin/env bash
# Issue 13's multi-GPU runs in one call (nvidia-h200-x2, ≤ 8 minutes); the short table is printed last.
#   bash benchmarks/multi_gpu_check.sh          # 2 GPUs: NCCL ranks
#   bash benchmarks/multi_gpu_check.sh --cpu    # the same steps on two gloo ranks (small sizes; ~2 min on 2 cores)
# Logs and JSON land in $OUT (default multi_gpu_out). See benchmarks/multi_gpu_check.py for what each part checks.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-multi_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/all.log"
: >"$LOG"
SHARD_ARGS=()
if [ "${1:-}" = "--cpu" ]; then
    export CUDA_VISIBLE_DEVICES="" ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1
    SHARD_ARGS=(--cpu)
fi
. benchmarks/step.sh  # step NAME LIMIT CMD...
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))" | tee -a "$LOG"
# GPROJ_PATCH=1 needs the start-up hook (.pth) in a site directory; the device image has the repo on PYTHONPATH only
python3 -m gproj_patch.integrations.startup --check 2>&1 | grep -q "hook installed: \['/" \
    || python3 -m gproj_patch.integrations.startup --install 2>&1 | tee -a "$LOG"
python3 -m gproj_patch.integrations.startup --check 2>&1 | tee -a "$LOG"
TR=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
step dp 130 env GPROJ_PATCH=1 GPROJ_MODE=gproj "${TR[@]}" benchmarks/multi_gpu_check.py --part dp --dir "$OUT"
step cp 110 "${TR[@]}" benchmarks/multi_gpu_check.py --part cp --dir "$OUT"
step shards 120 python3 benchmarks/multi_gpu_check.py --part shards --dir "$OUT" "${SHARD_ARGS[@]}"
step example_torchrun_ddp 45 env GPROJ_PATCH=1 "${TR[@]}" examples/multi_gpu_train.py --wrap ddp --drive-layer 1
step example_accelerate_fsdp2 60 env GPROJ_PATCH=1 python3 -m accelerate.commands.launch --multi_gpu \
    --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    examples/multi_gpu_train.py --wrap fsdp2 --drive-layer 1
grep -E "^=== " "$LOG"
grep -E "^\[rank " "$LOG"
python3 benchmarks/multi_gpu_check.py --part report --dir "$OUT" | tee "$OUT/table.txt"
