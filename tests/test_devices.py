"""Building a backend from user options (devices.py, backend.py): device names, dtypes, budgets."""
import pytest
from factories import write_t5  # noqa: E402

import minfer
from minfer.devices import cuda_available, make_backend
from minfer.errors import ConfigError


def test_device_selection_errors_are_clear():
    with pytest.raises(ConfigError, match="expected 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        make_backend("tpu")
    with pytest.raises(ConfigError, match="cuda:N"):
        make_backend("cuda:x")
    with pytest.raises(ConfigError, match="not supported on device 'cpu'"):
        make_backend("cpu", "int4")
    if not cuda_available():
        with pytest.raises(ConfigError, match="CuPy is not installed|no CUDA device"):
            make_backend("cuda")
        assert make_backend("auto").device == "cpu"


def test_load_rejects_bad_options(tmp_path):
    folder = write_t5(tmp_path / "m")
    with pytest.raises(ConfigError, match="device 'tpu'"):
        minfer.load(folder, device="tpu")
    with pytest.raises(ConfigError, match="dtype 'int4'"):
        minfer.load(folder, dtype="int4")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        minfer.load(folder, colour="red")
    with pytest.raises(minfer.errors.ModelNotFoundError, match="no such folder"):
        minfer.load(tmp_path / "nope")
