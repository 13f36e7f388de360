"""Fresh interpreters for the start-up tests (tests/integrations/test_startup.py, test_import_order.py): the
real .pth in a temporary user site directory (the ``userbase`` fixture, tests/integrations/conftest.py), run by
``site`` exactly as site-packages would be."""
import os
import subprocess
import sys
import textwrap

from .paths import REPO


def install_userbase(base) -> None:
    """Make ``base`` a user base (PYTHONUSERBASE) whose user site directory holds gproj_patch's start-up .pth."""
    from gproj_patch.integrations import startup
    env = dict(os.environ, PYTHONUSERBASE=str(base))
    usersite = subprocess.run([sys.executable, "-c", "import site; print(site.getusersitepackages())"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(usersite)
    startup.install_pth(usersite)


def run_python(userbase, code, timeout=120, cmd=None, **env):
    """Run ``code`` (dedented) — or ``cmd`` — in a fresh interpreter with ``userbase`` as its user base, the
    repository first on PYTHONPATH, no GPROJ_* variable of this process and ``env`` added; cwd the repository."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPROJ_")}
    full.update(PYTHONUSERBASE=str(userbase), PYTHONPATH=str(REPO) + os.pathsep + full.get("PYTHONPATH", ""))
    full.update(env)
    return subprocess.run(cmd or [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))
