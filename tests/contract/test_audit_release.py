"""The release: metadata, license, typing, changelog, sdist contents. Building and installing the wheel:
``.ci/wheel_smoke.sh``. (``python -m benchmarks.auto``'s exit status, timing deciding nothing on a CPU:
tests/scripts/test_auto.py, through its command line.)"""
import importlib
import inspect
import sys
import typing

import pytest
import torch

import gproj_patch
from tests.helpers.paths import REPO

ROOT = REPO
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the metadata is read, not built, here


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_and_changelog(project):
    assert gproj_patch.__version__ == "0.2.0"
    assert project["project"]["dynamic"] == ["version"]  # read from gproj_patch/version.py: one place
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gproj_patch.version.__version__"}
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## 0.2.0" in text and "deterministic" in text.split("## 0.1.0")[0]  # the removed keyword is named


def test_license_is_an_spdx_expression_with_its_file(project):
    meta = project["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert not any(c.startswith("License ::") for c in meta["classifiers"])  # PEP 639: the expression only
    assert "Typing :: Typed" in meta["classifiers"]
    assert any(r.startswith("setuptools>=77") for r in project["build-system"]["requires"])


def test_entry_points(project):
    assert project["project"]["scripts"] == {"gproj-audit": "gproj_patch.audit:main"}
    plugin = project["project"]["entry-points"]["pytest11"]["gproj_audit"]
    mod = importlib.import_module(plugin)
    assert hasattr(mod, "gproj_audit")


def test_typed_public_api(project):
    assert (ROOT / "gproj_patch" / "py.typed").exists()
    assert project["tool"]["setuptools"]["package-data"]["gproj_patch"] == ["py.typed"]
    hints = typing.get_type_hints(gproj_patch.attention, localns={"torch": torch})
    assert hints["q"] is torch.Tensor and hints["return"] is torch.Tensor and hints["is_causal"] is bool
    assert set(hints) == set(inspect.signature(gproj_patch.attention).parameters) | {"return"}
    assert set(typing.get_type_hints(gproj_patch.enable)) >= {"mode", "targets", "return"}


def test_sdist_carries_what_the_readme_links():
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include docs *.md" in manifest and "recursive-include examples *.py" in manifest
    for line in ("CHANGELOG.md", "LICENSE"):
        assert line in manifest


def test_readme_top_works_in_a_checkout_and_on_the_package_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[3] == 'pip install torch==2.13.0 && pip install -e ".[plot,progress]" && python -m gproj_patch audit --plot audit.png'
    paragraph = "\n".join(lines[7:16])
    assert "pip install gproj_patch" in paragraph and "gproj-audit" in paragraph


def test_loading_the_pytest_plugin_does_not_import_torch():
    """pytest loads the plugin in every run where gproj_patch is installed: it must stay cheap."""
    import subprocess
    code = ("import sys; import gproj_patch.audit.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from gproj_patch.audit import check, main; assert callable(check) and callable(main)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
