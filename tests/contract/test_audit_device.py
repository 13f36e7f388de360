"""The audit asked for a device this machine lacks (``device="cuda"`` without a GPU, the README's example):
``check`` raises ``DeviceUnavailableError`` naming the device and what to do, before anything runs; the
``gproj_audit`` fixture skips the test with that reason (a test that needs CUDA cannot run here, which says
nothing about the kernel); the CLI exits 2 with one line. CUDA's absence is simulated, so this runs anywhere."""
import pytest
import torch
import torch.nn.functional as F

import gproj_patch.audit
from gproj_patch.__main__ import main as cli_main
from gproj_patch.audit import api
from gproj_patch.audit.pytest_plugin import audit_and_assert
from gproj_patch.audit.run import resolve_device


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA (whatever this one has), and an audit that fails the test if it starts a case."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def refuse(*a, **k):
        raise AssertionError("the audit ran a case on a device it does not have")
    monkeypatch.setattr(api, "run_case", refuse)


def test_check_on_a_missing_device_raises_a_clear_error_before_running(no_cuda):
    for device in ("cuda", torch.device("cuda", 0)):
        with pytest.raises(gproj_patch.audit.DeviceUnavailableError) as e:
            gproj_patch.audit.check(F.scaled_dot_product_attention, device=device)
        text = str(e.value)
        assert isinstance(e.value, RuntimeError) and not isinstance(e.value, AssertionError)
        assert e.value.device.startswith("cuda") and text.startswith("device 'cuda")
        assert "CUDA is not available" in text and "'cpu'" in text  # what is missing, and what to pass instead


def test_a_gpu_index_beyond_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(gproj_patch.audit.DeviceUnavailableError, match=r"'cuda:2'.*2 CUDA devices \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


def test_bad_device_names_are_value_errors():
    with pytest.raises(ValueError, match="bad device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="runs on cpu or cuda"):
        resolve_device("meta")


def test_the_fixture_skips_a_test_that_asks_for_a_missing_device(no_cuda):
    with pytest.raises(pytest.skip.Exception, match="CUDA is not available") as e:  # what pytest reports as a skip
        audit_and_assert(F.scaled_dot_product_attention, device="cuda")
    assert "device 'cuda'" in str(e.value)


def test_the_cli_gives_one_line(no_cuda, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["audit", "--device", "cuda", "--quick"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--device cuda: CUDA is not available" in err and "Traceback" not in err
