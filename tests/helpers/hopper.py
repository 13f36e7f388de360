"""Whether this process can run the Gluon kernels on its GPU (the GPU tests of the Gluon launches skip otherwise)."""
from typing import Optional

import torch


def gluon_gpu_reason() -> Optional[str]:
    """None on an sm_90 GPU with a Triton whose Gluon the kernels were checked against; else why not (the skip
    reason of a Gluon GPU test)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from gproj_patch.backends import gluon_bwd
    if gluon_bwd.UNAVAILABLE_REASON is not None:
        return gluon_bwd.UNAVAILABLE_REASON
    if torch.cuda.get_device_capability() != gluon_bwd.GLUON_CAPABILITY:
        return "the Gluon kernels are sm_90a (Hopper)"
    return None
