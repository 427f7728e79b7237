"""A strict stand-in for CuPy over NumPy: the CUDA path's logic, checked on every CPU run.

No machine this project is developed on has a GPU, so `minfer/cuda.py` and the model code it
runs are exercised here against a fake `cupy` that is *stricter* than CuPy where CuPy would be
slow or wrong only on hardware, and as strict where CuPy raises:

- device arrays refuse implicit host conversion (`np.array(x)`, `np.asarray(x)`: `__array__`
  raises TypeError as CuPy's does), assignment from a NumPy array except through `.set` (CuPy
  refuses it too, gh-2079), element-wise math with NumPy arrays, and Python scalars (`float()`,
  `int()`, `bool()`, `.item()`, `.tolist()`): on a GPU each is a host sync, and minfer's device
  code syncs only where it says so (`asnumpy`, `.get()`), which are counted in `STATE.syncs`, as
  are boolean-mask indexing and `nonzero` (CuPy counts the mask on the host); the bytes copied
  each way are counted in `STATE.to_host` and `STATE.to_device`;
- every allocation goes through the thread's allocator (`cuda.using_allocator`), else through a
  memory pool whose cached blocks are invisible to `runtime.memGetInfo` (as CuPy's are), so
  cuda.py's arena routing is what places the temporaries, and `STATE.outside` counts device
  allocations that bypassed the arena;
- `matmul` allocates what CuPy 13.6 / 14.2 allocate (`cupy/_core/_routines_linalg.pyx`): for
  more than 2-D operands both are copied to float32 when half and the product is written to a
  float32 temporary, then copied into `out=`; 2-D operands neither C- nor F-ordered are copied;
  a non-contiguous or other-dtype `out` gets a temporary;
- `take(out=)` refuses an `out` of another dtype (TypeError, as CuPy's `_take`); overlapping
  copies (`a[:, :k] = a[:, j:j + k]`) raise, since on a GPU they read what they overwrite;
- kernels check the thread's current device against their operands' (CuPy raises); `Device` is
  per thread, as in CuPy;
- `ndarray.set(..., stream=s)` on a non-current stream is deferred until an event recorded
  after it is waited on (`wait_event`) or the stream is synchronised: reading the destination
  before that raises (a missing `wait_event` would read unfinished data on a GPU);
- `cuda.cublas.gemmStridedBatchedEx` is emulated over the raw pointers (column-major, leading
  dimensions, batch strides, float32 compute), bounds-checked against the allocation it
  addresses, so cuda.py's cuBLAS calls are checked here with real numbers;
- with `reset(dry=True)` arrays are shape-only: allocations, views, devices and dtypes are real
  (the bytes are never touched, so a t5-large-sized arena costs no memory) but no arithmetic
  runs, for measuring what a large run allocates.

`reset()` installs a fresh state; tests/conftest.py's `strict_cuda` fixture imports minfer.cuda
over this module.
"""
from __future__ import annotations

import builtins as _b
import contextlib
import sys
import threading
import types
from typing import Any

import numpy as np

# dtypes, as CuPy re-exports them
float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
bool_ = np.bool_
dtype = np.dtype
finfo, iinfo = np.finfo, np.iinfo
newaxis = None
inf, nan = np.inf, np.nan
POOL_ROUND = 512     # CuPy's pool rounds allocations up to 512 bytes
CUB_WORKSPACE = 512  # what a reduction allocates for CUB's temporary storage, and frees


class StrictError(AssertionError):
    """Something that would be wrong or slow on a GPU (a test failure, not a CuPy error)."""


class OutOfMemoryError(MemoryError):
    pass


class _State:
    def __init__(self, devices: int, memory: int, dry: bool, missing_libraries: bool,
                 driver_error: str | None):
        self.devices, self.memory, self.dry = devices, memory, dry
        self.missing_libraries, self.driver_error = missing_libraries, driver_error
        self.local = threading.local()
        self.syncs = 0                 # documented host syncs (asnumpy, get) and mask indexing
        self.to_host = 0               # bytes copied device -> host (get, asnumpy)
        self.to_device = 0             # bytes copied host -> device (set, asarray of host data)
        self.launches = 0              # kernels and cuBLAS calls
        self.outside = 0               # device allocations through the default pool ...
        self.counting_outside = False  # ... counted once a test starts watching
        self.pools = [MemoryPool(d) for d in range(devices)]
        self.registry: dict[int, Memory] = {}   # base ptr -> Memory, until a pool releases it
        self.inflight: list[tuple[int, int, Any]] = []   # (start, end, op) of deferred copies
        self.gemm_calls: list[dict] = []

    # thread-local current device, allocator and stream
    @property
    def device(self) -> int:
        return getattr(self.local, "device", 0)

    @device.setter
    def device(self, d: int) -> None:
        self.local.device = d


STATE: _State


def reset(devices: int = 2, memory: int = 1 << 30, dry: bool = False,
          missing_libraries: bool = False, driver_error: str | None = None) -> _State:
    """A fresh stand-in: `devices` GPUs of `memory` bytes each; `dry`: shape-only arrays;
    `missing_libraries`: cuBLAS / NVRTC absent (as with cupy-cuda12x without its [ctk] extra);
    `driver_error`: getDeviceCount raises this CUDARuntimeError message."""
    global STATE
    STATE = _State(devices, memory, dry, missing_libraries, driver_error)
    return STATE


# =====================================================================================================
# Memory
# =====================================================================================================
class Memory:
    """A device allocation: a NumPy byte buffer standing for device memory."""

    def __init__(self, size: int, device_id: int, buf: np.ndarray | None = None, owner: Any = None):
        self.size, self.device_id = size, device_id
        self.buf = np.empty(_b.max(size, 1), np.uint8) if buf is None else buf
        self.ptr = self.buf.__array_interface__["data"][0]
        self._owner = owner
        if buf is None:
            STATE.registry[self.ptr] = self


def _find(ptr: int) -> tuple[Memory, int]:
    """The registered allocation holding address `ptr`, and the offset into it."""
    for base, mem in list(STATE.registry.items()):
        if base <= ptr < base + mem.buf.nbytes:
            return mem, ptr - base
    raise StrictError(f"pointer {ptr:#x} is not inside any device allocation")


class UnownedMemory(Memory):
    """Memory inside another allocation (cupy.cuda.UnownedMemory): `owner` is kept alive."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1):
        base, offset = _find(ptr)
        self.size, self.device_id = size, base.device_id if device_id < 0 else device_id
        self.buf = base.buf[offset:offset + _b.max(size, 1)]
        self.ptr, self._owner, self._base = ptr, owner, base


class MemoryPointer:
    def __init__(self, mem: Memory, offset: int):
        self.mem, self.offset = mem, offset
        self.device_id = mem.device_id

    @property
    def ptr(self) -> int:
        return self.mem.ptr + self.offset


class MemoryPool:
    """CuPy's device pool, simplified: freed blocks stay cached (not free to the driver) until
    `free_all_blocks`; a block is reused for a request of at most its size."""

    def __init__(self, device: int):
        self.device = device
        self.cached: list[Memory] = []
        self.used = 0

    def held(self) -> int:
        return self.used + _b.sum(m.size for m in self.cached)

    def malloc(self, size: int) -> MemoryPointer:
        size = -(-_b.max(size, 1) // POOL_ROUND) * POOL_ROUND
        fits = [m for m in self.cached if m.size >= size]
        if fits:
            mem = _b.min(fits, key=lambda m: m.size)
            self.cached.remove(mem)
        else:
            if self.held() + size > STATE.memory:
                self.free_all_blocks()
                if self.held() + size > STATE.memory:
                    raise OutOfMemoryError(f"Out of memory allocating {size:,} bytes")
            mem = Memory(size, self.device)
        self.used += mem.size
        lease = _PoolLease(self, mem)
        return MemoryPointer(UnownedMemory(mem.ptr, size, lease, self.device), 0)

    def _give_back(self, mem: Memory) -> None:
        self.used -= mem.size
        self.cached.append(mem)

    def free_all_blocks(self, stream: Any = None) -> None:
        for mem in self.cached:
            STATE.registry.pop(mem.ptr, None)
        self.cached.clear()

    def free_bytes(self) -> int:
        return _b.sum(m.size for m in self.cached)

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.held()


class _PoolLease:
    """Returns a pool block to the cache when the last array over it is gone."""

    def __init__(self, pool: MemoryPool, mem: Memory):
        self.pool, self.mem = pool, mem

    def __del__(self) -> None:
        self.pool._give_back(self.mem)


def get_default_memory_pool() -> Any:
    return _DefaultPool()


class _DefaultPool:
    """cupy.get_default_memory_pool(): its methods act on the current device's pool."""

    def __getattr__(self, name: str) -> Any:
        return getattr(STATE.pools[STATE.device], name)


def _alloc(nbytes: int) -> MemoryPointer:
    allocator = getattr(STATE.local, "allocator", None)
    if allocator is None:
        if STATE.counting_outside:
            STATE.outside += 1
        return STATE.pools[STATE.device].malloc(nbytes)
    return allocator(nbytes)


# =====================================================================================================
# Streams and deferred copies
# =====================================================================================================
class Event:
    def __init__(self, stream: "Stream | None" = None, upto: int = 0):
        self.stream, self.upto = stream, upto

    def synchronize(self) -> None:
        STATE.syncs += 1
        if self.stream is not None:
            self.stream._flush(self.upto)


class Stream:
    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.queue: list[Any] = []
        self.done = 0
        self.device_id = STATE.device if "STATE" in globals() else 0

    def record(self, event: Any = None) -> Event:
        return Event(self, self.done + len(self.queue))

    def wait_event(self, event: Event) -> None:
        if event.stream is not None and event.stream is not self:
            event.stream._flush(event.upto)

    def synchronize(self) -> None:
        STATE.syncs += 1
        self._flush(self.done + len(self.queue))

    def _flush(self, upto: int) -> None:
        while self.done < upto and self.queue:
            op = self.queue.pop(0)
            op()
            self.done += 1

    def __enter__(self):
        self._prev = get_current_stream()
        STATE.local.stream = self
        return self

    def __exit__(self, *exc: Any) -> None:
        STATE.local.stream = self._prev


def get_current_stream() -> Stream:
    stream = getattr(STATE.local, "stream", None)
    if stream is None:
        stream = STATE.local.stream = Stream(null=True)
    return stream


def _extent(a: "ndarray") -> tuple[int, int]:
    """The byte range an array's elements span."""
    start = end = a._a.__array_interface__["data"][0]
    for n, s in zip(a._a.shape, a._a.strides):
        if n == 0:
            return start, start
        if s > 0:
            end += (n - 1) * s
        else:
            start += (n - 1) * s
    return start, end + a._a.itemsize


def _check_ready(*arrays: Any) -> None:
    if not STATE.inflight:
        return
    for a in arrays:
        if isinstance(a, ndarray):
            lo, hi = _extent(a)
            for s, e, _ in STATE.inflight:
                if lo < e and s < hi:
                    raise StrictError("a kernel touches memory whose host-to-device copy has not "
                                      "finished: the compute stream did not wait on its event")


# =====================================================================================================
# Devices and the runtime
# =====================================================================================================
class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device: int | None = None):
        self.id = STATE.device if device is None else int(device)
        if not 0 <= self.id < STATE.devices:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self.compute_capability = "90"

    def __enter__(self) -> "Device":
        stack = getattr(STATE.local, "stack", None)
        if stack is None:
            stack = STATE.local.stack = []
        stack.append(STATE.device)
        STATE.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        STATE.device = STATE.local.stack.pop()

    def use(self) -> None:
        STATE.device = self.id

    def synchronize(self) -> None:
        STATE.syncs += 1


def _device_count() -> int:
    if STATE.driver_error:
        raise CUDARuntimeError(STATE.driver_error)
    return STATE.devices


def _mem_get_info() -> tuple[int, int]:
    return STATE.memory - STATE.pools[STATE.device].held(), STATE.memory


def _cublas_handle() -> int:
    if STATE.missing_libraries:
        raise ImportError("libcublas.so.12: cannot open shared object file: No such file or directory")
    return 1000 + STATE.device


# cupy_backends.cuda.libs.cublas, as far as cuda.py uses it
cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T = 0, 1
cublas.CUBLAS_COMPUTE_32F = 68
cublas.CUBLAS_GEMM_DEFAULT, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
_CUDA_TYPES = {2: np.float16, 0: np.float32}


def _matrix(ptr: int, dtype: Any, rows: int, cols: int, ld: int, op: int, batch: int,
            stride: int) -> np.ndarray:
    """The (batch, rows, cols) operand op(M) of a column-major matrix M at `ptr` (leading
    dimension `ld`, batch stride `stride` elements), as a NumPy view, bounds-checked."""
    mem, offset = _find(ptr)
    item = np.dtype(dtype).itemsize
    stored_rows, stored_cols = (rows, cols) if op == 0 else (cols, rows)
    if ld < _b.max(1, stored_rows):
        raise StrictError(f"cuBLAS: leading dimension {ld} < {stored_rows} rows")
    view = np.ndarray((batch, stored_rows, stored_cols), dtype, buffer=mem.buf, offset=offset,
                      strides=(stride * item, item, ld * item))   # column-major, raises when
    return view if op == 0 else view.transpose(0, 2, 1)            # out of the allocation


def _gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA,
                             B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batch,
                             compute, algo) -> None:
    """C = op(A) op(B) per batch, column-major, float32 accumulation (alpha 1, beta 0)."""
    if handle != 1000 + STATE.device:
        raise StrictError("cuBLAS handle of another device")
    if compute != cublas.CUBLAS_COMPUTE_32F:
        raise StrictError("products must accumulate in float32 (CUBLAS_COMPUTE_32F)")
    STATE.launches += 1
    STATE.gemm_calls.append(dict(m=m, n=n, k=k, batch=batch, types=(Atype, Btype, Ctype)))
    a = _matrix(A, _CUDA_TYPES[Atype], m, k, lda, transa, batch, strideA)
    b = _matrix(B, _CUDA_TYPES[Btype], k, n, ldb, transb, batch, strideB)
    c = _matrix(C, _CUDA_TYPES[Ctype], m, n, ldc, 0, batch, strideC)
    for x in (a, b):
        if np.shares_memory(x, c):
            raise StrictError("cuBLAS output overlaps an input")
    for x in (a, b, c):
        _check_ready(_wrap_host(x))
    if not STATE.dry:
        c[...] = np.matmul(a.astype(np.float32), b.astype(np.float32))


def _gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
             Ctype, ldc, compute, algo) -> None:
    _gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype,
                             ldb, 0, beta, C, Ctype, ldc, 0, 1, compute, algo)


cublas.gemmStridedBatchedEx = _gemm_strided_batched_ex
cublas.gemmEx = _gemm_ex


def _wrap_host(view: np.ndarray) -> "ndarray":
    out = ndarray.__new__(ndarray)
    out._a, out._mem, out._dev = view, None, STATE.device
    return out


# =====================================================================================================
# Arrays
# =====================================================================================================
def _nbytes(shape: tuple[int, ...], dt: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize


class ndarray:
    """A device array: a NumPy view into a `Memory`, never handed to NumPy implicitly."""

    __array_priority__ = 1000  # NumPy scalars on the left defer to our reflected operators

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
                 strides: Any = None, order: str = "C"):
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        if memptr is None:
            memptr = _alloc(_nbytes(shape, dt))
        self._mem = memptr.mem
        self._dev = memptr.device_id
        self._a = np.ndarray(shape, dt, buffer=memptr.mem.buf, offset=memptr.offset,
                             strides=strides, order=order)

    def _view(self, a: np.ndarray) -> "ndarray":
        out = ndarray.__new__(ndarray)
        out._a, out._mem, out._dev = a, self._mem, self._dev
        return out

    # -- what CuPy refuses, or what would sync -----------------------------------------------------
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` "
                        "to construct a NumPy array explicitly.")

    def _scalar(self, what: str) -> Any:
        raise StrictError(f"{what} of a device array: an undocumented host sync")

    def __float__(self):
        return self._scalar("float()")

    def __int__(self):
        return self._scalar("int()")

    def __index__(self):
        return self._scalar("operator.index()")

    def __bool__(self):
        return self._scalar("bool()")

    def item(self):
        return self._scalar(".item()")

    def tolist(self):
        return self._scalar(".tolist()")

    def __iter__(self):
        raise StrictError("iterating a device array launches a kernel per element")

    # -- attributes -----------------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self._view(self._a.T))
    device = property(lambda self: Device(self._dev))

    def __len__(self) -> int:
        return len(self._a)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._mem, self._a.__array_interface__["data"][0] - self._mem.ptr)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"data": (self._a.__array_interface__["data"][0], False), "shape": self.shape,
                "typestr": self.dtype.str, "strides": self.strides, "version": 3}

    def __repr__(self) -> str:
        return f"strict_cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    # -- host transfers (the documented syncs) --------------------------------------------------------
    def get(self, stream: Any = None) -> np.ndarray:
        _launch([self])
        STATE.syncs += 1
        STATE.to_host += self.nbytes
        return np.array(self._a)

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError("Shape mismatch")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self._check_device()
        STATE.to_device += arr.nbytes
        if stream is None or stream is get_current_stream():
            _check_ready(self)
            if not STATE.dry:
                self._a[...] = arr
            return
        lo, hi = _extent(self)
        host = arr  # pinned memory stays valid: the caller keeps it
        entry = [lo, hi, None]

        def copy() -> None:
            if not STATE.dry:
                self._a[...] = host
            STATE.inflight.remove(tuple(entry))
        entry[2] = copy
        STATE.inflight.append(tuple(entry))
        stream.queue.append(copy)

    def _check_device(self) -> None:
        if self._dev != STATE.device:
            raise ValueError(f"The device where the array resides ({self._dev}) is different from "
                             f"the current device ({STATE.device}).")

    # -- views and copies -----------------------------------------------------------------------------
    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        r = self._a.reshape(shape, order=order)
        if r.size and not np.may_share_memory(r, self._a):   # NumPy copied: so would CuPy
            return _new_from(r, [self])
        return self._view(r)

    def ravel(self) -> "ndarray":
        return self.reshape(-1)

    def transpose(self, *axes: Any) -> "ndarray":
        return self._view(self._a.transpose(*axes))

    def swapaxes(self, a: int, b: int) -> "ndarray":
        return self._view(self._a.swapaxes(a, b))

    def view(self, dtype: Any = None) -> "ndarray":
        return self._view(self._a.view(dtype))

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> "ndarray":
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _new_from(lambda: self._a.astype(dtype), [self], self.shape, dtype)

    def copy(self, order: str = "C") -> "ndarray":
        return _new_from(lambda: self._a.copy(), [self], self.shape, self.dtype)

    def fill(self, value: Any) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError(f"Unsupported type {type(value)}")
        _launch([], [self])
        if not STATE.dry:
            self._a.fill(value)

    # -- indexing -------------------------------------------------------------------------------------
    def _key(self, key: Any) -> tuple[Any, bool, list]:
        """(NumPy key, advanced?, device operands); NumPy index arrays are uploaded (allocated)
        as CuPy does; a boolean mask syncs (its count decides the result's size)."""
        parts = key if isinstance(key, tuple) else (key,)
        out, advanced, devs = [], False, []
        for p in parts:
            if isinstance(p, ndarray):
                advanced = True
                devs.append(p)
                if p.dtype == np.bool_:
                    STATE.syncs += 1
                out.append(p._a)
            elif isinstance(p, (np.ndarray, list)):
                arr = np.asarray(p)
                advanced = True
                _alloc(arr.nbytes)  # CuPy copies a host index to the device
                if arr.dtype == np.bool_:
                    STATE.syncs += 1
                out.append(arr)
            else:
                out.append(p)
        return (tuple(out) if isinstance(key, tuple) else out[0]), advanced, devs

    def __getitem__(self, key: Any) -> "ndarray":
        k, advanced, devs = self._key(key)
        if advanced:
            return _new_from(lambda: self._a[k], [self, *devs])
        r = self._a[k]
        if not isinstance(r, np.ndarray):   # CuPy gives a 0-d array, never a scalar
            r = self._a[(k if isinstance(k, tuple) else (k,)) + (Ellipsis,)]
        return self._view(r)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError(f"Unsupported type {type(value)} (CuPy refuses assignment from host "
                            "arrays: use .set or cupy.asarray)")
        k, advanced, devs = self._key(key)
        target = None if advanced else self._a[k]
        srcs = [value] if isinstance(value, ndarray) else []
        _launch([*srcs, *devs], [self])
        if isinstance(value, ndarray) and target is not None and isinstance(target, np.ndarray) \
                and np.may_share_memory(target, value._a) and np.shares_memory(target, value._a) \
                and not (
                    target.__array_interface__ == value._a.__array_interface__):
            raise StrictError("overlapping device copy: on a GPU it reads what it overwrites")
        if not STATE.dry:
            self._a[k] = value._a if isinstance(value, ndarray) else value

    # -- reductions -----------------------------------------------------------------------------------
    def _reduce(self, name: str, axis: Any = None, dtype: Any = None, out: Any = None,
                keepdims: bool = False) -> "ndarray":
        kw = {"axis": axis, "keepdims": keepdims}
        if dtype is not None:
            kw["dtype"] = dtype
        fn = getattr(np, name)
        workspace = _alloc(CUB_WORKSPACE)   # CuPy's CUB reductions allocate temporary storage
        del workspace
        if out is not None:
            _launch([self], [out])
            if not STATE.dry:
                fn(self._a, out=out._a, **kw)
            return out
        return _new_from(lambda: np.asarray(fn(self._a, **kw)), [self])

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._reduce("sum", axis, dtype, out, keepdims)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._reduce("mean", axis, dtype, out, keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        return self._reduce("max", axis, None, out, keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return self._reduce("min", axis, None, out, keepdims)

    def any(self, axis=None, out=None, keepdims=False):
        return self._reduce("any", axis, None, out, keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        return self._reduce("all", axis, None, out, keepdims)

    def nonzero(self):
        STATE.syncs += 1
        return tuple(_new_from(lambda i=i: np.nonzero(self._a)[i], [self]) for i in range(self.ndim))

    # -- operators ------------------------------------------------------------------------------------
    def _binary(name: str, reflected: bool = False, inplace: bool = False):
        def op(self, other):
            args = (other, self) if reflected else (self, other)
            return _ufunc(name)(*args, out=self if inplace else None)
        return op

    __add__, __radd__, __iadd__ = _binary("add"), _binary("add", True), _binary("add", inplace=True)
    __sub__, __rsub__, __isub__ = (_binary("subtract"), _binary("subtract", True),
                                   _binary("subtract", inplace=True))
    __mul__, __rmul__, __imul__ = (_binary("multiply"), _binary("multiply", True),
                                   _binary("multiply", inplace=True))
    __truediv__, __rtruediv__, __itruediv__ = (_binary("divide"), _binary("divide", True),
                                               _binary("divide", inplace=True))
    __pow__ = _binary("power")
    __lshift__, __ilshift__ = _binary("left_shift"), _binary("left_shift", inplace=True)
    __and__, __or__ = _binary("bitwise_and"), _binary("bitwise_or")
    __lt__, __le__, __gt__, __ge__ = (_binary("less"), _binary("less_equal"), _binary("greater"),
                                      _binary("greater_equal"))
    __eq__, __ne__ = _binary("equal"), _binary("not_equal")
    __hash__ = object.__hash__
    __matmul__ = lambda self, other: matmul(self, other)  # noqa: E731

    def __neg__(self):
        return _ufunc("negative")(self)

    def __abs__(self):
        return _ufunc("absolute")(self)


def _launch(inputs: list, outputs: list = ()) -> None:
    """Checks of a kernel launch on the current device: every array there, none in flight."""
    STATE.launches += 1
    for a in (*inputs, *outputs):
        if isinstance(a, ndarray):
            a._check_device()
        elif isinstance(a, np.ndarray) and a.ndim:
            raise TypeError(f"Unsupported type {type(a)}")
    _check_ready(*inputs, *outputs)


def _new_from(compute: Any, inputs: list, shape: Any = None, dt: Any = None) -> ndarray:
    """A freshly allocated device array holding `compute()` (a NumPy array or a function giving
    one); dry runs allocate the shape without computing (give shape and dtype)."""
    _launch(inputs)
    if isinstance(compute, np.ndarray):
        host = compute
    elif STATE.dry and shape is not None:
        host = None
    else:
        host = np.asarray(compute())
    shape = host.shape if host is not None else tuple(shape)
    out = ndarray(shape, host.dtype if host is not None else dt)
    if host is not None and not STATE.dry:
        out._a[...] = host
    return out


def _val(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray) and x.ndim:
        raise TypeError(f"Unsupported type {type(x)}")
    return x


def _ufunc(name: str):
    fn = getattr(np, name)

    def call(*args: Any, out: Any = None, **kw: Any) -> Any:
        arrays = [a for a in args if isinstance(a, ndarray)]
        vals = [_val(a) for a in args]
        if out is not None:
            _launch(arrays, [out])
            if not STATE.dry:
                fn(*vals, out=out._a, **kw)
            return out
        if STATE.dry:
            shape = np.broadcast_shapes(*[np.shape(v) for v in vals])
            dt = np.result_type(*[v.dtype if isinstance(v, np.ndarray) else v for v in vals])
            if name in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal",
                        "isinf", "isnan", "logical_or", "logical_and"):
                dt = np.bool_
            return _new_from(None, arrays, shape, dt)
        return _new_from(lambda: fn(*vals, **kw), arrays)
    return call


for _name in ("add", "subtract", "multiply", "divide", "true_divide", "power", "exp", "log",
              "sqrt", "tanh", "maximum", "minimum", "fmax", "fmin", "negative", "absolute",
              "square", "sign", "isinf", "isnan", "greater", "less", "equal", "not_equal",
              "greater_equal", "less_equal", "logical_or", "logical_and", "reciprocal", "copysign",
              "left_shift", "bitwise_and", "bitwise_or", "sin", "cos", "floor", "rint"):
    globals()[_name] = _ufunc(_name)
abs = absolute  # noqa: A001,F821


def clip(a: ndarray, a_min: Any, a_max: Any, out: Any = None) -> ndarray:
    return _ufunc("clip")(a, a_min, a_max, out=out)


def where(cond: Any, x: Any, y: Any) -> ndarray:
    return _ufunc("where")(cond, x, y)


def copyto(dst: ndarray, src: Any, casting: str = "same_kind", where: Any = None) -> None:
    srcs = [a for a in (src, where) if isinstance(a, ndarray)]
    _launch(srcs, [dst])
    if not STATE.dry:
        np.copyto(dst._a, _val(src), casting=casting,
                  where=True if where is None else _val(where))


def _reduction(name: str):
    def call(a: ndarray, axis: Any = None, dtype: Any = None, out: Any = None,
             keepdims: bool = False) -> ndarray:
        if name in ("max", "min", "any", "all"):
            return getattr(a, name)(axis=axis, out=out, keepdims=keepdims)
        return a._reduce(name, axis, dtype, out, keepdims)
    return call


sum = _reduction("sum")  # noqa: A001
mean = _reduction("mean")
amax = max = _reduction("max")  # noqa: A001
amin = min = _reduction("min")  # noqa: A001
any = _reduction("any")  # noqa: A001
all = _reduction("all")  # noqa: A001


# -- creation -------------------------------------------------------------------------------------------
def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = ndarray(shape, dtype)
    out.fill(0)
    return out


def ones(shape: Any, dtype: Any = float) -> ndarray:
    out = ndarray(shape, dtype)
    out.fill(1)
    return out


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    out = ndarray(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
    out.fill(fill_value)
    return out


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return ndarray(a.shape, dtype or a.dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, dtype or a.dtype)


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _new_from(np.arange(*args, dtype=dtype), [])


def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        a._check_device()
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    out = ndarray(host.shape, host.dtype)
    STATE.to_device += host.nbytes
    _launch([], [out])
    if not STATE.dry:
        out._a[...] = host
    return out


array = asarray


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _new_from(lambda: np.ascontiguousarray(a._a, dtype=dtype), [a], a.shape,
                     dtype or a.dtype)


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
    if not isinstance(a, ndarray):
        return np.asarray(a)
    return a.get()


def concatenate(arrays: list, axis: int = 0) -> ndarray:
    for a in arrays:
        _val(a)
    return _new_from(lambda: np.concatenate([a._a for a in arrays], axis=axis), list(arrays))


def take(a: ndarray, indices: Any, axis: Any = None, out: Any = None) -> ndarray:
    if isinstance(indices, np.ndarray):
        _alloc(indices.nbytes)   # a host index is copied to the device
        idx = indices
    else:
        idx = indices._a if isinstance(indices, ndarray) else indices
    if out is not None:
        if out.dtype != a.dtype:
            raise TypeError("Output dtype mismatch")
        _launch([a, *([indices] if isinstance(indices, ndarray) else [])], [out])
        if not STATE.dry:
            np.take(a._a, idx, axis=axis, out=out._a)
        return out
    return _new_from(lambda: np.take(a._a, idx, axis=axis), [a])


def einsum(spec: str, *operands: ndarray) -> ndarray:
    return _new_from(lambda: np.einsum(spec, *[o._a for o in operands]), list(operands))


def shares_memory(a: ndarray, b: ndarray) -> bool:
    return bool(np.shares_memory(a._a, b._a))


may_share_memory = shares_memory


def matmul(a: ndarray, b: ndarray, out: ndarray | None = None) -> ndarray:
    """CuPy's matmul, with the temporaries CuPy allocates (see the module doc)."""
    _launch([a, b], [out] if out is not None else [])
    ndim = _b.max(a.ndim, b.ndim)
    ret = np.promote_types(a.dtype, b.dtype)
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])

    def product() -> np.ndarray:
        return np.matmul(a._a.astype(np.float32), b._a.astype(np.float32)).astype(ret)

    if ndim <= 2:
        for x in (a, b):
            if not (x.flags.c_contiguous or x.flags.f_contiguous):
                _alloc(x.nbytes)                       # _mat_to_cublas_contiguous copies
        if out is None or not (out.flags.c_contiguous and out.dtype == ret):
            c = ndarray(shape, ret)                    # dot's result, then copied into out
            if not STATE.dry:
                c._a[...] = product()
            if out is None:
                return c
            out[...] = c
            return out
    else:
        work = np.dtype(np.float32) if ret == np.float16 else ret
        for x in (a, b):                               # ascontiguousarray(x, float32)
            if x.dtype != work or not x.flags.c_contiguous:
                _alloc(_nbytes(x.shape, work))
        if out is None or out.dtype != work or not out.flags.c_contiguous:
            c = ndarray(shape, work)                   # the float32 product ...
            if not STATE.dry:
                c._a[...] = product()
            if out is None:
                return c.astype(ret) if work != ret else c
            out[...] = c                               # ... copied into out
            return out
    if not STATE.dry:
        out._a[...] = product()
    return out


# -- lib.stride_tricks -----------------------------------------------------------------------------------
def _as_strided(x: ndarray, shape: Any = None, strides: Any = None) -> ndarray:
    view = np.lib.stride_tricks.as_strided(x._a, shape, strides)
    if x._mem is not None and view.size:
        lo, hi = _extent(x._view(view))
        base = x._mem.buf.__array_interface__["data"][0]
        if lo < base or hi > base + x._mem.buf.nbytes:
            raise StrictError("as_strided view reaches outside its allocation")
    return x._view(view)


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))


# =====================================================================================================
# cupy.cuda
# =====================================================================================================
@contextlib.contextmanager
def _using_allocator(allocator: Any = None):
    previous = getattr(STATE.local, "allocator", None)
    STATE.local.allocator = allocator
    try:
        yield
    finally:
        STATE.local.allocator = previous


class _Pinned:
    """Pinned host memory: a buffer NumPy can wrap (np.frombuffer)."""

    def __init__(self, size: int):
        self._buf = bytearray(size)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._buf)


def _alloc_pinned_memory(size: int) -> Any:
    return _Pinned(size)._buf


runtime = types.SimpleNamespace(
    getDeviceCount=_device_count, memGetInfo=_mem_get_info, CUDARuntimeError=CUDARuntimeError,
    CUDA_R_16F=2, CUDA_R_32F=0)
cuda = types.ModuleType("cupy.cuda")
cuda.Device = Device
cuda.runtime = runtime
cuda.cublas = cublas
cuda.device = types.SimpleNamespace(get_cublas_handle=_cublas_handle, Device=Device)
cuda.using_allocator = _using_allocator
cuda.MemoryPointer = MemoryPointer
cuda.UnownedMemory = UnownedMemory
cuda.Memory = Memory
cuda.Stream = Stream
cuda.Event = Event
cuda.get_current_stream = get_current_stream
cuda.alloc_pinned_memory = _alloc_pinned_memory
cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
cuda.OutOfMemoryError = OutOfMemoryError


def install() -> types.ModuleType:
    """This module as `cupy` (and its cuBLAS as cupy_backends'), for `import cupy`."""
    module = sys.modules[__name__]
    return module


reset()
