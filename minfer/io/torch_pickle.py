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
import mmap
import os
import pickle
import pickletools
import reprlib
import struct
import zipfile
import zlib
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable

import _compat_pickle
import numpy as np

from ..errors import CheckpointError, TokenizerError
from .limits import (MAX_ARRAY_BYTES, MAX_NAME_CHARS, MAX_NESTING, MAX_RANK, MAX_TENSORS,
                     first_line, is_int, quoted)
from .tensors import STORAGE, TensorInfo, bf16_to_float32

TORCH_MAGIC = 0x1950A86A20F9469CFC6C
TORCH_LEGACY_PROTOCOL = 1001
MAX_PICKLE_BYTES = 256 * 1024 * 1024   # a data.pkl or vocab.pkl is read whole; real: < 20 MiB

TENSOR_GLOBALS_NOTE = "only tensors and plain containers are allowed"
VOCAB_GLOBALS_NOTE = "a vocabulary holds only plain containers"


_quoted, _first_line = quoted, first_line
# reprs of values from a file, for messages: bounded in nesting, length and work (a plain repr of
# a deeply nested value recurses, and of a huge one builds a huge string before it is cut)
_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 40, 40


def _repr(value: Any, limit: int = 80) -> str:
    try:
        text = _short.repr(value)
    except Exception:   # an int past Python's 4300-digit conversion limit, a failing __repr__
        text = f"<{type(value).__name__}>"
    return _quoted(text, limit)


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
        self.packed: tuple[zipfile.ZipInfo, int] | None = None  # a deflated zip member instead:
        #                                            its entry and where its compressed bytes start

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


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(is_int(v) and v >= 0 for v in value):
        return tuple(value)
    return None


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> _Tensor:
    shape, strides = _int_tuple(size), _int_tuple(stride)
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError(f"tensor storage is a {type(storage).__name__}")
    if (shape is None or strides is None or len(shape) != len(strides) or len(shape) > MAX_RANK
            or math.prod(max(n, 1) for n in shape) > MAX_ARRAY_BYTES):
        raise pickle.UnpicklingError(f"malformed tensor size {_repr(size)} / stride {_repr(stride)}")
    if not is_int(storage_offset) or storage_offset < 0:
        raise pickle.UnpicklingError(f"malformed storage offset {_repr(storage_offset)}")
    return _Tensor(storage, storage_offset, shape, strides)   # extent checked by TorchFile


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> _Tensor:
    if metadata and any(metadata.values() if isinstance(metadata, dict) else [True]):
        raise pickle.UnpicklingError(f"tensor with lazy negation/conjugation {_repr(metadata)} "
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
                              f"{_repr(pid, 80)} (expected no tensors)")
        return self._persistent(pid)


_PICKLE_FAILURES = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                    AttributeError, OverflowError, MemoryError, RecursionError, struct.error)


# -- nesting -------------------------------------------------------------------------------------
# The C unpickler builds nested objects without recursing, but hashing a nested tuple (a dict key,
# a set member) recurses in C with no depth check: a 1 MB pickle of 10**6 TUPLE1 opcodes used as
# a dict key kills the interpreter with a segmentation fault (~64 bytes of C stack per level).
# Only tuples matter there (lists, dicts and sets are unhashable and stop the hash; a frozenset
# hashes its stored element hashes), and a tuple is immutable, so its depth is known when it is
# built: `_scan_pickle` walks the opcodes, tracks each stack and memo slot's tuple depth and
# refuses one past MAX_NESTING before the unpickler runs; it also refuses a length-prefixed
# argument longer than the file (the unpickler allocates bytes arguments before reading them).
# The walk costs ~0.3 us per opcode (~0.5 s for Transformer-XL's 267k-word vocabulary), so a
# pickle held in memory is first bounded for free: every tuple level needs a TUPLE1/2/3 opcode
# or a MARK, so a pickle with at most _TUPLE_SAFE such bytes (anywhere, payloads included)
# cannot nest tuples deeper than that, which hashes safely. Deeply nested lists and dicts are
# harmless to load; what we return is checked (state dicts hold only tensors; vocabularies:
# `_vocab_entries`).
_TUPLE_BYTES = (b"(", b"\x85", b"\x86", b"\x87")
_TUPLE_SAFE = 4096   # levels: ~256 KiB of C stack, less than any thread has

# what an opcode does to the stack (the walk tracks tuple depths only; other values are 0)
(_COUNTED, _FIXED, _PUT, _MEMOIZE, _GET, _LINES, _MARK, _TUPLE_FROM_MARK, _BUILD_FROM_MARK,
 _POP_TO_MARK, _POP, _REPLACE, _TUPLE_N, _EMPTY_TUPLE, _DUP, _NOOP, _STOP) = range(17)


def _opcode_table() -> list[tuple[int, int, int]]:
    """opcode byte -> (effect, argument bytes (negative: a signed length prefix), stack items
    taken), from pickletools' table of every protocol's opcodes. PUT/GET/GLOBAL & co. spelled as
    text lines have effect _LINES with their line count; unknown bytes are None."""
    counted = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: -4,
               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    effects = {"BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE,
               "BINGET": _GET, "LONG_BINGET": _GET, "MARK": _MARK,
               "TUPLE": _TUPLE_FROM_MARK, "FROZENSET": _TUPLE_FROM_MARK,
               **dict.fromkeys(("LIST", "DICT", "OBJ"), _BUILD_FROM_MARK),
               **dict.fromkeys(("APPENDS", "SETITEMS", "ADDITEMS", "POP_MARK"), _POP_TO_MARK),
               **dict.fromkeys(("APPEND", "BUILD", "POP", "SETITEM"), _POP),
               **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX", "STACK_GLOBAL", "BINPERSID"),
                               _REPLACE),
               **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), _TUPLE_N),
               "EMPTY_TUPLE": _EMPTY_TUPLE, "DUP": _DUP, "STOP": _STOP,
               **dict.fromkeys(("PROTO", "FRAME", "READONLY_BUFFER"), _NOOP)}
    taken = {"SETITEM": 2, "REDUCE": 2, "NEWOBJ": 2, "STACK_GLOBAL": 2, "NEWOBJ_EX": 3,
             "TUPLE2": 2, "TUPLE3": 3}
    table: list = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        if op.name in ("GLOBAL", "INST", "PUT", "GET") or n == pickletools.UP_TO_NEWLINE:
            entry = (_LINES, 2 if op.name in ("GLOBAL", "INST") else 1, 0)
        elif n in counted:
            entry = (_COUNTED, counted[n], 0)
        else:
            entry = (effects.get(op.name, _FIXED), n, taken.get(op.name, 1))
        table[op.code.encode("latin-1")[0]] = entry
    return table


_OPCODES = _opcode_table()


class _Malformed(Exception):
    """The walk met a pickle the unpickler refuses too: the unpickler runs and says why."""


def _scan_pickle(buf, pos: int, limit: int) -> int:
    """Walk the pickle at buf[pos:] (bytes or a memory map) to its STOP; return the offset after
    it. Raises ValueError for tuples nested deeper than `limit` or an argument longer than the
    buffer, _Malformed for what the unpickler refuses anyway. Branches in order of frequency."""
    stack: list[int] = []           # tuple depth of each stack slot; -1 for a MARK
    memo: dict[int, int] = {}
    size, number, push = len(buf), int.from_bytes, stack.append
    try:
        while True:
            at = pos
            effect, n, taken = _OPCODES[buf[pos]]     # TypeError for an unknown opcode
            pos += 1
            if effect == _COUNTED:                    # strings, bytes, long integers
                length = buf[pos] if n == 1 else number(buf[pos:pos + abs(n)], "little",
                                                        signed=n < 0)
                pos += abs(n) + length
                if length < 0:
                    raise _Malformed
                if pos > size:
                    raise ValueError(f"an argument at byte {at} claims {length} bytes, more "
                                     "than the file holds")
                push(0)
            elif effect == _FIXED:                    # numbers, None, booleans, EXT codes
                pos += n
                push(0)
            elif effect == _PUT:
                memo[buf[pos] if n == 1 else number(buf[pos:pos + n], "little")] = stack[-1]
                pos += n
            elif effect == _MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif effect == _GET:
                push(memo.get(buf[pos] if n == 1 else number(buf[pos:pos + n], "little"), 0))
                pos += n
            elif effect == _MARK:
                push(-1)
            elif effect == _POP_TO_MARK or effect == _BUILD_FROM_MARK or effect == _TUPLE_FROM_MARK:
                mark = len(stack) - 1
                while mark >= 0 and stack[mark] != -1:
                    mark -= 1
                if mark < 0:
                    raise _Malformed
                depth = 1 + max(stack[mark + 1:], default=0)
                del stack[mark:]
                if effect == _BUILD_FROM_MARK:
                    push(0)
                elif effect == _TUPLE_FROM_MARK:
                    if depth > limit:
                        raise ValueError(f"tuples nested deeper than {limit} levels (at byte {at})")
                    push(depth)
            elif effect == _POP or effect == _REPLACE or effect == _TUPLE_N:
                items = stack[-taken:]
                if len(items) < taken or -1 in items:
                    raise _Malformed
                del stack[-taken:]
                if effect == _REPLACE:
                    push(0)
                elif effect == _TUPLE_N:
                    if 1 + max(items) > limit:
                        raise ValueError(f"tuples nested deeper than {limit} levels (at byte {at})")
                    push(1 + max(items))
            elif effect == _LINES:                    # protocol 0: text arguments
                for _ in range(n):
                    end = buf.find(b"\n", pos)
                    if end < 0:
                        raise _Malformed
                    arg, pos = buf[pos:end], end + 1
                if buf[at] == ord("p"):                                    # PUT
                    memo[int(arg) if arg.isdigit() else -1] = stack[-1]
                elif buf[at] == ord("g"):                                  # GET
                    push(memo.get(int(arg) if arg.isdigit() else -1, 0))
                elif buf[at] == ord("i"):                                  # INST
                    mark = len(stack) - 1
                    while mark >= 0 and stack[mark] != -1:
                        mark -= 1
                    if mark < 0:
                        raise _Malformed
                    del stack[mark:]
                    push(0)
                else:
                    push(0)
            elif effect == _EMPTY_TUPLE:
                push(1)
            elif effect == _DUP:
                push(stack[-1])
            elif effect == _STOP:
                return pos
            else:                                     # PROTO, FRAME (frames are transparent)
                pos += n
    except (IndexError, TypeError):                   # ran off the end, an empty stack, a bad op
        raise _Malformed from None


class _Reader:
    """One file being read: where errors go, what its pickles may build."""

    def __init__(self, path: Path, allowed: dict[str, Any], note: str, error: type):
        self.path, self.allowed, self.note, self.error = path, allowed, note, error
        self.storages: dict[str, _Storage] = {}

    def fail(self, message: str) -> Exception:
        return self.error(f"{self.path}: {message}")

    def unpickle(self, buf, pos: int = 0, persistent: Callable[[Any], Any] | None = None,
                 failure: str = "not a valid pickle") -> tuple[Any, int]:
        """The object pickled at buf[pos:] (bytes, or a memory map of the file) and the offset
        after it; its tuple nesting is bounded first (see `_scan_pickle`)."""
        try:
            if not isinstance(buf, bytes) or sum(buf.count(b, pos) for b in _TUPLE_BYTES) > _TUPLE_SAFE:
                _scan_pickle(buf, pos, MAX_NESTING)
        except ValueError as e:
            raise self.fail(f"{failure} ({e})") from None
        except _Malformed:
            pass                                     # the unpickler says what is wrong
        stream = io.BytesIO(buf) if isinstance(buf, bytes) else buf   # BytesIO shares the bytes
        stream.seek(pos)
        try:
            obj = _Unpickler(stream, self.path, self.allowed, self.note, self.error,
                             persistent).load()
        except _PICKLE_FAILURES as e:
            raise self.fail(f"{failure} ({_first_line(e)})") from None
        return obj, stream.tell()

    def storage(self, stype: Any, key: Any, numel: Any) -> _Storage:
        """The storage a persistent id names (the same object for the same key)."""
        if not isinstance(stype, _StorageType):
            raise self.fail(f"storage type is a {type(stype).__name__}, not a torch storage class")
        if not isinstance(key, str) or not is_int(numel) or numel < 0:
            raise self.fail(f"malformed storage reference (key {_repr(key, 40)}, "
                            f"numel {_repr(numel, 40)})")
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
def _zip_entries(path: Path, size: int) -> int | None:
    """The member count a zip's end record declares (zip64 too), read before zipfile builds an
    object (~500 bytes) per member; None if there is no readable record (zipfile then says why)."""
    with open(path, "rb") as f:
        f.seek(max(0, size - 65557))                  # the record and a comment of up to 64 KiB
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) < at + 22:
            return None
        count = struct.unpack("<H", tail[at + 10:at + 12])[0]
        if count == 0xFFFF and at >= 20 and tail[at - 20:at - 16] == b"PK\x06\x07":
            f.seek(struct.unpack("<Q", tail[at - 12:at - 4])[0])
            record = f.read(40)
            if len(record) == 40 and record[:4] == b"PK\x06\x06":
                count = struct.unpack("<Q", record[32:40])[0]
        return count


def _read_zip(reader: _Reader, size: int) -> tuple[Any, str]:
    """The object of a torch zip file, its storages located; and its byte order."""
    try:
        count = _zip_entries(reader.path, size)
        if count is not None and count > MAX_TENSORS + 64:    # storages, data.pkl, version...
            raise reader.fail(f"zip archive of {count} members, more than a checkpoint of at "
                              f"most {MAX_TENSORS} tensors has")
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
                with z.open(prefix + "byteorder") as member:   # 16 bytes at most, whatever it claims
                    order = member.read(16).decode("ascii", "replace").strip()
                if order not in ("little", "big"):
                    raise reader.fail(f"unknown byte order {_quoted(order, 20)!r}")
            if infos[pickles[0]].file_size > MAX_PICKLE_BYTES:
                raise reader.fail(f"{pickles[0]} is larger than {MAX_PICKLE_BYTES} bytes")
            data = z.read(pickles[0])

            def persistent(pid: Any) -> _Storage:
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise reader.fail(f"unexpected persistent id {_repr(pid, 80)}")
                st = reader.storage(pid[1], pid[2], pid[4])
                if st.offset is None and st.packed is None:
                    _locate_member(reader, z, infos, prefix, st, size)
                return st

            obj, _ = reader.unpickle(data, 0, persistent)
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
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 1:
        raise reader.fail(f"storage file {_quoted(name)} is encrypted or compressed with method "
                          f"{info.compress_type} (only stored and deflated members are read)")
    packed = info.compress_type == zipfile.ZIP_DEFLATED
    stored = info.compress_size if packed else st.nbytes
    # deflate expands at most ~1032:1: a member declaring more than that is corrupt, and its
    # declared size is what a read of it is held to (`_Inflater`)
    if packed and info.file_size > 1032 * info.compress_size + 1024:
        raise reader.fail(f"storage file {_quoted(name)} claims {info.file_size} bytes from "
                          f"{info.compress_size} compressed: corrupt")
    z.fp.seek(info.header_offset)
    local = z.fp.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise reader.fail(f"storage file {_quoted(name)}: bad local zip header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    offset = info.header_offset + 30 + name_len + extra_len
    if offset + stored > size:
        raise reader.fail(f"storage file {_quoted(name)} runs past the end of the file: truncated")
    if packed:
        st.packed = (info, offset)
    else:
        st.offset = offset


# -- legacy (pre-1.6) files ---------------------------------------------------------------------
def _legacy_persistent(reader: _Reader) -> Callable[[Any], _Storage]:
    def persistent(pid: Any) -> _Storage:
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            raise reader.fail("refuses a pickled torch module (only tensors and plain containers "
                              "are allowed)")
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise reader.fail(f"unexpected persistent id {_repr(pid, 80)}")
        _, stype, key, _location, numel, view = pid
        root = reader.storage(stype, key, numel)
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and is_int(view[1]) and is_int(view[2]) and view[1] >= 0 and view[2] >= 0
                and view[1] + view[2] <= root.numel):
            raise reader.fail(f"malformed storage view {_repr(view, 80)}")
        known = reader.storages.get(view[0])
        if known is None:
            known = reader.storages[view[0]] = _Storage(view[0], root.code, view[2], root, view[1])
        return known
    return persistent


def _read_legacy_rest(reader: _Reader, buf, pos: int, persistent: bool) -> Any:
    """After the magic number (buf[pos:]: bytes or a memory map of the file): protocol, sys info,
    the object and (for tensors) the storages' locations."""
    size = len(buf)
    proto, pos = reader.unpickle(buf, pos)
    if proto != TORCH_LEGACY_PROTOCOL:
        raise reader.fail(f"unsupported torch.save protocol version {_repr(proto, 40)}")
    _, pos = reader.unpickle(buf, pos)                     # sys info: sizes of C types, unused
    obj, pos = reader.unpickle(buf, pos, _legacy_persistent(reader) if persistent else None)
    keys, pos = reader.unpickle(buf, pos)
    if (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)
            or len(set(keys)) != len(keys)):
        raise reader.fail("malformed storage key list")
    roots = {k: s for k, s in reader.storages.items() if s.root is None}
    missing = sorted(set(roots) - set(keys))
    if missing:
        raise reader.fail(f"storage '{_quoted(missing[0])}' has no data in the file")
    for key in keys:
        st = roots.get(key)
        if st is None:
            raise reader.fail(f"data for unknown storage '{_quoted(key)}'")
        head = buf[pos:pos + 8]
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
    try:   # pickles, then the raw storages: mapped, so only the pickles' pages are read
        with open(reader.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic, pos = reader.unpickle(buf, 0, failure=f"not a {what}: neither a zip archive "
                                                         "nor a pickle")
            if magic != TORCH_MAGIC:
                raise reader.fail(f"not a {what} (a pickle, but not torch.save's format)")
            return _read_legacy_rest(reader, buf, pos, persistent=True), "little"
    except (OSError, ValueError) as e:
        raise reader.fail(f"cannot read: {_first_line(e)}") from None


# -- deflated zip members -----------------------------------------------------------------------
class _Inflater:
    """One deflated storage member decompressed as a stream: the compressed bytes are read in
    CHUNK pieces, the output skipped (in CHUNK pieces) up to where a read starts, then written
    straight into the read's array. Memory: the array plus two chunks, whatever the member
    claims. The member is held to its declared size: a stream that ends early, or that still
    produces bytes past the end (a zip bomb declaring a small size), is an error as soon as a
    read reaches there; a read of the whole member also checks its CRC."""
    CHUNK = 1 << 20

    def __init__(self, path: Path, root: _Storage):
        info, self._at = root.packed
        self.key, self.size, self._crc_want = root.key, info.file_size, info.CRC
        self._left = info.compress_size          # compressed bytes not yet read
        self._path = path
        self._stream = zlib.decompressobj(-zlib.MAX_WBITS)
        self._pending = b""                      # compressed input the stream has not taken
        self._crc = 0
        self.produced = 0                        # uncompressed bytes produced so far

    def _next(self, f, most: int) -> bytes:
        """Up to `most` (> 0) more uncompressed bytes; b"" only at the end of the stream."""
        while True:
            if not self._pending and self._left > 0:
                f.seek(self._at)
                self._pending = f.read(min(self.CHUNK, self._left))
                if not self._pending:
                    raise self._error("is truncated (the file ends inside it)")
                self._at += len(self._pending)
                self._left -= len(self._pending)
            data = self._stream.decompress(self._pending, most)
            self._pending = self._stream.unconsumed_tail
            if data or self._stream.eof or (not self._pending and self._left == 0):
                self._crc = zlib.crc32(data, self._crc)
                self.produced += len(data)
                return data

    def _error(self, what: str) -> Exception:
        return CheckpointError(f"{self._path}: deflated storage '{_quoted(self.key)}' {what}")

    def read(self, start: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        view = memoryview(out)
        filled = 0
        with open(self._path, "rb") as f:
            while filled < nbytes:
                skipping = self.produced < start
                data = self._next(f, min(self.CHUNK, start - self.produced if skipping
                                         else nbytes - filled))
                if not data:
                    raise self._error(f"ends after {self.produced} bytes, declared "
                                      f"{self.size}: truncated or corrupt")
                if not skipping:
                    view[filled:filled + len(data)] = data
                    filled += len(data)
            if self.produced == self.size:      # at the declared end: the stream must end too
                if self._next(f, 1):
                    raise self._error(f"inflates past its declared size of {self.size} bytes "
                                      "(a zip bomb?)")
                if not self._stream.eof:
                    raise self._error("is truncated (its deflate stream does not end)")
                if self._crc != self._crc_want:           # every byte passed through _next
                    raise self._error("fails its CRC check: corrupt")
        return out


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
        self._inflaters: dict[str, _Inflater] = {}   # deflated members being read, by storage
        reader = _Reader(self.path, TENSOR_GLOBALS, TENSOR_GLOBALS_NOTE, CheckpointError)
        obj, order = _read_torch(reader, "PyTorch checkpoint")
        self._order = "<" if order == "little" else ">"
        if not isinstance(obj, dict):
            raise reader.fail(f"holds a {type(obj).__name__}, expected a state dict of tensors")
        self._refs: dict[str, _Tensor] = {}
        self.tensors: dict[str, TensorInfo] = {}
        if len(obj) > MAX_TENSORS:
            raise reader.fail(f"holds {len(obj)} entries, more than the {MAX_TENSORS} tensors a "
                              "file may hold")
        for name, t in obj.items():
            if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
                raise reader.fail(f"state dict key {_repr(name, 60)} is not a tensor name (a "
                                  f"string of at most {MAX_NAME_CHARS} characters)")
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
        """A stored (uncompressed) storage's bytes: a view of the memory-mapped file."""
        root = st.root or st
        try:
            if self._map is None:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            buf = self._map[root.offset:root.offset + root.nbytes]
        except (OSError, ValueError) as e:
            raise self._fail(f"cannot read storage '{_quoted(root.key)}': {_first_line(e)}") from None
        if len(buf) != root.nbytes:
            raise self._fail(f"storage '{_quoted(root.key)}' is truncated")
        itemsize = STORAGE[st.code].itemsize
        return buf[st.start * itemsize:(st.start + st.numel) * itemsize]

    def raw(self, name: str, mmap: bool = True, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as stored (BF16 as uint16), or rows [a, b) of its first axis: a read-only
        strided view of the memory-mapped file, or with `mmap=False` a private array holding
        just the bytes those elements span, read with file I/O (mapped pages would count as the
        process's memory). A deflated zip member is always read the second way, decompressed
        as a stream up to the last byte needed (`_Inflater`)."""
        t = self._refs[name]
        dtype = STORAGE[t.storage.code].newbyteorder(self._order)
        shape, offset = t.shape, t.offset
        if rows is not None:
            shape, offset = (rows[1] - rows[0], *shape[1:]), offset + rows[0] * t.stride[0]
        if math.prod(shape) == 0:
            return np.empty(shape, dtype=dtype)
        strides = tuple(s * dtype.itemsize for s in t.stride)
        root = t.storage.root or t.storage
        if not mmap or root.packed is not None:
            span = _Tensor(t.storage, offset, shape, t.stride).extent * dtype.itemsize
            first = self.tensors[name].start + (offset - t.offset) * dtype.itemsize
            flat = (self._inflate(root, first, span) if root.packed is not None
                    else self._pread(first, span, root)).view(dtype)
            return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)
        flat = self._storage_bytes(t.storage).view(dtype)
        return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape, strides=strides,
                                               writeable=False)

    def _inflate(self, root: _Storage, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of a deflated storage, into a fresh array. A read that
        starts at or after where the previous one of the same member stopped continues its
        stream (a large tensor read by rows decompresses once); any other restarts it."""
        inflater = self._inflaters.get(root.key)
        if inflater is None or inflater.produced > start:
            inflater = self._inflaters[root.key] = _Inflater(self.path, root)
        try:
            return inflater.read(start, nbytes)
        except OSError as e:
            raise self._fail(f"cannot read storage '{_quoted(root.key)}': {_first_line(e)}") from None
        except zlib.error as e:
            raise self._fail(f"storage '{_quoted(root.key)}' is corrupt ({_first_line(e)})") from None

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
_CONTAINERS = (dict, list, tuple, set, frozenset)
_LEAVES = frozenset((str, int, float, bool, bytes, type(None)))


def _vocab_entries(reader: _Reader, obj: dict) -> dict[str, Any]:
    """The entries of a vocabulary dict that hold no placeholder (`_Ignored`), after checking
    that none nests deeper than MAX_NESTING (the tokenizer walks what we return). One iterative
    depth-first pass over the containers, strings and numbers skipped in bulk: it stops as soon
    as a path runs past the limit; a container reached again adds its known depth to the path,
    and one still open (a cycle) counts as a leaf."""
    done: dict[int, tuple[int, bool]] = {}   # id -> (levels from it down, holds a placeholder)

    def holds_placeholder(root: Any, key: Any) -> bool:
        if not isinstance(root, _CONTAINERS):
            return isinstance(root, _Ignored)
        work: list[tuple[Any, int, list | None]] = [(root, 1, None)]
        while work:
            node, level, children = work.pop()
            if children is None:                                 # first visit
                depth = done[id(node)][0] if id(node) in done else 1
                if level + depth - 1 > MAX_NESTING:
                    name = _quoted(key) if isinstance(key, str) else _repr(key)
                    raise reader.fail(f"entry '{name}' nests deeper than "
                                      f"{MAX_NESTING} levels")
                if id(node) in done:
                    continue
                items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
                children = ([] if _LEAVES.issuperset(map(type, items))   # C speed: the usual case
                            else [x for x in items if isinstance(x, (_CONTAINERS, _Ignored))])
                done[id(node)] = (0, False)                      # open
                work.append((node, level, children))
                work.extend((c, level + 1, None) for c in children if not isinstance(c, _Ignored))
            else:                                                # after all its children
                nested = [done[id(c)] for c in children if not isinstance(c, _Ignored)]
                done[id(node)] = (1 + max((d for d, _ in nested), default=0),
                                  len(nested) < len(children) or any(h for _, h in nested))
        return done[id(root)][1]

    return {k: v for k, v in obj.items()
            if not holds_placeholder(k, k) and not holds_placeholder(v, k)}


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
        if size > MAX_PICKLE_BYTES:
            raise reader.fail(f"{size} bytes is larger than the {MAX_PICKLE_BYTES}-byte limit "
                              "for a pickled vocabulary")
        try:
            with open(path, "rb") as f:
                data = f.read(size)
        except OSError as e:
            raise reader.fail(f"cannot read: {e.strerror or e}") from None
        if len(data) != size:
            raise reader.fail(f"changed size while being read ({len(data)} of {size} bytes)")
        obj, pos = reader.unpickle(data, 0, failure="not a pickled vocabulary")
        if is_int(obj) and obj == TORCH_MAGIC:     # torch.save's legacy format
            obj = _read_legacy_rest(reader, data, pos, persistent=False)
    if not isinstance(obj, dict):
        raise reader.fail(f"holds a {type(obj).__name__}, expected a pickled dict")
    return _vocab_entries(reader, obj)
