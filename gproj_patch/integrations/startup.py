"""``GPROJ_PATCH=1``: enable the patch at interpreter start, with no code change (coverage.py's .pth pattern).

The package installs ``gproj_patch_startup.pth`` at the root of site-packages (``setup.py`` writes it into the
wheel, for ``pip install .`` and ``pip install -e .`` alike). Python's ``site`` module executes its single line
at every interpreter start; the line costs one environment lookup unless ``GPROJ_PATCH`` is set, then calls
``process_startup()``:

* ``GPROJ_PATCH`` unset, empty or 0/false/no/off: nothing happens.
* 1/true/yes/on: every other variable the patch reads (``config.ENV``: ``GPROJ_MODE``, ``GPROJ_TARGETS``,
  ``GPROJ_TIER``, ``GPROJ_KV_MAJOR``, ``GPROJ_DQ_MAJOR``, ``GPROJ_LOG_LEVEL`` and the policy's
  ``GPROJ_SAMPLE_EVERY``, ``GPROJ_AUTO_ENTER``, ...) is checked at once, then ``gproj_patch.enable()`` runs
  as soon as ``torch`` has been imported (right away if it already is). Deferring to torch's import keeps
  every Python process that never touches torch (pip, the launcher's helpers) fast, and means the patch is in
  place before any model code or ``torch.compile`` runs.
* Any other value, or a bad value of another variable: one line on stderr naming the variable and the values it
  accepts; the patch stays off and the program runs on (its exit status is its own). The same when
  ``enable()`` itself fails once torch is imported. A hook that runs in every Python process (pip, the
  launcher, the program's own helpers) must never take one down; ``status()`` keeps the message, and
  ``python -m gproj_patch startup --check`` (an explicit checker) exits with status 2 on an invalid environment.

So ``GPROJ_PATCH=1 GPROJ_MODE=auto accelerate launch train.py`` patches every rank: the launcher passes the
environment to each worker, and each worker's interpreter runs the hook. ``status()`` says what happened.

Where the .pth cannot be installed (``pip install --target``, a zip app), ``python -m
gproj_patch.integrations.startup --install DIR`` writes it into a site directory (DIR must exist: a mistyped
path is refused with exit status 2, never created; ``--install --user`` creates the user site directory, which
Python reads once it exists), and ``import gproj_patch.integrations.startup as s; s.process_startup()`` at the
top of a script does the same by hand.

``torch`` is watched with ``gproj_patch.runtime.import_hooks``: probing for it (``importlib.util.find_spec("torch")``,
as ``transformers`` and others do at import) does not consume the hook, so any import order works.
The hook does nothing under ``python -S`` / ``-I`` (site disabled), which is Python's rule for all .pth files.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional

FLAG = "GPROJ_PATCH"
PTH_NAME = "gproj_patch_startup.pth"
# The exact line of the .pth file; setup.py carries a copy (tests/test_startup.py checks they agree).
PTH_LINE = ("import os; 'GPROJ_PATCH' in os.environ and "
            "__import__('gproj_patch.integrations.startup').integrations.startup.process_startup()")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
#: the exit status of this module's command line (``--install`` into a missing directory, ``--check`` of an
#: invalid environment); the start-up hook itself never exits
EXIT_CODE = 2

_lock = threading.RLock()


@dataclass
class StartupStatus:
    """What the start-up hook did in this process (hook bookkeeping, not runtime state: ``reset()`` leaves it
    alone). One instance, ``STATUS``, mutated in place under ``_lock`` and never re-bound."""
    state: str = "not run"  # "not run" | "off" | "waiting for torch" | "enabled" | "failed"
    handle: Any = None  # the enable() handle once enabled
    error: Optional[str] = None  # the message of a failed start-up


STATUS = StartupStatus()


def status() -> Dict[str, Any]:
    """{"state": "not run" | "off" | "waiting for torch" | "enabled" | "failed", "handle": Handle|None,
    "error": str|None}."""
    return {"state": STATUS.state, "handle": STATUS.handle, "error": STATUS.error}  # the handle itself, no copy


def _report(message: str) -> None:
    """The start-up hook could not turn the patch on: say so in one line on stderr and leave the patch off.
    Never an exit or an exception: the hook runs in every Python process, most of which never use the patch
    (an exception would only be printed by ``site`` as a traceback, or, raised during ``import torch``, would
    fail the program's own import). Each process says it once: the hook runs once per interpreter."""
    STATUS.state, STATUS.handle, STATUS.error = "failed", None, message
    try:
        sys.stderr.write("gproj_patch: " + " ".join(message.splitlines()) + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - no usable stderr (pythonw, a closed stream): status() still has it
        pass


def _flag_text(raw: str) -> str:
    """``GPROJ_PATCH=<value>`` as it is set (quoted as a shell would need it), for messages that say why."""
    import shlex  # only on the way to a message: the hook's success path stays lean
    return f"{FLAG}={shlex.quote(raw)}"


def flag_value(environ=None) -> bool:
    """Whether GPROJ_PATCH asks for the patch; ValueError for a value that is neither on nor off."""
    environ = os.environ if environ is None else environ
    raw = environ.get(FLAG, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{FLAG}={raw!r} is neither on ({', '.join(_TRUE)}: enable at start-up) nor off "
                     f"({', '.join(v for v in _FALSE if v)}, empty or unset: do nothing)")


def check_environment(environ=None) -> None:
    """Parse every GPROJ_* option of the patch and the policy (no torch import); ValueError on a bad one."""
    from ..runtime import config
    config.check_environment(environ)


def process_startup(environ=None) -> Optional[Any]:
    """The .pth entry point (idempotent). Returns the enable() handle when the patch was enabled now. Never
    raises and never exits: a bad setting is reported (``_report``) and the patch stays off."""
    with _lock:
        if STATUS.state != "not run":
            return STATUS.handle
        environ = os.environ if environ is None else environ
        try:
            on = flag_value(environ)
        except ValueError as exc:
            _report(f"{exc}, so the patch stays off")
            return None
        if not on:
            STATUS.state = "off"
            return None
        flag = environ.get(FLAG, "")
        try:
            check_environment(environ)
        except ValueError as exc:
            _report(f"{_flag_text(flag)} but the environment is invalid, so the patch stays off: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - a bug of this package must not stop the program either
            _report(f"{_flag_text(flag)} but checking the environment failed, so the patch stays off: "
                    f"{type(exc).__name__}: {exc}")
            return None
        if "torch" in sys.modules:
            return _enable(flag)
        from ..runtime.import_hooks import call_after_import
        STATUS.state = "waiting for torch"
        call_after_import("torch", functools.partial(_enable, flag))
        return None


def _enable(flag: str):
    """enable() with the options of the environment as it is now (the program may have changed it since
    start-up); runs right after ``import torch``, so a failure is reported, never raised into that import.
    ``flag``: GPROJ_PATCH's value at start-up, for the message."""
    with _lock:
        try:
            from .. import patch
            handle = patch.enable()
        except Exception as exc:  # noqa: BLE001 - everything here is a start-up failure the user must see
            _report(f"{_flag_text(flag)} but gproj_patch.enable() failed, so the patch stays off: "
                    f"{type(exc).__name__}: {exc}")
            return None
        STATUS.state, STATUS.handle = "enabled", handle
        return handle


def _site_dir(user: bool) -> str:
    import site
    import sysconfig
    return site.getusersitepackages() if user else sysconfig.get_paths()["purelib"]


def install_pth(directory: str) -> str:
    """Write the .pth into the existing ``directory`` (a site directory, for Python to read it); returns its
    path. FileNotFoundError when the directory does not exist (it is not created: a typo would go unnoticed)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r} (give an existing site directory)")
    path = os.path.join(directory, PTH_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(PTH_LINE + "\n")
    return path


def main(argv=None, prog: str = "python -m gproj_patch.integrations.startup") -> int:
    """The command line; ``prog`` is how it was invoked (``python -m gproj_patch startup`` passes its own)."""
    import argparse
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Install or inspect the GPROJ_PATCH=1 start-up hook (.pth).")
    ap.add_argument("--install", metavar="DIR", nargs="?", const="", default=None,
                    help="write the .pth into DIR (default: this interpreter's site-packages)")
    ap.add_argument("--user", action="store_true",
                    help="with --install or --uninstall and no DIR: the user site directory")
    ap.add_argument("--uninstall", metavar="DIR", nargs="?", const="", default=None,
                    help="remove the .pth from DIR (default: this interpreter's site-packages)")
    ap.add_argument("--check", action="store_true", help="report whether the hook is installed and valid")
    args = ap.parse_args(argv)
    if args.install is not None:
        directory = args.install or _site_dir(args.user)
        if not args.install and args.user:
            os.makedirs(directory, exist_ok=True)  # the user site directory: Python reads it once it exists
        try:
            print(install_pth(directory))
        except FileNotFoundError as exc:
            print(f"gproj_patch: --install: {exc}", file=sys.stderr)
            return EXIT_CODE
    if args.uninstall is not None:
        path = os.path.join(args.uninstall or _site_dir(args.user), PTH_NAME)
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
        else:
            print(f"not installed: {path}")
    if args.check or (args.install is None and args.uninstall is None):
        import site
        dirs = site.getsitepackages() + [site.getusersitepackages()]
        found = [os.path.join(d, PTH_NAME) for d in dirs if os.path.exists(os.path.join(d, PTH_NAME))]
        print(f"hook installed: {found or 'no'}")
        try:
            hook = sys.modules.get("gproj_patch.integrations.startup")  # the copy the .pth ran, not __main__
            state = hook.status()["state"] if hook is not None else "not run"
            print(f"{FLAG} is {'on' if flag_value() else 'off'}; hook state in this process: {state}")
            check_environment()
            print("environment: valid")
        except ValueError as exc:
            print(f"environment: INVALID: {exc}")
            return EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
