"""Build step of gproj_patch (all metadata is in pyproject.toml).

It adds one file to the wheel: ``gproj_patch_startup.pth`` at the root of site-packages, the start-up hook
behind ``GPROJ_PATCH=1`` (``gproj_patch/integrations/startup.py``; coverage.py's pattern). It works for
``pip install .`` / ``pip wheel .`` (the file goes into ``build_lib``, the wheel's root) and for
``pip install -e .`` (PEP 660: setuptools' ``editable_wheel`` runs ``build_py`` in editable mode, where
``build_lib`` is a scratch directory; the file goes to the unpacked editable wheel's root instead). pip records
it in RECORD, so ``pip uninstall`` removes it.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

PTH_NAME = "gproj_patch_startup.pth"
# Must equal gproj_patch.integrations.startup.PTH_LINE (tests/test_startup.py checks it). It costs one
# environment lookup per interpreter start unless GPROJ_PATCH is set.
PTH_LINE = ("import os; 'GPROJ_PATCH' in os.environ and "
            "__import__('gproj_patch.integrations.startup').integrations.startup.process_startup()")


class build_py(_build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            directory = self.get_finalized_command("install").install_lib  # the editable wheel's root
        else:
            directory = self.build_lib
        self.mkpath(directory)
        with open(os.path.join(directory, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE + "\n")

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": build_py})
