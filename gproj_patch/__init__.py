"""gproj_patch: correct BF16/FP16 attention gradients (GProj) while keeping the fused forward."""
__version__ = "0.1.0"
