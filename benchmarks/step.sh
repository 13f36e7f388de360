# Sourced by the device scripts (run_device.sh, multi_gpu_check.sh): `step NAME LIMIT CMD...` runs CMD under
# `timeout LIMIT`, appending its output to $LOG and a start and an end line (rc, seconds) to $LOG and stdout.
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
