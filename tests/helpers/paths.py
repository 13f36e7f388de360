"""Where the repository is: tests that read its files or start its scripts in a subprocess need the root,
whatever folder under ``tests/`` they live in."""
from pathlib import Path

#: the repository root (this file is tests/helpers/paths.py)
REPO = Path(__file__).resolve().parents[2]
