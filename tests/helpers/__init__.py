"""Shared test helpers, importable from every test folder as ``tests.helpers.<module>`` (pyproject's
``[tool.pytest.ini_options] pythonpath = ["."]`` puts the repository root on ``sys.path``).

* ``paths``: the repository root, for tests that read its files or run its scripts in subprocesses.
* ``numerics``: the relative error measure every numerical test uses, and layout conversions.
* ``memory``: live tensor bytes and the flat-memory check of repeated forward+backward calls, and the assertion
  that the corrected tier ran.
* ``flex_cases``: the FlexAttention masks, inputs and bounds shared by the flex hook tests.
* ``adversarial``: the adversarial BF16 kernel suite (key offsets to 512σ, sinks, P == 1 rows, ...), shared with
  ``python -m benchmarks.kernel`` and ``python -m benchmarks.gluon``.
* ``fa4_standin``: a CPU stand-in for flash-attn-4's ``flash_attn.cute.interface``.
* ``fa2_standin``: CPU stand-ins for FA2's and FA3's custom ops (the releases' schemas) and FA2's Functions.
* ``launch_mismatch``: what the GProj kernel's two separate dP products do to dk.
* ``kernel_build``: compile kernels for sm_90a on a GPU-less machine and read registers, spills and shared
  memory (the Gluon compile test; ``python -m benchmarks.ptx`` uses it too).
* ``switches``: the CPU kernel switch (TRITON_INTERPRET / GPROJ_TIER), resolved at ``enable()``.
* ``hf_models``: a tiny HF Llama in the large-key regime, a few-step CPU Trainer, and each attention call's
  gradients measured against the fp64 oracle (a spy on a module global or an HF registry entry).
"""
