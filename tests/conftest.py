"""Shared test fixtures (helper functions: the ``tests.helpers`` package)."""
import pytest

import gproj_patch
from gproj_patch.runtime import config
from gproj_patch.audit.run import torch_threads


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: small tile products are 2-3x faster so on a shared 2-core machine."""
    with torch_threads(1):
        yield


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
