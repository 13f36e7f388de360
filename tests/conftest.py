"""Shared test fixtures."""
import pytest

import gproj_patch
from gproj_patch import config


@pytest.fixture
def patch_off(monkeypatch):
    """Each test starts with the patch off, fresh runtime state and no GPROJ_* option in the environment, and
    leaves the patch off."""
    for var in config.ENV.values():
        monkeypatch.delenv(var, raising=False)
    gproj_patch.disable()
    gproj_patch.reset_stats()
    yield
    gproj_patch.disable()
