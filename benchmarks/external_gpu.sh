#!/usr/bin/env bash
# What needs FA4 (or PyTorch's testing helpers) on the GPU machine, which has no network: this script carries
# the wheels in and installs them, then runs the entry point. FA4 travels as wheels split over two device calls
# made one right after the other (the machine stays warm about 30 s between calls; the second needs what the first
# left in /tmp):
#
#   stage1  carry: .whl/ext1 tests/external/vendor
#           keeps FA4's first half (.whl/ext1: half of the ~92 MB nvidia-cutlass-dsl-libs-cu13 wheel, split with
#           `split -n 2`, and two small wheels) in /tmp for the next call, installs expecttest (PyTorch's testing
#           helpers import it), then runs PyTorch's CUDA SDPA tests (`python -m benchmarks.external_suites torch`).
#   stage2  carry: .whl/ext2 tests/external/vendor
#           joins the wheel (sha256 checked), installs flash-attn-4 and its libraries with
#           `pip --no-index --no-deps --target /tmp/site`, then runs flash-attention's FA4 tests
#           (`python -m benchmarks.external_suites fa4`).
#   prepare carry: .whl/ext1 — only keeps FA4's first half in /tmp (stage1 without the suite; the call can go on
#           with other work, e.g. GPU tests, while the machine stays warm for the next stage)
#   timing  carry: .whl/ext2 (right after stage1 or prepare, as stage2)
#           installs flash-attn-4 the same way, then runs `python -m benchmarks.kernel` with it importable, so that
#           FA4's backward is timed next to GProj, cuDNN and flash. KERNEL_ARGS: more options of benchmarks.kernel.
#   records carry: .whl/ext2 (right after stage1 or prepare, as stage2)
#           installs flash-attn-4 the same way, then runs `python -m benchmarks.reach --check fa4`: two real FA4
#           layers in `auto`, one at a 300σ key offset: two forward records, only the sick layer corrected, no
#           "no forward record" line. reach.json and reach.log in $OUT. RECORDS_ARGS: more options of
#           benchmarks.reach (e.g. --seqlen 4096).
#   speed   carry: .whl/ext2 (right after stage1 or prepare, as stage2)
#           installs flash-attn-4 the same way, then runs `python -m benchmarks.speed`: the fp64 gate at 128σ of
#           every variant, then fwd+bwd of cuDNN, patched SDPA tl/Gluon/routed, FA4 and patched FA4 at the five
#           shapes, host µs a call, the 0.5B step at 4K/16K (~5 min after the install). speed.json and speed.log in
#           $OUT, the console (table last) in $OUT/speed_console.log. SPEED_ARGS: more options of benchmarks.speed
#           (e.g. --skip-steps, --shapes 1,2, --deadline 240; default 330 s, steps given the last 75).
#   host    carry: .whl/ext2 (right after stage1 or prepare, as stage2)
#           installs flash-attn-4 the same way, then runs `python -m benchmarks.host --mode calls --fresh` for
#           SDPA and for FA4 (each arm in a process of its own, the arms alternated twice): host µs a call,
#           patched against unpatched. host_sdpa/ and host_fa4/ in $OUT. HOST_ARGS: more options of both runs.
#
# Run from the repository root: `bash benchmarks/external_gpu.sh stage1` (then `stage2`). Suite results in $OUT:
# <suite>.log (everything, the diff of outcomes last), <suite>_summary.txt, <suite>_outcomes.json and
# <suite>_work.tgz (each arm's JUnit report, log, selection and gproj_patch.stats()), bundled so that few files
# come back.
set -u
cd "$(dirname "$0")/.."
stage=${1:-}
case "$stage" in
prepare | stage1 | stage2 | timing | records | speed | host) ;;
*)
    echo "usage: $0 stage1|stage2|prepare|timing|records|speed|host"
    exit 2
    ;;
esac
OUT=${OUT:-external_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
SITE=/tmp/gproj_external_site
PARTS=/tmp/gproj_external_fa4
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
# Seconds for both arms of one suite (one call must stay under 8 minutes: stage 2 also installs ~240 MB of wheels
# and imports FA4 first, ~1 min)
case "$stage" in stage2) DEADLINE=${EXTERNAL_DEADLINE:-330} ;; *) DEADLINE=${EXTERNAL_DEADLINE:-390} ;; esac

install() {  # wheels -> $SITE (no network there; --target skips .pth files, PYTHONPATH below makes up for it)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

run_suite() {  # $1 = torch | fa4
    local suite=$1 t0=$SECONDS rc
    echo "=== $suite: python3 -m benchmarks.external_suites $suite --deadline $DEADLINE"
    # shellcheck disable=SC2086  # EXTERNAL_ARGS: more options of benchmarks.external_suites, e.g. --leak-check
    timeout $((DEADLINE + 60)) python3 -m benchmarks.external_suites "$suite" --out "$OUT/$suite" \
        --deadline "$DEADLINE" ${EXTERNAL_ARGS:-} 2>&1 | tee "$OUT/$suite.log"
    rc=${PIPESTATUS[0]}
    # few files come back from the device: bundle the per-arm ones
    [ -f "$OUT/$suite/summary.txt" ] && mv "$OUT/$suite/summary.txt" "$OUT/${suite}_summary.txt"
    [ -f "$OUT/$suite/outcomes.json" ] && mv "$OUT/$suite/outcomes.json" "$OUT/${suite}_outcomes.json"
    [ -d "$OUT/$suite/work" ] && tar czf "$OUT/${suite}_work.tgz" -C "$OUT/$suite" work
    rm -rf "${OUT:?}/$suite"
    echo "=== $suite rc=$rc (0: nothing fails only with the patch, 1: something does, 2: no comparison) in $((SECONDS - t0)) s"
    return "$rc"
}

install_fa4() {  # join the two halves of the cutlass wheel, install FA4 into $SITE, import it once
    local part0 t0
    part0=$(ls "$PARTS/$CU13.part-00" .whl/ext1/"$CU13".part-00 2>/dev/null | head -n 1)
    if [ -z "$part0" ] || [ ! -f .whl/ext2/"$CU13".part-01 ]; then
        echo "stage 1's half of $CU13 is gone (the machine was given back between the calls) or .whl/ext2 was"
        echo "not carried: run stage1 again, then this stage right after it"
        return 3
    fi
    mkdir -p /tmp/gproj_external_wheels
    cat "$part0" .whl/ext2/"$CU13".part-01 > /tmp/gproj_external_wheels/"$CU13"
    (cd /tmp/gproj_external_wheels && sha256sum -c "$OLDPWD/.whl/ext2/SHA256SUMS") || return 3
    install /tmp/gproj_external_wheels/"$CU13" $(ls "$PARTS"/*.whl .whl/ext2/*.whl | grep -v expecttest) || return 3
    export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    t0=$SECONDS
    python3 -c "import flash_attn.cute.interface as i; print('flash_attn.cute', i.__file__)" || return 3
    echo "first FA4 import: $((SECONDS - t0)) s"
}

python3 -c "import torch; print('torch', torch.__version__, torch.version.git_version, torch.cuda.get_device_name())"

keep_first_half() {
    mkdir -p "$PARTS"
    # the joined wheel's SHA256SUMS travels in .whl/ext2 (install_fa4 checks it there)
    cp .whl/ext1/*.whl .whl/ext1/*.part-* "$PARTS"/ || { echo "carry .whl/ext1"; return 3; }
}

case "$stage" in
prepare)
    keep_first_half || exit 3
    ;;
stage1)
    keep_first_half || exit 3
    install .whl/ext1/expecttest-*.whl || exit 3
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    run_suite torch
    ;;
stage2)
    install_fa4 || exit 3
    run_suite fa4
    ;;
timing)
    install_fa4 || exit 3
    # shellcheck disable=SC2086  # KERNEL_ARGS: more options of benchmarks.kernel, e.g. --skip-suite
    timeout 420 python3 -m benchmarks.kernel --out "$OUT" ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernel_console.log"
    exit "${PIPESTATUS[0]}"
    ;;
speed)
    install_fa4 || exit 3
    # shellcheck disable=SC2086  # SPEED_ARGS: more options of benchmarks.speed
    timeout 420 python3 -m benchmarks.speed --out "$OUT" ${SPEED_ARGS:-} 2>&1 | tee "$OUT/speed_console.log"
    exit "${PIPESTATUS[0]}"
    ;;
host)
    install_fa4 || exit 3
    rc=0
    for library in sdpa fa4; do
        # shellcheck disable=SC2086  # HOST_ARGS: more options of benchmarks.host, e.g. --n 500
        timeout 200 python3 -m benchmarks.host --mode calls --fresh --rounds 2 --library "$library" \
            --out "$OUT/host_$library" ${HOST_ARGS:-} 2>&1 | tee "$OUT/host_${library}_console.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    exit "$rc"
    ;;
records)
    install_fa4 || exit 3
    # shellcheck disable=SC2086  # RECORDS_ARGS: more options of benchmarks.reach, e.g. --seqlen 4096
    timeout 420 python3 -m benchmarks.reach --check fa4 --out "$OUT" ${RECORDS_ARGS:-} 2>&1 \
        | tee "$OUT/reach_console.log"
    exit "${PIPESTATUS[0]}"
    ;;
esac
