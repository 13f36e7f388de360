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


@pytest.fixture
def sdpa_and_transformers_on():
    """The patch on for the SDPA and Transformers targets with fresh runtime state; off afterwards."""
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(targets=("sdpa", "transformers"))
    yield
    gproj_patch.disable()
