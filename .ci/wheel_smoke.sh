#!/usr/bin/env bash
# Release smoke test: build the wheel, install it into a fresh venv and use it from outside the checkout.
# The venv sees the system site-packages (torch is not downloaded again) but the wheel's gproj_patch comes first
# on its path; the script checks that the copy it runs is the installed one. About a minute on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONDONTWRITEBYTECODE  # setuptools warns that it cannot byte-compile when it is set
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The build backend in use when it is recent enough (no download), else pip's isolated build environment.
isolation=""
if python3 -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    isolation="--no-build-isolation"
fi
python3 -m pip wheel -q --no-deps $isolation -w "$work/dist" .
python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps "$work"/dist/gproj_patch-*.whl
cd "$work"
"$work/venv/bin/gproj-audit" --version
"$work/venv/bin/python" -m gproj_patch startup --check
"$work/venv/bin/python" - <<'PY'
import os
import sys

import torch

import gproj_patch
from gproj_patch.audit import check

here = os.path.dirname(gproj_patch.__file__)
assert here.startswith(sys.prefix), f"not the installed wheel: {here}"
assert os.path.exists(os.path.join(here, "py.typed")), "py.typed missing from the wheel"


def eager(q, k, v, attn_mask=None, is_causal=False, scale=None):
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def fixed(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return gproj_patch.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


bad, good = (check(f, cases="witness,key_offset_128", device="cpu") for f in (eager, fixed))
assert not bad.passed and bad.figures["witness_dq0"] == -12.0, bad.explain()
assert good.passed and good.figures["witness_dq0"] == 0.0, good.explain()
print(f"wheel {gproj_patch.__version__} from {here}: check() flags the eager leak, passes gproj_patch.attention")
PY
cat > test_wheel_fixture.py <<'PY'
import torch

import gproj_patch


def test_fixture_from_the_entry_point(gproj_audit):  # no import: pytest11 registered the fixture
    fixed = lambda q, k, v, attn_mask=None, is_causal=False, scale=None: gproj_patch.attention(q, k, v)
    assert gproj_audit(fixed, cases="witness", device="cpu").passed
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider test_wheel_fixture.py
echo "wheel smoke test passed"
