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


def test_a_memory_limit_caps_glibc_heaps_for_the_request_threads(tmp_path):
    """Under a memory limit the process keeps at most MALLOC_ARENAS glibc heaps: each request
    thread's freed host temporaries otherwise stayed in a heap of its own, outside the limit.
    Counted with malloc_info after 8 threads allocate at once, in a fresh process each way."""
    import os
    import subprocess
    import sys
    from minfer import devices
    if sys.platform != "linux":
        pytest.skip("glibc's heaps: Linux only")
    folder = write_t5(tmp_path / "m")
    code = f"""
import ctypes, sys, threading
import minfer
limit = sys.argv[1]
minfer.load({str(folder)!r}, memory_limit=None if limit == "none" else limit)
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    keep = [bytearray(20000) for _ in range(200)]
ts = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
f = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(f)); libc.fclose(ctypes.c_void_p(f))
print(open(sys.argv[2]).read().count("<heap nr="))
"""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    heaps = {}
    for limit in ("none", "64MiB"):
        run = subprocess.run([sys.executable, "-c", code, limit, str(tmp_path / f"{limit}.xml")],
                             capture_output=True, text=True, env=env, timeout=300)
        if run.returncode != 0 and "malloc_info" in run.stderr:
            pytest.skip("no glibc malloc_info")
        assert run.returncode == 0, run.stderr
        heaps[limit] = int(run.stdout.split()[-1])
    assert heaps["64MiB"] <= devices.MALLOC_ARENAS < heaps["none"]


def test_a_memory_limit_maps_large_host_blocks_on_their_own(tmp_path):
    """Under a memory limit a freed host block of MMAP_THRESHOLD bytes or more goes back to the
    system: glibc's dynamic threshold otherwise rises to the size of a freed mapped block, and
    the next temporaries below it come from the heap and stay there (RSS outside the limit).
    A 4 MiB block freed, then a 3 MiB one: in the heap without a limit, a mapping of its own
    under one (read from /proc/self/maps, in a fresh process each way)."""
    import os
    import subprocess
    import sys
    from minfer import devices
    if sys.platform != "linux":
        pytest.skip("glibc's malloc: Linux only")
    assert devices.MMAP_THRESHOLD <= 3 << 20
    folder = write_t5(tmp_path / "m")
    code = f"""
import sys
import numpy as np
import minfer
limit = sys.argv[1]
minfer.load({str(folder)!r}, memory_limit=None if limit == "none" else limit)
big = np.ones(4 << 20, np.uint8)
del big                                  # (a mapped block freed: glibc's threshold rises)
block = np.ones(3 << 20, np.uint8)
at = block.__array_interface__["data"][0]
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= at < hi:
        print("heap" if rest[-1] == "[heap]" else "mapped")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    where = {}
    for limit in ("none", "64MiB"):
        run = subprocess.run([sys.executable, "-c", code, limit], capture_output=True, text=True,
                             env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        where[limit] = run.stdout.split()[-1]
    assert where == {"none": "heap", "64MiB": "mapped"}
