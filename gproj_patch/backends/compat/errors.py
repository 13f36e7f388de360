"""The one error of the compat package."""
from __future__ import annotations


class CompatError(RuntimeError):
    """An upstream private API is not what this version of gproj_patch was written against."""
