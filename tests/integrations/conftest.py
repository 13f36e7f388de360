"""Fixtures of the integration tests."""
import site

import pytest

from tests.helpers.startup import install_userbase


@pytest.fixture(scope="module")
def userbase(tmp_path_factory):
    """A temporary user base whose site directory holds the start-up .pth (skipped where user sites are off)."""
    if not site.ENABLE_USER_SITE:
        pytest.skip("user site directories are disabled in this interpreter (e.g. an isolated venv)")
    base = tmp_path_factory.mktemp("userbase")
    install_userbase(base)
    return base
