"""Everything that touches CuPy: the device arena, its array namespace, pinned memory, transfers.

The only module that imports `cupy` (lazily, from `devices.make_backend`). Model code runs
unchanged over `DEVICE_ARRAYS` as its array namespace; what differs on a GPU lives here:

- `CudaArena`: the budget is one device allocation carved into aligned views, like the CPU arena.
  The model code's device work writes into planned arena buffers and allocates nothing itself;
  what CuPy still allocates by itself inside a compute scope (a reduction's workspace, small index
  copies, the XL head's temporaries) goes to a recycled pool of the size the scope was planned
  with (`Arena.scope(temporaries=)`, arena.TempPool), carved from the scope: a block comes back
  when its array is freed, so temporaries never pile up over the layers of a pass.
- `DEVICE_ARRAYS`: CuPy as the namespace, with `matmul` done by cuBLAS directly
  (`gemmStridedBatchedEx`): operands may be strided views (a head slice of fused q|k|v, a block of
  output columns) and half inputs accumulate in float32 on the tensor cores, writing into `out`.
  CuPy's own `matmul` copies both half operands of a > 2-D product to float32 and writes a float32
  temporary before `out` (CuPy 13.6 / 14.2, cupy/_core/_routines_linalg.pyx: `matmul` casts
  dtype 'e' to 'f' for ndim > 2), and copies 2-D operands that are neither C- nor F-ordered.
- `CudaTransfers`: streamed layers are copied host -> device on a separate non-blocking stream
  from pinned memory; each copy records an event the compute stream waits on (no host sync), and
  a slot is refilled only after the compute that read it has been queued and an event recorded.
- `CudaBackend`: `asarray` / `to_host` / `upload` / `host_buffer` over CuPy, each on the model's
  device: `cupy.cuda.Device.use()` is per thread, and a model is called from any thread (the
  batcher's leader, a Ray actor's threads), so every device call enters `Device(index)` itself.

No machine this project is developed on has a GPU: this module runs in the CPU tests over a
strict stand-in for CuPy (tests/strict_cupy.py: allocations, syncs, devices, streams and cuBLAS
calls emulated over NumPy), and on hardware in tests/test_cuda.py and benchmarks/gpu_check.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Iterator

import cupy  # noqa: F401  (ImportError here means: no CUDA backend, said by devices.py)
import numpy as np

from .arena import SCOPE_TEMPORARIES, Arena, TempPool, align_up, format_bytes, scope_bytes
from .backend import Backend
from .errors import ConfigError

log = logging.getLogger("minfer")

DEVICE_HEADROOM = 0.9  # without a limit, take this share of the free device memory
INSTALL_HINT = ("pip install 'minfer[cuda12]' or 'minfer[cuda13]' (CuPy with its [ctk] extra: "
                "cuBLAS, NVRTC and the CUDA runtime from PyPI), or install a CUDA toolkit")

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h), as CuPy's cublas module takes them
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68                      # CUBLAS_COMPUTE_32F: float32 accumulation, also for half
_GEMM_DEFAULT, _GEMM_TENSOR_OP = -1, 99
_CUDA_TYPE = {np.dtype(np.float16): 2, np.dtype(np.float32): 0}   # CUDA_R_16F, CUDA_R_32F
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)      # alpha, beta (host pointers)


# =====================================================================================================
# Devices
# =====================================================================================================
def device_count() -> int:
    """CUDA devices CuPy sees: 0 when there are none; a driver or runtime that cannot start is a
    ConfigError saying why (an old driver is not "no device")."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "cudaErrorNoDevice" in text:
            return 0
        if "InsufficientDriver" in text:
            raise ConfigError(f"device 'cuda': the NVIDIA driver is older than the CUDA runtime "
                              f"of this CuPy ({text}): update the driver, or install the CuPy "
                              "build for the CUDA version the driver supports (cupy-cuda12x or "
                              "cupy-cuda13x)") from None
        raise ConfigError(f"device 'cuda': CUDA does not start ({text})") from None


def check_libraries(index: int) -> None:
    """Fail at load, not at the first kernel, when the CUDA libraries are missing: a CuPy wheel
    without its [ctk] extra on a host that has only the driver imports fine, then has no cuBLAS,
    NVRTC or cudart (CuPy >= 14 declares them as the `ctk` extra: cuda-toolkit[cudart,nvrtc,
    cublas,...], setup.py)."""
    try:
        cupy.cuda.device.get_cublas_handle()             # loads cuBLAS
        probe = cupy.arange(2, dtype=np.float32)
        probe *= 2                                       # compiles a kernel: NVRTC
    except Exception as e:   # ImportError, CompileException, CUDARuntimeError, ... : one line
        text = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"device 'cuda:{index}': CuPy cannot load the CUDA libraries "
                          f"({type(e).__name__}: {text}); {INSTALL_HINT}") from None


# =====================================================================================================
# The array namespace: CuPy, with products by cuBLAS
# =====================================================================================================
def _transposed(rows: int, cols: int, s_rows: int, s_cols: int) -> tuple[int, int] | None:
    """A (rows, cols) matrix view with element strides (s_rows, s_cols) as the cuBLAS operand
    holding its transpose (cols x rows, column-major): (op, leading dimension), or None when
    neither axis has unit stride. Row-major storage is that transpose as it is (op N); column-
    major storage is the matrix itself, which cuBLAS transposes (op T)."""
    if cols == 1 or s_cols == 1:
        ld = s_rows if rows > 1 else cols
        return (_OP_N, ld) if ld >= max(1, cols) else None
    if rows == 1 or s_rows == 1:
        ld = s_cols if cols > 1 else rows
        return (_OP_T, ld) if ld >= max(1, rows) else None
    return None


def _batch_dims(batch: tuple[int, ...], arrays: list[Any], items: list[int]) -> list[list[int]] | None:
    """[count, stride of each array (elements, 0 where broadcast)] per batch axis, size-1 axes
    dropped and adjacent axes merged where every array allows; None if any stride is negative
    or not whole elements."""
    dims: list[list[int]] = []
    for axis in range(len(batch)):
        n = batch[axis]
        if n == 1:
            continue
        row = [n]
        for a, item in zip(arrays, items):
            k = axis - (len(batch) - (a.ndim - 2))          # the array's own batch axis, if any
            if k < 0 or a.shape[k] == 1:
                row.append(0)
                continue
            s = a.strides[k]
            if s < 0 or s % item:
                return None
            row.append(s // item)
        if dims and all(dims[-1][j] == row[j] * n for j in range(1, len(row))):
            dims[-1] = [dims[-1][0] * n, *row[1:]]
        else:
            dims.append(row)
    return dims


def strided_matmul(a: Any, b: Any, out: Any = None) -> Any:
    """a (..., M, K) @ b (..., K, N) into out (..., M, N) by cuBLAS, allocating nothing: the
    operands' last two axes need one unit stride each (any leading dimension), `out` a unit
    stride on its last axis; batch axes (broadcast or strided) are merged where their strides
    allow, the innermost one becomes cuBLAS's batch and the rest a loop. float16 or float32
    inputs, float32 accumulation, float16 or float32 output. Anything else goes to cupy.matmul."""
    plain = (out is None or a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype
             or a.dtype not in _CUDA_TYPE or out.dtype not in _CUDA_TYPE
             or (a.dtype == np.float32 and out.dtype == np.float16))
    if not plain:
        M, K = a.shape[-2:]
        N = b.shape[-1]
        batch = out.shape[:-2]
        ia, io = a.dtype.itemsize, out.dtype.itemsize
        plain = (b.shape[-2] != K or out.shape[-2:] != (M, N)
                 or np.broadcast_shapes(a.shape[:-2], b.shape[:-2], batch) != batch)
    if plain:
        return cupy.matmul(a, b, out=out)
    if out.size == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    sa, sb = [s // ia for s in a.strides[-2:]], [s // ia for s in b.strides[-2:]]
    to_a = _transposed(M, K, *sa)          # a^T: cuBLAS's B
    to_b = _transposed(K, N, *sb)          # b^T: cuBLAS's A
    so = out.strides[-2:]
    unit_out = N == 1 or so[1] == io
    ldc = so[0] // io if M > 1 else N
    dims = _batch_dims(batch, [a, b, out], [ia, ia, io])
    if to_a is None or to_b is None or not unit_out or ldc < N or dims is None \
            or any(s % it for s, it in ((a.strides[-2], ia), (b.strides[-2], ia), (so[0], io))):
        return cupy.matmul(a, b, out=out)
    inner = dims[-1] if dims else [1, 0, 0, 0]
    outer = dims[:-1]
    gemm = cupy.cuda.cublas.gemmStridedBatchedEx
    handle = cupy.cuda.device.get_cublas_handle()
    in_type, out_type = _CUDA_TYPE[a.dtype], _CUDA_TYPE[out.dtype]
    algo = _GEMM_TENSOR_OP if a.dtype == np.float16 else _GEMM_DEFAULT
    for index in np.ndindex(*[d[0] for d in outer]):
        off = [sum(i * d[j] for i, d in zip(index, outer)) for j in (1, 2, 3)]
        gemm(handle, to_b[0], to_a[0], N, M, K, _ONE.ctypes.data,
             b.data.ptr + off[1] * ia, in_type, to_b[1], inner[2],
             a.data.ptr + off[0] * ia, in_type, to_a[1], inner[1],
             _ZERO.ctypes.data,
             out.data.ptr + off[2] * io, out_type, ldc, inner[3],
             inner[0], _COMPUTE_32F, algo)
    return out


class DeviceArrays:
    """The model code's array namespace on a GPU: CuPy's, with `matmul` = `strided_matmul`."""

    matmul = staticmethod(strided_matmul)

    def __getattr__(self, name: str) -> Any:
        value = getattr(cupy, name)
        setattr(self, name, value)      # looked up once
        return value


DEVICE_ARRAYS = DeviceArrays()


# =====================================================================================================
# The arena
# =====================================================================================================
class _Lease:
    """Keeps a pool block taken while its CuPy memory lives; gives it back when that goes."""

    def __init__(self, pool: TempPool, offset: int):
        self.pool, self.offset = pool, offset

    def __del__(self) -> None:
        self.pool.give(self.offset)


class CudaArena(Arena):
    """The CPU arena's bump allocator over one device buffer; its compute scopes also serve
    CuPy's own allocations, from a recycled pool (see the module doc)."""

    def __init__(self, capacity: int, device: int):
        self.device = device
        with cupy.cuda.Device(device):
            super().__init__(capacity, cupy, name=f"cuda:{device}")
        self.pool: TempPool | None = None     # the open compute scope's temporaries
        self.pool_peak = 0                    # the most temporaries alive at once, any scope
        # the pool of every scope that needs no more, held for good: a decode step then takes
        # nothing from the arena, however full other requests left it
        self._base_pool = self.hold({"pool": ((SCOPE_TEMPORARIES,), np.uint8)}).buffers["pool"]

    def scope_overhead(self, temporaries: int = 0) -> int:
        """What an outermost scope carves first: nothing when its temporaries fit the arena's
        own pool (nested scopes share the open one)."""
        return 0 if self.pool is not None else scope_bytes(temporaries)

    @contextlib.contextmanager
    def scope(self, temporaries: int = 0) -> Iterator["CudaArena"]:
        """A scope on this arena's device (entered here: `Device.use` is per thread). The
        outermost scope carves a pool of `temporaries` bytes (at least SCOPE_TEMPORARIES) for
        CuPy's own allocations; nested scopes share it."""
        with cupy.cuda.Device(self.device), super().scope():
            if self.pool is not None:
                yield self
                return
            size = align_up(max(int(temporaries), SCOPE_TEMPORARIES))
            region = (self._base_pool if size == SCOPE_TEMPORARIES
                      else self.alloc((size,), np.uint8, "CuPy temporaries"))
            pool = TempPool(size, self.name)
            base = region.data.ptr

            def allocate(nbytes: int) -> Any:
                offset = pool.take(nbytes)
                memory = cupy.cuda.UnownedMemory(base + offset, max(nbytes, 1),
                                                 _Lease(pool, offset), self.device)
                return cupy.cuda.MemoryPointer(memory, 0)

            self.pool = pool
            try:
                with cupy.cuda.using_allocator(allocate):
                    yield self
                if pool.live:            # a temporary still referenced: collect cycles, recheck
                    gc.collect()
                if pool.live:
                    raise RuntimeError(f"arena '{self.name}': {pool.live} CuPy temporaries "
                                       "outlived their scope (their memory is reused)")
            finally:
                self.pool = None
                self.pool_peak = max(self.pool_peak, pool.peak)


# =====================================================================================================
# Transfers and the backend
# =====================================================================================================
class CudaTransfers:
    """Host (pinned) -> device copies on their own stream, ordered by events (see module doc)."""

    def __init__(self) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._slot_free: dict[int, Any] = {}

    def issue(self, source: Any, slot: Any, unit: str, slot_index: int = 0) -> Any:
        free = self._slot_free.pop(slot_index, None)
        if free is not None:
            self.stream.wait_event(free)  # don't overwrite weights a queued kernel still reads
        slot[:source.nbytes].set(source.array, stream=self.stream)
        return self.stream.record()

    def wait(self, ticket: Any) -> None:
        cupy.cuda.get_current_stream().wait_event(ticket)  # the compute stream waits, not the host

    def slot_released(self, slot_index: int) -> None:
        self._slot_free[slot_index] = cupy.cuda.get_current_stream().record()

    def close(self) -> None:
        self.stream.synchronize()


class CudaBackend(Backend):
    @property
    def index(self) -> int:
        return self.arena.device

    def on_device(self) -> Any:
        return cupy.cuda.Device(self.index)

    def asarray(self, host: Any, dtype: Any = None) -> Any:
        with self.on_device():
            return cupy.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        with self.on_device():
            return cupy.asnumpy(array)

    def owned_empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array the caller owns, from CuPy's default pool: also inside a compute
        scope, whose allocations go to the scope's recycled pool and must not outlive it."""
        with self.on_device(), cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            return cupy.empty(shape, dtype)

    def upload(self, dst: Any, host: np.ndarray) -> None:
        with self.on_device():
            if dst.flags.c_contiguous:
                dst.set(np.ascontiguousarray(host, dtype=dst.dtype).reshape(dst.shape))
            else:  # a strided view (a block of columns): go through a device temporary
                dst[...] = cupy.asarray(np.ascontiguousarray(host), dtype=dst.dtype)

    def host_buffer(self, block: np.ndarray) -> np.ndarray:
        """A pinned (page-locked) copy of `block`, so copies to the device can be asynchronous."""
        pinned = cupy.cuda.alloc_pinned_memory(block.nbytes)
        out = np.frombuffer(pinned, np.uint8, block.nbytes)  # keeps `pinned` alive
        out[...] = block.reshape(-1).view(np.uint8)
        return out

    def make_transfers(self) -> CudaTransfers:
        with self.on_device():            # a stream belongs to the device current at creation
            return CudaTransfers()


def make_cuda_backend(index: int, compute: np.dtype, weight_format: str, limit: int | None,
                      reserve: int | None) -> CudaBackend:
    count = device_count()
    if count == 0:
        raise ConfigError("device 'cuda': CuPy finds no CUDA device; use device='cpu' or 'auto'")
    if index >= count:
        raise ConfigError(f"device 'cuda:{index}': only {count} CUDA device(s) found")
    with cupy.cuda.Device(index):
        check_libraries(index)
        # A freed model's arena goes back to CuPy's pool, which keeps it cached: not free to the
        # driver, so memGetInfo would not count it. Collect models dropped in reference cycles,
        # then hand the cached blocks back.
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        free, _total = cupy.cuda.runtime.memGetInfo()
    if limit is not None and limit > free:
        raise ConfigError(f"memory_limit {format_bytes(limit)} exceeds the free memory of cuda:{index} "
                          f"({format_bytes(free)})")
    capacity = limit if limit is not None else int(free * DEVICE_HEADROOM)
    if reserve is not None and reserve > capacity:
        raise ConfigError(f"workspace {format_bytes(reserve)} exceeds the device budget "
                          f"{format_bytes(capacity)}")
    # On the GPU the arena is always the budget: weights, slots and workspace all live in it.
    arena = CudaArena(capacity, index)
    # (the budget the weights are planned in: what the arena's own temporaries pool leaves)
    return CudaBackend(xp=DEVICE_ARRAYS, device=f"cuda:{index}", arena=arena,
                       dtype=compute, weight_format=weight_format, compute=np.dtype(compute).name,
                       memory_limit=arena.available,
                       workspace=reserve)
