"""Test suites nobody here wrote, run on the GPU with gproj_patch off and on: what fails only with the patch?

    bash benchmarks/external_gpu.sh stage1      # GPU machine: PyTorch's CUDA SDPA tests (carries expecttest)
    bash benchmarks/external_gpu.sh stage2      # right after: FA4's tests (installs the carried FA4 wheels)
    python -m benchmarks.external_suites torch --out DIR --deadline 420
    python -m benchmarks.external_suites fa4 --out DIR --deadline 420
    python -m benchmarks.external_suites torch --collect-only    # the selection only, no test runs

``torch``: PyTorch's ``test/test_transformers.py`` (tests/external/vendor/torch, see tests/external/PROVENANCE.md)
on CUDA: ``TestSDPACudaOnly`` (its gradient tests ``test_flash_attention_vs_math_ref_grads`` and
``test_mem_efficient_attention_vs_math_ref_grads`` reduced to a deterministic subset that keeps every value of
every parameter, with extra dropout and head_dim 8/16 instances; its other tests, forward and backward, mostly
whole) plus the CUDA instances of ``TestSDPA``, ``TestSDPAFailureModes``, ``TestAttnBias`` and ``TestTransformers``:
about 720 tests.
Both arms run at once on the one GPU.

``fa4``: flash-attention's ``tests/cute/test_flash_attn.py`` (tests/external/vendor/fa4) against flash-attn-4:
d=128, causal and full, MHA and GQA, two length pairs, learnable sinks on and off, varlen, and the two
learnable-sink backward tests (about 30 tests). The arms run one after the other, so the second reuses FA4's
JIT cache (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``). FA4 must be importable (benchmarks/external_gpu.sh
installs the carried wheels).

Each arm is a pytest subprocess (tests/external/harness.py); the patched arm enables gproj_patch for the whole
session before the test module is imported (tests/external/gproj_plugin.py). At the deadline the arms are
stopped and only the tests both finished are compared. Results in ``--out``: ``summary.txt`` (also printed; the
tests that pass without the patch and fail with it come last), ``outcomes.json``, the selection and each arm's
log. Exit code 0 when nothing fails only with the patch, 1 otherwise, 2 when a run could not be made.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import common
from tests.external import harness

REPO = Path(__file__).resolve().parents[1]

TORCH_FILE = REPO / "tests" / "external" / "vendor" / "torch" / "test_transformers.py"
FA4_FILE = REPO / "tests" / "external" / "vendor" / "fa4" / "test_flash_attn.py"

TORCH_CLASSES = ("TestSDPACudaOnlyCUDA", "TestSDPACUDA", "TestSDPAFailureModesCUDA", "TestAttnBiasCUDA",
                 "TestTransformersCUDA")
# Per-function selection (tests/external/gproj_plugin.py ``select``); functions not named run whole.
TORCH_RULES = {
    # 6912 instances: head_dim 8/203/256, dropout 0/0.22/0.48, GQA, causal, fp16/bf16, batch, lengths.
    "test_flash_attention_vs_math_ref_grads": {
        "limit": 140, "fill": "hash", "focus": r"dropout_p_0_(22|48)|head_dim_8_", "focus_limit": 70},
    # 3072 instances: head_dim 8/16/96/128, dropout 0/0.22, causal, fp16/bf16/fp32, batch, lengths.
    "test_mem_efficient_attention_vs_math_ref_grads": {
        "limit": 120, "fill": "hash", "focus": r"head_dim_(8|16)_", "focus_limit": 70},
    # 1536 instances, with an additive mask (the patched backward takes the FP32 tier).
    "test_mem_efficient_attention_attn_mask_vs_math_ref_grads": {"limit": 40, "fill": "hash"},
    # Calls the aten fused ops directly (never F.scaled_dot_product_attention): nothing of the patch on its
    # path, 384 instances; dropped.
    "test_fused_attention_vs_math_ref_grads_cudagraph": {"limit": 0},
    # Asserts one backend is *faster* than another: a timing race when two runs share the GPU; dropped.
    "test_fused_sdp_priority_order": {"limit": 0},
    # Nested tensors through the wrapper (must pass through): a sample.
    "test_flash_attention_vs_math_ref_grads_nestedtensor": {"limit": 16, "fill": "hash"},
    "test_fused_kernels_nested_broadcasting": {"limit": 8, "fill": "hash"},
}

FA4_FUNCTIONS = ("test_flash_attn_output", "test_flash_attn_varlen_output",
                 "test_flash_attn_learnable_sink_backward_dtype",
                 "test_flash_attn_varlen_learnable_sink_backward_with_lse")
_FA4_COMMON = {"d": [128], "seqlen_q": [128, 1024], "seqlen_k": [128, 1024], "local_enum": [0],
               "softcap": [0.0], "deterministic": [False], "has_qv": [False], "mha_type": ["mha", "gqa"]}
FA4_PARAMS = {
    # causal and full, learnable sink on and off: 2 lengths x 2 x 2 x 2 (MHA, GQA) = 16
    "test_flash_attn_output": dict(_FA4_COMMON),
    # varlen (random lengths, unpadded q and kv): 2 lengths x 2 causal x 2 = 8
    "test_flash_attn_varlen_output": dict(_FA4_COMMON, add_unused_qkv=[False], varlen_mode=["random"],
                                          zero_lengths_q=[False], zero_lengths_k=[False], unpad_q=[True],
                                          unpad_kv=[True]),
}


def _suite(name: str):
    if name == "torch":
        selection = {"GPROJ_EXTERNAL_CLASSES": ",".join(TORCH_CLASSES),
                     "GPROJ_EXTERNAL_LIMITS": json.dumps(TORCH_RULES)}
        return TORCH_FILE, TORCH_CLASSES, selection, True, {}
    selection = {"GPROJ_EXTERNAL_FUNCTIONS": ",".join(FA4_FUNCTIONS),
                 "GPROJ_EXTERNAL_PARAMS": json.dumps(FA4_PARAMS)}
    env = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
    return FA4_FILE, tuple(FA4_FUNCTIONS), selection, False, env


def _versions() -> str:
    lines = []
    try:
        import torch
        lines.append(f"torch {torch.__version__} ({torch.version.git_version}), CUDA "
                     f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
                     f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    except Exception as exc:  # noqa: BLE001 - a version line must not stop the run
        lines.append(f"torch: {exc!r}")
    for mod in ("triton", "flash_attn.cute", "cutlass"):
        try:
            m = __import__(mod, fromlist=["_"])
            lines.append(f"{mod} {getattr(m, '__version__', '?')} ({getattr(m, '__file__', '?')})")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"{mod}: not importable ({type(exc).__name__}: {str(exc)[:120]})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suite", choices=("torch", "fa4"))
    ap.add_argument("--out", default=None, help="folder of the results (default $OUT/external_<suite>)")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds for all arms together")
    ap.add_argument("--collect-only", action="store_true", help="print the selection, run nothing")
    ap.add_argument("--leak-check", action="store_true",
                    help="PYTORCH_TEST_CUDA_MEM_LEAK_CHECK=1 in both arms (PyTorch's own check of CUDA memory "
                    "before and after each test of the classes that ask for it, TestSDPACudaOnly and "
                    "TestTransformers); the arms then run one after the other (the check's confirmation reads "
                    "the whole device's free memory)")
    ap.add_argument("--test-file", type=Path, help="another copy of the suite's file (a dry run of this machinery "
                    "on a CPU uses one whose CUDA classes are instantiated for the CPU)")
    ap.add_argument("--classes", help="comma list replacing the suite's classes (torch)")
    args = ap.parse_args(argv)

    test_file, classes, selection, concurrent, env = _suite(args.suite)
    if args.test_file:
        test_file = args.test_file.resolve()
    if args.classes:
        classes = tuple(args.classes.split(","))
        selection["GPROJ_EXTERNAL_CLASSES"] = args.classes
    out = Path(common.out_dir(f"external_{args.suite}", args.out)).resolve()  # the arms run from their own folder
    if not test_file.is_file():
        print(f"the vendored suite {test_file} is absent (tests/external/PROVENANCE.md)")
        return 2
    print(_versions(), flush=True)
    work = out / "work"
    env = dict(env, PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    if args.leak_check:
        env["PYTORCH_TEST_CUDA_MEM_LEAK_CHECK"] = "1"
        concurrent = False
    arms = {"off": {"patch": False, "env": env}, "on": {"patch": True, "env": env}}
    if args.collect_only:
        arms = {"off": arms["off"]}
    t0 = time.monotonic()
    try:
        result = harness.run_arms(test_file, work, arms, selection, args.deadline, concurrent=concurrent,
                                  partial_ok=True, pytest_args=("--collect-only",) if args.collect_only else ())
    except harness.ArmFailed as exc:
        print(f"RUN FAILED: {exc}")
        return 2
    if args.collect_only:
        from tests.external import gproj_plugin

        selected = result["off"]["selected"] or []
        bases = gproj_plugin._base_names(str(test_file))
        counts: dict = {}
        for name in selected:
            scope, _, test = name.partition("::")
            key = f"{scope}::{gproj_plugin.function_of(test.split('[')[0], bases)}"
            counts[key] = counts.get(key, 0) + 1
        print(f"{len(selected)} selected")
        for key, n in sorted(counts.items()):
            print(f"  {n:5d}  {key}")
        return 0 if selected else 2

    text = harness.summary(result, classes)
    header = (f"{args.suite}: {test_file}, patch off vs on, {time.monotonic() - t0:.0f} s\n"
              f"patched arm: {json.dumps({k: v for k, v in result['on']['stats'].items() if k != 'stats'})}\n")
    (out / "summary.txt").write_text(header + text + "\n", encoding="utf-8")
    (out / "outcomes.json").write_text(json.dumps({t: r["outcomes"] for t, r in result.items()}, indent=0),
                                       encoding="utf-8")
    print(header + text, flush=True)
    on = result["on"]["stats"]
    if not (on.get("enabled_at_start") and on.get("enabled_at_end")):
        print("RUN FAILED: the patched arm did not keep the patch enabled")
        return 2
    hooked = on.get("installed", {}).get("flash_attn" if args.suite == "fa4" else "sdpa", "")
    if args.suite == "fa4" and "_flash_attn_bwd" not in hooked:
        print(f"RUN FAILED: the patched arm did not hook FA4's backward (flash_attn: {hooked!r})")
        return 2
    counts = on.get("stats") or {}
    if not counts.get("fp32", 0) + counts.get("gproj", 0):
        print(f"RUN FAILED: no corrected backward ran in the patched arm: {counts}")
        return 2
    partial = not (result["on"]["complete"] and result["off"]["complete"])
    regressions = harness.regressions(result["off"]["outcomes"], result["on"]["outcomes"], skip_missing=partial)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
