"""The CPU kernel switch as tests flip it. Whether CPU fp16 tensors may run the GProj kernel through Triton's
interpreter is decided when the options are resolved — at ``enable()`` — and recorded in each call's plan; no
backward reads the environment. A test that sets the variable under an enabled patch re-enables it so that
the new value takes effect (``cpu_kernel_on``)."""
import gproj_patch
from gproj_patch.runtime import config


def cpu_kernel_on(monkeypatch, variable: str = "TRITON_INTERPRET", value: str = "1") -> None:
    """Set ``variable`` (TRITON_INTERPRET=1, or GPROJ_TIER=triton: the kernel or an error) and, when the patch is
    on, enable it again with the same mode and targets so that its options are resolved with it."""
    monkeypatch.setenv(variable, value)
    cfg = config.active()
    if cfg is not None:
        gproj_patch.disable()
        gproj_patch.enable(mode=cfg.mode, targets=cfg.targets)
