"""Numerical backends: the fp64 oracle, the low-precision emulation, the FP32 tier and the Triton kernel."""
