"""PyTorch pickle files (pytorch_model.bin) and pickled vocabularies, read without torch and without running
pickle code.

A pickle is a small program: its GLOBAL opcodes import any name and its REDUCE / NEWOBJ / BUILD
opcodes call what they imported, so `pickle.load` of an untrusted file can run `os.system`. We run
it with `pickle.Unpickler.find_class` overridden to answer only from an explicit allow-list of
objects that *this module* defines or that are plain containers; any other name is refused with a
one-line error before anything is called. torch itself is never imported.

Formats (see torch/serialization.py, `_save` / `_legacy_save` / `_load` / `_legacy_load`):
- zip (torch >= 1.6 default): `<archive>/data.pkl` holds the object; each storage it uses is a
  persistent id ('storage', storage_type, key, location, numel) whose raw bytes are the archive
  member `<archive>/data/<key>` (stored uncompressed, 64-byte aligned); `<archive>/byteorder`
  says "little" or "big" (absent in old files: little).
- legacy (torch < 1.6; e.g. the 2019 Transformer-XL files on the hub): five pickles back to back:
  the magic number 0x1950a86a20f9469cfc6c, the protocol version 1001, a sys-info dict, the object
  (storages as ('storage', storage_type, key, location, numel, view_metadata)), and the list of
  storage keys; then, per key in that order, an int64 element count and the raw little-endian
  bytes.
- tar (torch < 0.4): refused.

Tensors are `_rebuild_tensor_v2(storage, storage_offset, size, stride, ...)` calls: we record
them (validating that offset + extent lies inside the storage, and the storage's declared size
against the bytes actually in the file, before any allocation) and materialise them later with
`as_strided` over the bytes they span, read with file I/O (what `Checkpoint` does by default) or
through a memory map of the file, copied to a contiguous array. bfloat16 is kept as raw
uint16 bits until read and then widened to float32 like checkpoint.py does.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable

import _compat_pickle
import numpy as np

from ..errors import CheckpointError, TokenizerError
from .tensors import STORAGE, TensorInfo, bf16_to_float32

TORCH_MAGIC = 0x1950A86A20F9469CFC6C
TORCH_LEGACY_PROTOCOL = 1001
MAX_PICKLE_BYTES = 256 * 1024 * 1024   # a zip's data.pkl is read whole; real ones are kilobytes

TENSOR_GLOBALS_NOTE = "only tensors and plain containers are allowed"
VOCAB_GLOBALS_NOTE = "a vocabulary holds only plain containers"


def _quoted(text: str, limit: int = 120) -> str:
    """A name from the file, safe to put in a one-line message."""
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return _quoted(lines[0], 160) if lines else type(exc).__name__


# -- what tensor pickles may build --------------------------------------------------------------
class _StorageType:
    """Stands for `torch.FloatStorage` & co: a name with a dtype code, nothing callable."""
    __slots__ = ("code",)

    def __init__(self, code: str):
        self.code = code

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a storage type cannot be modified")


_STORAGE_TYPES = {
    "torch.DoubleStorage": "F64", "torch.FloatStorage": "F32", "torch.HalfStorage": "F16",
    "torch.BFloat16Storage": "BF16", "torch.LongStorage": "I64", "torch.IntStorage": "I32",
    "torch.ShortStorage": "I16", "torch.CharStorage": "I8", "torch.ByteStorage": "U8",
    "torch.BoolStorage": "BOOL",
}


class _Storage:
    """One storage referenced by the pickle: key, dtype code, element count and where its bytes
    are (filled in once known). A legacy view storage points into its root's bytes."""
    __slots__ = ("key", "code", "numel", "root", "start", "offset", "packed")

    def __init__(self, key: str, code: str, numel: int, root: _Storage | None = None,
                 start: int = 0):
        self.key, self.code, self.numel = key, code, numel
        self.root, self.start = root, start          # view: elements [start, start+numel) of root
        self.offset: int | None = None               # absolute byte offset of the data in the file
        self.packed: zipfile.ZipInfo | None = None   # a compressed zip member instead

    @property
    def nbytes(self) -> int:
        return self.numel * STORAGE[self.code].itemsize

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a storage cannot be modified")


class _Tensor:
    """A recorded `_rebuild_tensor_v2` call."""
    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: _Storage, offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...]):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride

    @property
    def extent(self) -> int:
        """Elements of the storage spanned from `offset` (0 for an empty tensor)."""
        if math.prod(self.shape) == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a tensor cannot be modified")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(_is_int(v) and v >= 0 for v in value):
        return tuple(value)
    return None


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> _Tensor:
    shape, strides = _int_tuple(size), _int_tuple(stride)
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError(f"tensor storage is a {type(storage).__name__}")
    if shape is None or strides is None or len(shape) != len(strides):
        raise pickle.UnpicklingError(f"malformed tensor size {size!r} / stride {stride!r}")
    if not _is_int(storage_offset) or storage_offset < 0:
        raise pickle.UnpicklingError(f"malformed storage offset {storage_offset!r}")
    return _Tensor(storage, storage_offset, shape, strides)   # extent checked by TorchFile


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> _Tensor:
    if metadata and any(metadata.values() if isinstance(metadata, dict) else [True]):
        raise pickle.UnpicklingError(f"tensor with lazy negation/conjugation {metadata!r} "
                                     "is not supported")
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise pickle.UnpicklingError(f"parameter data is a {type(data).__name__}")
    return data


TENSOR_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    **{name: _StorageType(code) for name, code in _STORAGE_TYPES.items()},
}


# -- what vocabulary pickles may build ----------------------------------------------------------
class _Ignored:
    """Stands for an instance of an allow-listed class whose contents we do not need (a Moses
    tokenizer, a regex, a trie, an AddedToken): constructing, filling and BUILDing it does
    nothing, so no code of the real class runs and no state is kept."""
    __slots__ = ()
    global_name = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):   # SETITEMS, should the class be a dict subclass
        pass

    def append(self, item):              # APPENDS, should the class be a list subclass
        pass

    def extend(self, items):
        pass

    def __repr__(self):
        return f"<ignored {self.global_name}>"


# Objects transformers' TransfoXLTokenizer.save_vocabulary pickles along with the vocabulary
# (it dumps the tokenizer's whole __dict__): checked with transformers 4.57.6.
IGNORED_GLOBALS = (
    "re._compile",                                      # compiled punctuation patterns
    "sacremoses.tokenize.MosesTokenizer",
    "sacremoses.tokenize.MosesDetokenizer",
    "sacremoses.normalize.MosesPunctNormalizer",
    "transformers.tokenization_utils.Trie",
    "tokenizers.AddedToken",
    "transformers.tokenization_utils_base.AddedToken",  # older transformers
)


def _ignored_class(name: str) -> type[_Ignored]:
    return type("Ignored", (_Ignored,), {"__slots__": (), "global_name": name})


def _latin1_bytes(text, encoding="latin1"):
    """`_codecs.encode`, as protocol-2 pickles spell bytes: only str -> latin-1 bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin-1 bytes")
    return text.encode("latin-1")


def _reconstructor(cls, base, state=None):
    """`copyreg._reconstructor` (protocol 0/1 objects): only for ignored placeholders."""
    if isinstance(cls, type) and issubclass(cls, _Ignored):
        return cls()
    raise pickle.UnpicklingError(f"copyreg._reconstructor of {type(cls).__name__} refused")


VOCAB_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "_codecs.encode": _latin1_bytes,
    "copyreg._reconstructor": _reconstructor,
    **{name: _ignored_class(name) for name in IGNORED_GLOBALS},
}


# -- the restricted unpickler -------------------------------------------------------------------
class _Unpickler(pickle.Unpickler):
    """find_class answers from `allowed` only; persistent ids go to `persistent` (or are refused)."""

    def __init__(self, file, path: Path, allowed: dict[str, Any], note: str, error: type,
                 persistent: Callable[[Any], Any] | None):
        super().__init__(file, encoding="utf-8")
        self._path, self._allowed, self._note, self._error = path, allowed, note, error
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)            # Python 2 names, as the default find_class maps them
        key = _compat_pickle.NAME_MAPPING.get(key, key)
        mod = _compat_pickle.IMPORT_MAPPING.get(key[0], key[0])
        found = self._allowed.get(f"{mod}.{key[1]}")
        if found is None:
            raise self._error(f"{self._path}: refuses to unpickle global "
                              f"'{_quoted(f'{module}.{name}')}' ({self._note})")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._error(f"{self._path}: refuses a persistent reference "
                              f"{_quoted(repr(pid), 80)} (expected no tensors)")
        return self._persistent(pid)


_PICKLE_FAILURES = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                    AttributeError, OverflowError, MemoryError, RecursionError, struct.error)


class _Reader:
    """One file being read: where errors go, what its pickles may build."""

    def __init__(self, path: Path, allowed: dict[str, Any], note: str, error: type):
        self.path, self.allowed, self.note, self.error = path, allowed, note, error
        self.storages: dict[str, _Storage] = {}

    def fail(self, message: str) -> Exception:
        return self.error(f"{self.path}: {message}")

    def unpickle(self, file, persistent: Callable[[Any], Any] | None = None,
                 failure: str = "not a valid pickle") -> Any:
        try:
            return _Unpickler(file, self.path, self.allowed, self.note, self.error,
                              persistent).load()
        except _PICKLE_FAILURES as e:
            raise self.fail(f"{failure} ({_first_line(e)})") from None

    def storage(self, stype: Any, key: Any, numel: Any) -> _Storage:
        """The storage a persistent id names (the same object for the same key)."""
        if not isinstance(stype, _StorageType):
            raise self.fail(f"storage type is a {type(stype).__name__}, not a torch storage class")
        if not isinstance(key, str) or not _is_int(numel) or numel < 0:
            raise self.fail(f"malformed storage reference (key {_quoted(repr(key), 40)}, "
                            f"numel {_quoted(repr(numel), 40)})")
        known = self.storages.get(key)
        if known is None:
            known = self.storages[key] = _Storage(key, stype.code, numel)
        elif known.code != stype.code or known.numel != numel:
            raise self.fail(f"storage '{_quoted(key)}' is referenced as {known.code} x "
                            f"{known.numel} and as {stype.code} x {numel}")
        return known


def _sniff(path: Path, reader: _Reader) -> tuple[str, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        raise reader.fail(f"cannot read: {e.strerror or e}") from None
    if size == 0:
        return "empty", size
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip", size
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar", size
    return "pickle", size


# -- zip files ----------------------------------------------------------------------------------
def _read_zip(reader: _Reader, size: int) -> tuple[Any, str]:
    """The object of a torch zip file, its storages located; and its byte order."""
    try:
        with zipfile.ZipFile(reader.path) as z:
            infos = {i.filename: i for i in z.infolist()}
            pickles = [n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")
                       and n.count("/") == 1]
            if len(pickles) != 1:
                raise reader.fail("not a PyTorch checkpoint (zip archive without one "
                                  "<archive>/data.pkl)")
            prefix = pickles[0][: -len("data.pkl")]
            order = "little"
            if prefix + "byteorder" in infos:
                order = z.read(prefix + "byteorder").decode("ascii", "replace").strip()
                if order not in ("little", "big"):
                    raise reader.fail(f"unknown byte order {_quoted(order, 20)!r}")
            if infos[pickles[0]].file_size > MAX_PICKLE_BYTES:
                raise reader.fail(f"{pickles[0]} is larger than {MAX_PICKLE_BYTES} bytes")
            data = z.read(pickles[0])

            def persistent(pid: Any) -> _Storage:
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise reader.fail(f"unexpected persistent id {_quoted(repr(pid), 80)}")
                st = reader.storage(pid[1], pid[2], pid[4])
                if st.offset is None and st.packed is None:
                    _locate_member(reader, z, infos, prefix, st, size)
                return st

            obj = reader.unpickle(io.BytesIO(data), persistent)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError,
            EOFError, ValueError) as e:
        raise reader.fail(f"unreadable zip archive ({_first_line(e)})") from None
    return obj, order


def _locate_member(reader: _Reader, z: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo],
                   prefix: str, st: _Storage, size: int) -> None:
    """Find data/<key>, check its size against the storage's before anything is allocated."""
    name = f"{prefix}data/{st.key}"
    info = infos.get(name)
    if info is None:
        raise reader.fail(f"storage file {_quoted(name)} is missing")
    if info.file_size != st.nbytes:
        raise reader.fail(f"storage file {_quoted(name)} holds {info.file_size} bytes, expected "
                          f"{st.nbytes} ({st.numel} x {st.code}): truncated or corrupt")
    if info.compress_type != zipfile.ZIP_STORED:
        st.packed = info
        return
    z.fp.seek(info.header_offset)
    local = z.fp.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise reader.fail(f"storage file {_quoted(name)}: bad local zip header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    st.offset = info.header_offset + 30 + name_len + extra_len
    if st.offset + st.nbytes > size:
        raise reader.fail(f"storage file {_quoted(name)} runs past the end of the file: truncated")


# -- legacy (pre-1.6) files ---------------------------------------------------------------------
def _legacy_persistent(reader: _Reader) -> Callable[[Any], _Storage]:
    def persistent(pid: Any) -> _Storage:
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            raise reader.fail("refuses a pickled torch module (only tensors and plain containers "
                              "are allowed)")
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise reader.fail(f"unexpected persistent id {_quoted(repr(pid), 80)}")
        _, stype, key, _location, numel, view = pid
        root = reader.storage(stype, key, numel)
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and _is_int(view[1]) and _is_int(view[2]) and view[1] >= 0 and view[2] >= 0
                and view[1] + view[2] <= root.numel):
            raise reader.fail(f"malformed storage view {_quoted(repr(view), 80)}")
        known = reader.storages.get(view[0])
        if known is None:
            known = reader.storages[view[0]] = _Storage(view[0], root.code, view[2], root, view[1])
        return known
    return persistent


def _read_legacy_rest(reader: _Reader, f, size: int, persistent: bool) -> Any:
    """After the magic number: protocol, sys info, the object and (for tensors) the storages."""
    proto = reader.unpickle(f)
    if proto != TORCH_LEGACY_PROTOCOL:
        raise reader.fail(f"unsupported torch.save protocol version {_quoted(repr(proto), 40)}")
    reader.unpickle(f)                                     # sys info: sizes of C types, unused
    obj = reader.unpickle(f, _legacy_persistent(reader) if persistent else None)
    keys = reader.unpickle(f)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise reader.fail("malformed storage key list")
    roots = {k: s for k, s in reader.storages.items() if s.root is None}
    missing = sorted(set(roots) - set(keys))
    if missing:
        raise reader.fail(f"storage '{_quoted(missing[0])}' has no data in the file")
    pos = f.tell()
    for key in keys:
        st = roots.get(key)
        if st is None:
            raise reader.fail(f"data for unknown storage '{_quoted(key)}'")
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            raise reader.fail(f"storage '{_quoted(key)}' is missing: file truncated")
        (numel,) = struct.unpack("<q", head)
        if numel != st.numel:
            raise reader.fail(f"storage '{_quoted(key)}' holds {numel} elements, expected "
                              f"{st.numel}")
        st.offset = pos + 8
        pos = st.offset + st.nbytes
        if pos > size:
            raise reader.fail(f"storage '{_quoted(key)}' ({st.nbytes} bytes) runs past the end "
                              f"of the file ({size} bytes): truncated")
    return obj


def _read_torch(reader: _Reader, what: str) -> tuple[Any, str]:
    """The top-level object of a torch.save file (zip or legacy) and its storages' byte order."""
    kind, size = _sniff(reader.path, reader)
    if kind == "empty":
        raise reader.fail(f"empty file (not a {what})")
    if kind == "tar":
        raise reader.fail("the tar checkpoint format of torch < 0.4 is not supported")
    if kind == "zip":
        return _read_zip(reader, size)
    try:
        with open(reader.path, "rb") as f:
            magic = reader.unpickle(f, failure=f"not a {what}: neither a zip archive nor a pickle")
            if magic != TORCH_MAGIC:
                raise reader.fail(f"not a {what} (a pickle, but not torch.save's format)")
            return _read_legacy_rest(reader, f, size, persistent=True), "little"
    except OSError as e:
        raise reader.fail(f"cannot read: {e.strerror or e}") from None


# -- tensors ------------------------------------------------------------------------------------
class TorchFile:
    """A torch.save'd state dict (pytorch_model.bin): validated tensor records, read through a
    memory map or with file I/O.

    Duck-types `safetensors.SafetensorsFile` (path, tensors, metadata, raw()), so `Checkpoint`
    reads it like a safetensors file. TensorInfo.start/end give the bytes the tensor's elements
    span inside its storage (for a compressed zip member: offsets into its uncompressed data).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        self._map: np.memmap | None = None
        reader = _Reader(self.path, TENSOR_GLOBALS, TENSOR_GLOBALS_NOTE, CheckpointError)
        obj, order = _read_torch(reader, "PyTorch checkpoint")
        self._order = "<" if order == "little" else ">"
        if not isinstance(obj, dict):
            raise reader.fail(f"holds a {type(obj).__name__}, expected a state dict of tensors")
        self._refs: dict[str, _Tensor] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, t in obj.items():
            if not isinstance(name, str):
                raise reader.fail(f"state dict key {_quoted(repr(name), 60)} is not a string")
            if not isinstance(t, _Tensor):
                raise reader.fail(f"entry '{_quoted(name)}' is a {type(t).__name__}, not a tensor")
            st, itemsize = t.storage, STORAGE[t.storage.code].itemsize
            if t.offset + t.extent > st.numel or t.offset > st.numel:
                raise reader.fail(f"tensor '{_quoted(name)}' (size {list(t.shape)}, stride "
                                  f"{list(t.stride)}, offset {t.offset}) runs past its storage "
                                  f"'{_quoted(st.key)}' of {st.numel} elements")
            self._refs[name] = t
            base = (st.root.offset if st.root else st.offset) or 0
            start = base + (st.start + t.offset) * itemsize
            self.tensors[name] = TensorInfo(name, st.code, t.shape, self.path,
                                            start, start + t.extent * itemsize)

    def _fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def _storage_bytes(self, st: _Storage) -> np.ndarray:
        root = st.root or st
        try:
            if root.packed is not None:
                with zipfile.ZipFile(self.path) as z:
                    buf = np.frombuffer(z.read(root.packed), dtype=np.uint8)
            else:
                if self._map is None:
                    self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
                buf = self._map[root.offset:root.offset + root.nbytes]
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise self._fail(f"cannot read storage '{_quoted(root.key)}': {_first_line(e)}") from None
        if len(buf) != root.nbytes:
            raise self._fail(f"storage '{_quoted(root.key)}' is truncated")
        itemsize = STORAGE[st.code].itemsize
        return buf[st.start * itemsize:(st.start + st.numel) * itemsize]

    def raw(self, name: str, mmap: bool = True, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as stored (BF16 as uint16), or rows [a, b) of its first axis: a read-only
        strided view of the memory-mapped file, or with `mmap=False` a private array holding
        just the bytes those elements span, read with file I/O (mapped pages would count as the
        process's memory). Compressed zip members are always decompressed whole."""
        t = self._refs[name]
        dtype = STORAGE[t.storage.code].newbyteorder(self._order)
        shape, offset = t.shape, t.offset
        if rows is not None:
            shape, offset = (rows[1] - rows[0], *shape[1:]), offset + rows[0] * t.stride[0]
        if math.prod(shape) == 0:
            return np.empty(shape, dtype=dtype)
        strides = tuple(s * dtype.itemsize for s in t.stride)
        root = t.storage.root or t.storage
        if not mmap and root.packed is None:
            span = _Tensor(t.storage, offset, shape, t.stride).extent
            flat = self._pread(self.tensors[name].start + (offset - t.offset) * dtype.itemsize,
                               span * dtype.itemsize, root).view(dtype)
            return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)
        flat = self._storage_bytes(t.storage).view(dtype)
        return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape, strides=strides,
                                               writeable=False)

    def _pread(self, start: int, nbytes: int, root: _Storage) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8)
        try:
            with open(self.path, "rb") as f:
                got = f.seek(start) == start and f.readinto(memoryview(buf))
        except OSError as e:
            raise self._fail(f"cannot read storage '{_quoted(root.key)}': {_first_line(e)}") from None
        if got != nbytes:
            raise self._fail(f"storage '{_quoted(root.key)}' is truncated")
        return buf

    def array(self, name: str) -> np.ndarray:
        """A fresh C-contiguous copy in native byte order; BF16 widened to float32."""
        raw = self.raw(name)
        if self.tensors[name].dtype == "BF16":
            return bf16_to_float32(raw)
        return np.array(raw, dtype=raw.dtype.newbyteorder("="), order="C")


def load_torch_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a torch.save'd state dict as NumPy arrays (bfloat16 widened to float32)."""
    f = TorchFile(path)
    return {name: f.array(name) for name in f.tensors}


# -- vocabularies -------------------------------------------------------------------------------
def _holds_ignored(value: Any, seen: set[int] | None = None) -> bool:
    if isinstance(value, _Ignored):
        return True
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return False
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        return any(_holds_ignored(k, seen) or _holds_ignored(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_ignored(v, seen) for v in value)
    return False


def load_pickled_vocab(path: str | os.PathLike) -> dict[str, Any]:
    """The dict pickled in a Transformer-XL vocab.pkl / vocab.bin (plain pickle, or torch.save in
    either format), e.g. {'idx2sym': [...], 'sym2idx': OrderedDict, 'counter': Counter, ...}.

    Only plain containers, OrderedDict, Counter and the IGNORED_GLOBALS placeholders are built;
    entries that hold a placeholder (HF's pickled Moses tokenizers, regexes, AddedTokens) are
    dropped from the result. Errors are TokenizerError, one line, naming the file.
    """
    path = Path(path)
    reader = _Reader(path, VOCAB_GLOBALS, VOCAB_GLOBALS_NOTE, TokenizerError)
    kind, size = _sniff(path, reader)
    if kind == "empty":
        raise reader.fail("empty file (not a pickled vocabulary)")
    if kind == "tar":
        raise reader.fail("the tar format of torch < 0.4 is not supported")
    if kind == "zip":
        obj, _ = _read_zip(reader, size)
    else:
        try:
            with open(path, "rb") as f:
                obj = reader.unpickle(f, failure="not a pickled vocabulary")
                if _is_int(obj) and obj == TORCH_MAGIC:     # torch.save's legacy format
                    obj = _read_legacy_rest(reader, f, size, persistent=False)
        except OSError as e:
            raise reader.fail(f"cannot read: {e.strerror or e}") from None
    if not isinstance(obj, dict):
        raise reader.fail(f"holds a {type(obj).__name__}, expected a pickled dict")
    return {k: v for k, v in obj.items() if not _holds_ignored(k) and not _holds_ignored(v)}
