"""Generated bad files, by family: every one is a one-line minfer error naming the file (and the
tensor or key), raised quickly and without allocating in proportion to what the file claims.

Families: nesting (JSON readers, pickles), header claims (safetensors, sharded index), deflated
zip members (bombs, truncation, CRC, methods), bad values (NaN/inf, wrong byte order).
"""
from __future__ import annotations

import binascii
import json
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from test_io_torch_pickle import dumps, state_dict, storage, tensor, write_legacy, write_zip

from minfer.errors import CheckpointError, TokenizerError
from minfer.io.checkpoint import Checkpoint
from minfer.io.limits import MAX_NESTING, MAX_TENSORS, json_nesting, read_json_text
from minfer.io.safetensors import SafetensorsFile
from minfer.io.torch_pickle import TorchFile, load_pickled_vocab

MiB = 1 << 20


def one_line(err, *needles) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for needle in needles:
        assert str(needle) in text, text
    assert err.value.__cause__ is None and not isinstance(err.value, RecursionError)
    return text


class Bounded:
    """Asserts the block ran under `seconds` and, unless `peak` is None, allocated under `peak`
    bytes (tracemalloc sees Python objects and NumPy's buffers; it also slows the teardown of
    deeply nested objects a hundredfold, so the nesting tests time only)."""

    def __init__(self, seconds: float = 5.0, peak: int | None = 16 * MiB):
        self.seconds, self.peak = seconds, peak

    def __enter__(self):
        if self.peak is not None:
            tracemalloc.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        elapsed = time.perf_counter() - self.t0
        if self.peak is not None:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < self.peak, f"allocated {peak} bytes at the peak"
        assert elapsed < self.seconds, f"took {elapsed:.2f} s"
        return False


# -- nesting: JSON ---------------------------------------------------------------------------------
def nested_json(kind: str, depth: int) -> bytes:
    """A JSON text nested `depth` deep, with bracket-looking strings as decoys."""
    if kind == "arrays":
        return b"[" * depth + b"]" * depth
    if kind == "objects":
        return b'{"a":' * depth + b"1" + b"}" * depth
    if kind == "mixed":
        return b'[{"k":' * (depth // 2) + b'"[[{"' + b"}]" * (depth // 2)
    if kind == "unclosed":
        return b'{"x": "]]]]", "y": ' + b"[" * depth
    raise ValueError(kind)


JSON_KINDS = ["arrays", "objects", "mixed", "unclosed"]
DEPTHS = [MAX_NESTING + 2, 10 ** 4, 10 ** 6]


def test_bracket_scan_ignores_strings_and_counts_depth():
    assert json_nesting(b'{"a": "[[[[[[", "b": [[1], {"c": "}}}"}]}') == 3
    assert json_nesting(b'["\\"[[[[", [[]]]') == 3
    for depth in (1, 7, MAX_NESTING):
        assert json_nesting(nested_json("arrays", depth)) == depth


@pytest.mark.parametrize("kind", JSON_KINDS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_json_everywhere_is_refused_before_parsing(tmp_path, kind, depth):
    doc = nested_json(kind, depth)
    # config.json and a sharded index (Checkpoint), a safetensors header, any JSON (tokenizer)
    (tmp_path / "config.json").write_bytes(doc)
    with Bounded(), pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path)
    one_line(err, tmp_path / "config.json", f"nested deeper than {MAX_NESTING}")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_bytes(doc)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path)
    one_line(err, "model.safetensors.index.json", "nested deeper")
    header = tmp_path / "x.safetensors"
    header.write_bytes(struct.pack("<Q", len(doc)) + doc)
    with Bounded(), pytest.raises(CheckpointError) as err:
        SafetensorsFile(header)
    text = one_line(err, header)
    assert "nested deeper" in text or "padded" in text, text    # a long one fails on its size
    with pytest.raises(TokenizerError) as err:      # what tokenizer.json & co. should go through
        read_json_text(tmp_path / "model.safetensors.index.json", TokenizerError)
    one_line(err, "index.json", "nested deeper")


def test_json_within_the_limit_and_other_failures(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b'{"deep": ' + nested_json("arrays", MAX_NESTING - 1) + b"}")
    value, text = read_json_text(path, TokenizerError)
    assert isinstance(value, dict) and text.startswith('{"deep"')
    for raw, needle in [(b"[" + b"9" * 5000 + b"]", "not valid JSON"),      # int digit limit
                        (b"\xff\xfe{}", "not valid JSON"), (b"{", "not valid JSON")]:
        path.write_bytes(raw)
        with pytest.raises(TokenizerError) as err:
            read_json_text(path, TokenizerError)
        one_line(err, path, needle)
    with pytest.raises(TokenizerError) as err:
        read_json_text(path, TokenizerError, max_bytes=0)
    one_line(err, path, "limit")


# -- nesting: pickles --------------------------------------------------------------------------------
def deep_pickle(kind: str, depth: int) -> bytes:
    """Opcodes building one value nested `depth` deep (protocol 2 framing, no STOP)."""
    if kind == "tuple1":                     # () wrapped by TUPLE1: one byte a level
        return b")" + b"\x85" * depth
    if kind == "tuple-mark":
        return b"(" * depth + b")" + b"t" * depth
    if kind == "tuple2":                     # (x, None) pairs, each through the memo
        return b")q\x00" + b"0h\x00N\x86q\x00" * depth
    if kind == "list-append":
        return b"]" * depth + b"a" * (depth - 1)
    if kind == "list-mark":
        return b"(" * depth + b"]" + b"l" * depth
    if kind == "dict":
        return b'}X\x01\x00\x00\x00k' * depth + b"}" + b"s" * depth
    if kind == "memo-lists":                 # each list appended into the previous via GET
        body = [b"]q\x00"] + [(b"h\x00" if i == 1 else b"j" + struct.pack("<I", i - 1))
                               + b"]r" + struct.pack("<I", i) + b"a0" for i in range(1, depth)]
        return b"".join(body) + b"0h\x00"
    raise ValueError(kind)


PICKLE_KINDS = ["tuple1", "tuple-mark", "tuple2", "list-append", "list-mark", "dict", "memo-lists"]


def vocab_with(value: bytes, as_key: bool) -> bytes:
    """{'idx2sym': ['a'], <value>: 1} or {'x': <value>}, protocol 2."""
    entry = value + b"K\x01s" if as_key else b"X\x01\x00\x00\x00x" + value + b"s"
    return b"\x80\x02}X\x07\x00\x00\x00idx2sym](X\x01\x00\x00\x00aes" + entry + b"."


@pytest.mark.parametrize("kind", PICKLE_KINDS)
@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 10 ** 5])
def test_deep_values_in_pickles_are_one_line_errors(tmp_path, kind, depth):
    value = deep_pickle(kind, depth)
    vocab = tmp_path / "vocab.pkl"
    vocab.write_bytes(vocab_with(value, as_key=False))
    with Bounded(peak=None), pytest.raises(TokenizerError) as err:
        load_pickled_vocab(vocab)
    one_line(err, vocab, "nest")
    # in a checkpoint (the zip's data.pkl, a legacy file's object): as an entry, as a key
    for data in (b"\x80\x02}X\x01\x00\x00\x00w" + value + b"s.", b"\x80\x02}" + value + b"K\x01s."):
        for path in (write_zip(tmp_path / "z.bin", None, {}, data_pkl=data),
                     write_legacy(tmp_path / "l.bin", None, {}, main=data)):
            with Bounded(peak=None), pytest.raises(CheckpointError) as err:
                TorchFile(path)
            one_line(err, path)


# The crash family: a deep tuple hashed as a dict key or set member recursed in C and killed the
# interpreter (segmentation fault) at ~10^5 levels. Run in a child so a regression fails the test
# instead of killing pytest.
CRASH_SCRIPT = r"""
import sys
from pathlib import Path
from minfer.errors import MinferError
from minfer.io.torch_pickle import TorchFile, load_pickled_vocab
n = 10 ** 6
chains = {"tuple1": b")" + b"\x85" * n, "tuple2": b")q\x00" + b"0h\x00N\x86q\x00" * (n // 6),
          "tuple-mark": b"(" * n + b")" + b"t" * n}
tmp = Path(sys.argv[1])
for name, chain in chains.items():
    for holder, data in {"dict key": b"\x80\x02}" + chain + b"Ns.",
                         "set": b"\x80\x04(" + chain + b"\x91.",
                         "data.pkl key": b"\x80\x02}" + chain + b"Ns."}.items():
        path = tmp / "crash.pkl"
        if holder == "data.pkl key":
            import zipfile
            path = tmp / "crash.bin"
            with zipfile.ZipFile(path, "w") as z:
                z.writestr("archive/data.pkl", data)
        else:
            path.write_bytes(data)
        try:
            (TorchFile if holder == "data.pkl key" else load_pickled_vocab)(path)
            print(name, holder, "LOADED")
        except MinferError as e:
            print(name, holder, "|", str(e).replace(chr(10), " "))
"""


def test_deep_tuples_that_would_be_hashed_never_crash(tmp_path):
    run = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"crashed ({run.returncode}): {run.stderr[-2000:]}"
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 9, run.stdout
    for line in lines:
        assert "tuples nested deeper than" in line, line


def test_legit_pickles_with_many_tuple_bytes_still_load(tmp_path):
    # payload bytes that look like tuple opcodes force the walk; the walk must not misfire
    vocab = {"idx2sym": [f"w{i}(\x85" for i in range(5000)], "pairs": [(i, (i, str(i))) for i in range(3000)],
             "counter": {f"w{i}": i * 40 for i in range(5000)}}
    import pickle
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / "vocab.pkl"
        path.write_bytes(pickle.dumps(vocab, protocol=protocol))
        assert load_pickled_vocab(path) == vocab


# -- header claims ---------------------------------------------------------------------------------
def raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def entries(n: int, data_per: int = 0) -> bytes:
    """A header of n F32 entries of one element (or empty) packed back to back."""
    if data_per:
        parts = (f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n))
    else:
        parts = (f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(n))
    return ("{" + ",".join(parts) + "}").encode()


@pytest.mark.parametrize("case", ["too many tensors", "empty flood", "padded header",
                                  "metadata not strings", "long name", "rank 33", "huge dims",
                                  "huge empty", "bool dim", "float offsets", "name newline"])
def test_header_claims_checked_against_the_file(tmp_path, case):
    path = tmp_path / "model.safetensors"
    needle = {"too many tensors": f"more than the {MAX_TENSORS}",
              "empty flood": "data section holds only", "padded header": "padded",
              "metadata not strings": "__metadata__", "long name": "name of",
              "rank 33": "malformed shape", "huge dims": "too large for an array",
              "huge empty": "too large for an array", "bool dim": "malformed shape",
              "float offsets": "malformed data_offsets", "name newline": "'a\\nb'"}[case]
    if case == "too many tensors":
        raw_safetensors(path, entries(MAX_TENSORS + 1, data_per=1), bytes(MAX_TENSORS + 1))
    elif case == "empty flood":
        raw_safetensors(path, entries(5000))
    elif case == "padded header":
        raw_safetensors(path, b"{}" + b" " * (8 * MiB))
    else:
        entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        name = "w"
        meta = None
        if case == "metadata not strings":
            meta = {"a": {"b": 1}}
        elif case == "long name":
            name = "n" * 5000
        elif case == "rank 33":
            entry["shape"] = [1] * 33
        elif case == "huge dims":
            entry["shape"] = [2 ** 40, 2 ** 40]
        elif case == "huge empty":
            entry = {"dtype": "F32", "shape": [0, 10 ** 30], "data_offsets": [0, 0]}
        elif case == "bool dim":
            entry["shape"] = [True]
        elif case == "float offsets":
            entry["data_offsets"] = [0.0, 4.0]
        elif case == "name newline":
            name, entry["dtype"] = "a\nb", "Q7"
        header = {name: entry, **({"__metadata__": meta} if meta else {})}
        raw_safetensors(path, json.dumps(header).encode(), bytes(4))
    with Bounded(peak=48 * MiB), pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    one_line(err, path, needle)


def test_index_claims(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    index = tmp_path / "model.safetensors.index.json"
    bad = [({f"t{i}": "s.safetensors" for i in range(MAX_TENSORS + 1)}, "more than the"),
           ({"a": "config.json"}, "not a file name inside"),
           ({"a": "x" * 300 + ".safetensors"}, "not a file name inside"),
           ({"a": ["s.safetensors"]}, "not a file name inside"),
           ({"n" * 5000: "s.safetensors"}, "of 5000 characters"),
           ({f"t{i}": f"s{i}.safetensors" for i in range(1000)}, "s0.safetensors is missing")]
    for weight_map, needle in bad:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with Bounded(peak=256 * MiB), pytest.raises(CheckpointError) as err:
            Checkpoint(tmp_path)
        one_line(err, index, needle)


# -- deflated zip members ----------------------------------------------------------------------------
def deflate_zeros(total: int, chunk: int = MiB) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    zero = bytes(chunk)
    return b"".join([c.compress(zero) for _ in range(total // chunk)] + [c.flush()])


def raw_zip(path: Path, members: list[tuple[str, int, bytes, int, int]]) -> Path:
    """A zip written byte by byte: (name, method, payload as stored, declared size, crc), so the
    declared sizes and CRCs can lie."""
    out, central = bytearray(), bytearray()
    for name, method, payload, size, crc in members:
        n, offset = name.encode(), len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, crc,
                           len(payload), size, len(n), 0) + n + payload
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc,
                               len(payload), size, len(n), 0, 0, 0, 0, 0, offset) + n
    out += central + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members),
                                 len(central), len(out), 0)
    path.write_bytes(bytes(out))
    return path


def torch_zip(path: Path, numel: int, payload: bytes, declared: int, crc: int, method: int = 8,
              shape=(16, 16)) -> Path:
    pkl = dumps(state_dict({"w": tensor(storage("0", "FloatStorage", numel), 0, shape,
                                        (shape[1], 1))}))
    return raw_zip(path, [("archive/data.pkl", 0, pkl, len(pkl), binascii.crc32(pkl)),
                          ("archive/data/0", method, payload, declared, crc)])


ZEROS_1K = bytes(1024)


@pytest.mark.parametrize("case", ["bomb past declared", "truncated stream", "ends early",
                                  "bad crc", "bzip2", "impossible ratio", "garbage stream"])
def test_deflated_members_are_held_to_their_declared_size(tmp_path, case):
    path = tmp_path / "pytorch_model.bin"
    good = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = good.compress(ZEROS_1K) + good.flush()
    crc, numel, payload, method = binascii.crc32(ZEROS_1K), 256, stream, 8
    needle = {"bomb past declared": "inflates past its declared size of 1024",
              "truncated stream": "truncated", "ends early": "ends after 512 bytes",
              "bad crc": "CRC", "bzip2": "method 12", "impossible ratio": "corrupt",
              "garbage stream": "corrupt"}[case]
    if case == "bomb past declared":        # declares 1 KiB, inflates to 64 MiB
        payload = deflate_zeros(64 * MiB)
    elif case == "truncated stream":
        payload = stream[:len(stream) // 2]
    elif case == "ends early":
        small = zlib.compressobj(9, zlib.DEFLATED, -15)
        payload = small.compress(bytes(512)) + small.flush()
    elif case == "bad crc":
        crc ^= 1
    elif case == "bzip2":
        method = 12
    elif case == "impossible ratio":        # 2 GiB claimed from a few bytes
        numel, payload = 1 << 29, stream
    elif case == "garbage stream":
        payload = b"\xff" * len(stream)
    torch_zip(path, numel, payload, numel * 4, crc, method)
    with Bounded(peak=8 * MiB), pytest.raises(CheckpointError) as err:
        f = TorchFile(path)
        f.raw("w", mmap=False)
    one_line(err, path, needle)


def test_a_small_tensor_from_a_huge_member_reads_only_what_it_needs(tmp_path):
    # a consistent member of 64 MiB (declared and real): the (16, 16) view at its start reads
    # 1 KiB of it; rows read in order continue one stream
    path = torch_zip(tmp_path / "w.bin", 16 * MiB, deflate_zeros(64 * MiB), 64 * MiB,
                     binascii.crc32(bytes(64 * MiB)))
    with Bounded(peak=4 * MiB):
        f = TorchFile(path)
        w = f.raw("w", mmap=False)
        assert w.shape == (16, 16) and not w.any()
        for a in range(0, 16, 4):
            assert f.raw("w", rows=(a, a + 4)).shape == (4, 16)


def test_deflated_member_read_whole_matches_and_checks_crc(tmp_path):
    values = np.arange(256, dtype="<f4")
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    payload = c.compress(values.tobytes()) + c.flush()
    path = torch_zip(tmp_path / "w.bin", 256, payload, 1024, binascii.crc32(values.tobytes()))
    f = TorchFile(path)
    assert np.array_equal(f.raw("w"), values.reshape(16, 16))
    assert np.array_equal(f.raw("w", rows=(3, 5)), values.reshape(16, 16)[3:5])
    assert np.array_equal(f.raw("w", rows=(1, 2)), values.reshape(16, 16)[1:2])  # restarts


# -- bad values ------------------------------------------------------------------------------------
def save_raw(folder: Path, name: str, code: str, shape, data: bytes) -> Path:
    (folder / "config.json").write_text("{}")
    header = {name: {"dtype": code, "shape": list(shape), "data_offsets": [0, len(data)]}}
    return raw_safetensors(folder / "model.safetensors", json.dumps(header).encode(), data)


BAD_VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf, "huge": 3e35}


@pytest.mark.parametrize("code,bad", [(c, b) for c in ("F32", "F16", "BF16", "F64")
                                      for b in BAD_VALUES if (c, b) != ("F16", "huge")])
@pytest.mark.parametrize("seed", [0, 1])
def test_non_finite_or_absurd_values_are_named_with_their_index(tmp_path, code, bad, seed):
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(2, 40)), int(rng.integers(2, 40)))
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    where = tuple(int(rng.integers(0, n)) for n in shape)
    values[where] = BAD_VALUES[bad]
    stored = {"F32": lambda v: v.astype("<f4").tobytes(), "F64": lambda v: v.astype("<f8").tobytes(),
              "F16": lambda v: v.astype("<f2").tobytes(),
              "BF16": lambda v: (v.view(np.uint32) >> 16).astype("<u2").tobytes()}[code](values)
    save_raw(tmp_path, "enc.w", code, shape, stored)
    ckpt = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as err:
        ckpt.read("enc.w")
    text = one_line(err, tmp_path / "model.safetensors", "tensor 'enc.w' holds", list(where))
    assert ("NaN" if bad == "nan" else "inf" if "inf" in bad else "beyond") in text
    rows = (where[0], where[0] + 1)
    with pytest.raises(CheckpointError) as err:
        ckpt.read("enc.w", rows=rows)          # the index is in the whole tensor
    one_line(err, list(where))
    assert ckpt.read("enc.w", check=False).shape == shape
    ckpt.check_values = False
    assert ckpt.read("enc.w").shape == shape


@pytest.mark.parametrize("code", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("seed", range(4))
def test_wrong_byte_order_is_caught(tmp_path, code, seed):
    """Big-endian data labelled little-endian: typical weights byte-swapped hold NaN/inf or
    magnitudes far beyond any weight (a heuristic: certain for tensors of a few hundred values)."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((32, 32)) * 0.02).astype(np.float32)
    stored = {"F32": values.astype(">f4").tobytes(), "F16": values.astype(">f2").tobytes(),
              "BF16": (values.view(np.uint32) >> 16).astype(">u2").tobytes()}[code]
    save_raw(tmp_path, "w", code, values.shape, stored)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path).read("w")
    one_line(err, "tensor 'w' holds")
    # a torch zip whose byteorder file lies the same way
    path = write_zip(tmp_path / "pytorch_model.bin", state_dict(
        {"w": tensor(storage("0", "FloatStorage", 1024), 0, (32, 32), (32, 1))}),
        {"0": values.astype("<f4").tobytes()}, byteorder="big")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path).read("w")
    one_line(err, path, "tensor 'w' holds")


def test_healthy_values_pass_and_large_legit_ones_too(tmp_path):
    values = np.linspace(-6e4, 6e4, 1000, dtype=np.float32).reshape(10, 100)
    save_raw(tmp_path, "w", "F32", values.shape, values.tobytes())
    assert np.array_equal(Checkpoint(tmp_path).read("w"), values)
    assert Checkpoint(tmp_path).read("w", np.float16).dtype == np.float16   # fits in float16




def test_zip_member_count_is_checked_before_zipfile_reads_the_directory(tmp_path):
    # an end record claiming 10^6 members (zipfile would build ~500 bytes per member first)
    for count_field, zip64 in [(60000, None), (0xFFFF, 10 ** 6)]:
        body = b"PK\x03\x04" + bytes(26)
        tail = b""
        if zip64:
            tail = (struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, zip64, zip64, 0, 0)
                    + struct.pack("<4sIQI", b"PK\x06\x07", 0, len(body), 1))
        path = tmp_path / "pytorch_model.bin"
        path.write_bytes(body + tail + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count_field,
                                                   count_field, 0, 0, 0))
        expected = zip64 or count_field
        if expected <= MAX_TENSORS:
            with pytest.raises(CheckpointError) as err:      # zipfile's own complaint, one line
                TorchFile(path)
            one_line(err, path)
            continue
        with Bounded(peak=1 * MiB), pytest.raises(CheckpointError) as err:
            TorchFile(path)
        one_line(err, path, f"zip archive of {expected} members")


def test_legacy_storage_keys_listed_twice(tmp_path):
    path = write_legacy(tmp_path / "l.bin", {"w": tensor(storage("0", "FloatStorage", 2, True),
                                                          0, (2,), (1,))},
                        {"0": (2, bytes(8))})
    data = path.read_bytes().replace(dumps(["0"]), dumps(["0", "0"]))
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as err:
        TorchFile(path)
    one_line(err, path, "malformed storage key list")


@pytest.mark.parametrize("key", ["n" * 5000, 7, ("a", "b")])
def test_state_dict_keys_must_be_tensor_names(tmp_path, key):
    st = storage("0", "FloatStorage", 2)
    data = dumps(state_dict({key: tensor(st, 0, (2,), (1,))}))
    path = write_zip(tmp_path / "w.bin", None, {"0": bytes(8)}, data_pkl=data)
    with pytest.raises(CheckpointError) as err:
        TorchFile(path)
    one_line(err, path, "is not a tensor name")
