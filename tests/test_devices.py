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
        make_backend("cpu", "int3")
    if not cuda_available():
        with pytest.raises(ConfigError, match="CuPy is not installed|no CUDA device"):
            make_backend("cuda")
        assert make_backend("auto").device == "cpu"


def test_load_rejects_bad_options(tmp_path):
    folder = write_t5(tmp_path / "m")
    with pytest.raises(ConfigError, match="device 'tpu'"):
        minfer.load(folder, device="tpu")
    with pytest.raises(ConfigError, match="dtype 'int3'"):
        minfer.load(folder, dtype="int3")
    with pytest.raises(ConfigError, match="compute 'float64' is not supported on device 'cpu'"):
        minfer.load(folder, compute="float64")
    with pytest.raises(ConfigError, match="compute='int8' multiplies int8 or int4 weights, not "
                                          "dtype 'float16'"):
        minfer.load(folder, dtype="float16", compute="int8")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        minfer.load(folder, colour="red")
    with pytest.raises(minfer.errors.ModelNotFoundError, match="no such folder"):
        minfer.load(tmp_path / "nope")


@pytest.mark.parametrize("dtype, compute, want", [
    (None, None, ("float32", "float32")), ("int4", None, ("int4", "float32")),
    ("int8", "int8", ("int8", "int8")), ("int4", "INT8", ("int4", "int8")),
    ("bf16", "fp32", ("bfloat16", "float32"))])
def test_dtype_says_how_weights_are_stored_and_compute_what_products_run_in(dtype, compute, want):
    be = make_backend("cpu", dtype, compute=compute)
    assert (be.weight_format, be.compute) == want and be.dtype == "float32"


def test_compute_int8_without_a_dtype_stores_int8_and_a_quantised_file_keeps_its_format(tmp_path):
    from minfer.convert import convert
    folder = write_t5(tmp_path / "m", d_model=64, d_kv=16, d_ff=128)
    m = minfer.load(folder, compute="int8")
    assert (m.backend.weight_format, m.backend.compute) == ("int8", "int8")
    convert(folder, tmp_path / "q4", "int4")
    for dtype in (None, "auto"):
        m = minfer.load(tmp_path / "q4", dtype=dtype, compute="int8")
        assert (m.backend.weight_format, m.backend.compute) == ("int4", "int8")
    assert minfer.load(tmp_path / "q4", dtype="int8").backend.weight_format == "int8"


@pytest.mark.parametrize("option", ["memory_limit", "workspace"])
def test_a_budget_beyond_the_machine_is_a_config_error(monkeypatch, option):
    import minfer.devices as devices
    monkeypatch.setattr(devices, "available_memory", lambda: (3 << 30, "MemAvailable in /proc/meminfo"))
    with pytest.raises(ConfigError) as err:
        make_backend("cpu", **{option: "4GiB"})
    msg = str(err.value)
    assert msg.startswith(f"{option} 4.00 GiB ({4 << 30} bytes) exceeds") and "3.00 GiB" in msg
    assert "MemAvailable" in msg and "\n" not in msg
    assert make_backend("cpu", **{option: "64MiB"}).arena.capacity == 64 << 20


def test_the_real_machine_refuses_a_petabyte():
    from minfer.devices import available_memory
    found = available_memory()
    assert found is None or found[0] > 0
    with pytest.raises(ConfigError, match="1.00 PiB"):   # (from the arena where nothing says)
        make_backend("cpu", memory_limit="1024TiB")
