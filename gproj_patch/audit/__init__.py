"""The gradient audit: attention backwards checked against the fp64 oracle on a named adversarial suite.

``python -m gproj_patch audit`` / ``gproj-audit`` is ``main`` (``cli.py``).
"""
from __future__ import annotations

from .cli import main

__all__ = ["main"]
