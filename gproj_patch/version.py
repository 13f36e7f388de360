"""The package's version: the one place it is written (pyproject reads it, ``gproj_patch.__version__`` and
``gproj-audit --version`` show it)."""
__version__ = "0.2.0"
