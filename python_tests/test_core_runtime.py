import subprocess
import sys

import pytest

import msrl_core
from msrl_core import errors


def test_runtime_info_reports_every_backend_and_the_selection():
    info = msrl_core.runtime_info()
    assert set(info["backends"]) == {"host", "cuda", "acl"}
    assert info["backends"]["host"]["available"] is True
    assert info["selected"] in ("host", "cuda", "acl")
    assert info["requested"] == "auto"


def test_host_is_selected_when_asked():
    assert msrl_core.get_runtime("host").name == "host"
    assert msrl_core.get_runtime("cpu").device_is_host


def test_unknown_device_name_is_a_clear_value_error():
    with pytest.raises(errors.InvalidArgument, match="unknown device 'tpu'.*allowed") as exc:
        msrl_core.get_runtime("tpu")
    assert isinstance(exc.value, ValueError)
    assert isinstance(exc.value, errors.MsrlError)


def test_msrl_device_environment_variable_is_validated():
    code = "import msrl_core; print(msrl_core.runtime_info()['selected'])"
    ok = subprocess.run(
        [sys.executable, "-c", code], env={"MSRL_DEVICE": "host"}, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "host"
    bad = subprocess.run(
        [sys.executable, "-c", code], env={"MSRL_DEVICE": "quantum"}, capture_output=True, text=True
    )
    assert bad.returncode != 0
    assert "MSRL_DEVICE='quantum'" in bad.stderr and "allowed" in bad.stderr


def test_error_classes_inherit_the_fitting_builtins():
    assert issubclass(errors.InvalidArgument, ValueError)
    assert issubclass(errors.NotFound, KeyError)
    assert issubclass(errors.Timeout, TimeoutError)
    assert issubclass(errors.OutOfMemory, MemoryError)
    assert issubclass(errors.DeviceError, RuntimeError)
    for cls in (errors.InvalidArgument, errors.Timeout, errors.Closed, errors.Unavailable):
        assert issubclass(cls, errors.MsrlError)


def test_host_device_buffer_is_host_addressable():
    import numpy as np

    buf = msrl_core.get_runtime("host").device_alloc(64)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 5
    assert buf.nbytes == 64 and int(view.sum()) == 320
    with pytest.raises(errors.InvalidArgument, match="nbytes must be > 0"):
        msrl_core.get_runtime("host").device_alloc(-1)


def test_cli_info_prints_the_backends(capsys):
    import json

    from msrl_core.cli import main

    assert main(["info"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["selected"] == "host" or out["backends"][out["selected"]]["available"]
    assert out["backends"]["host"]["available"] is True
