"""Measurements of gproj_patch, run as ``python -m benchmarks.<name>`` from the repository root.

benchmarks/README.md names each entry point, the question it answers, how to run it and what it writes;
``common.py`` holds the helpers they share. Nothing here is part of the installed package.
"""
