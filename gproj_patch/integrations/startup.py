"""``GPROJ_PATCH=1``: enable the patch at interpreter start, with no code change (coverage.py's .pth pattern).

The package installs ``gproj_patch_startup.pth`` at the root of site-packages (``setup.py`` writes it into the
wheel, for ``pip install .`` and ``pip install -e .`` alike). Python's ``site`` module executes its single line
at every interpreter start; the line costs one environment lookup unless ``GPROJ_PATCH`` is set, then calls
``process_startup()``:

* ``GPROJ_PATCH`` unset, empty or 0/false/no/off: nothing happens.
* 1/true/yes/on: the other variables (``GPROJ_MODE``, ``GPROJ_TARGETS``, ``GPROJ_TIER``, ``GPROJ_LOG_LEVEL``,
  ``GPROJ_DETERMINISTIC``, and the policy's ``GPROJ_SAMPLE_EVERY``, ``GPROJ_AUTO_ENTER``, ...) are checked at
  once, then ``gproj_patch.enable()`` runs as soon as ``torch`` has been imported (right away if it already
  is). Deferring to torch's import keeps every Python process that never touches torch (pip, the launcher's
  helpers) fast, and means the patch is in place before any model code or ``torch.compile`` runs.
* Any other value, or a bad value of another variable: the process stops at start-up with exit status 2 and a
  one-line message on stderr naming the variable.

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


def _fail(message: str) -> None:
    """Stop the process with a clear message. (An exception would only be printed by ``site``, or, raised
    during ``import torch``, would leave torch half-registered; a clean exit is the honest outcome.)"""
    STATUS.state, STATUS.error = "failed", message
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write(f"gproj_patch: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def flag_value(environ=None) -> bool:
    """Whether GPROJ_PATCH asks for the patch; ValueError for a value that is neither on nor off."""
    environ = os.environ if environ is None else environ
    raw = environ.get(FLAG, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{FLAG}={raw!r} is not understood: use 1 (enable at start-up) or 0 / unset (do nothing)")


def check_environment(environ=None) -> None:
    """Parse every GPROJ_* option of the patch and the policy (no torch import); ValueError on a bad one."""
    from ..runtime import config
    config.check_environment(environ)


def process_startup(environ=None) -> Optional[Any]:
    """The .pth entry point (idempotent). Returns the enable() handle when the patch was enabled now."""
    with _lock:
        if STATUS.state != "not run":
            return STATUS.handle
        try:
            on = flag_value(environ)
        except ValueError as exc:
            _fail(str(exc))
        if not on:
            STATUS.state = "off"
            return None
        try:
            check_environment(environ)
        except ValueError as exc:
            _fail(f"{FLAG}=1 but the environment is invalid: {exc}")
        if "torch" in sys.modules:
            return _enable()
        from ..runtime.import_hooks import call_after_import
        STATUS.state = "waiting for torch"
        call_after_import("torch", _enable)
        return None


def _enable():
    try:
        from .. import patch
        handle = patch.enable()
    except Exception as exc:  # noqa: BLE001 - everything here is a start-up failure the user must see
        _fail(f"{FLAG}=1 but gproj_patch.enable() failed: {type(exc).__name__}: {exc}")
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


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m gproj_patch.integrations.startup",
                                 description="Install or inspect the GPROJ_PATCH=1 start-up hook (.pth).")
    ap.add_argument("--install", metavar="DIR", nargs="?", const="", default=None,
                    help="write the .pth into DIR (default: this interpreter's site-packages)")
    ap.add_argument("--user", action="store_true", help="with --install: the user site directory")
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
