"""minfer.legacy: torch.save files and pickled vocabularies read without torch or pickle code.

The pickles are written here opcode by opcode (`dumps`), so no test needs torch to make its input
and the malicious ones are exactly what they claim to be. Where torch / transformers are
importable, real files made by them are read too.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_xl_oracle

from minfer.errors import CheckpointError, TokenizerError
from minfer.io.checkpoint import Checkpoint
from minfer.io.torch_pickle import TORCH_MAGIC, TorchFile, load_pickled_vocab, load_torch_state_dict


# -- a tiny pickle writer ---------------------------------------------------------------------
class G:
    """A global reference, written as a GLOBAL opcode."""
    def __init__(self, dotted: str):
        self.module, self.name = dotted.rsplit(".", 1)


class Call:
    """func(*args), written as REDUCE."""
    def __init__(self, func, *args):
        self.func, self.args = func, args


class New:
    """cls.__new__(cls, *args) then BUILD(state), written as NEWOBJ + BUILD."""
    def __init__(self, cls, state=None, *args):
        self.cls, self.state, self.args = cls, state, args


class Pid:
    """A persistent id, written as BINPERSID."""
    def __init__(self, value):
        self.value = value


def dumps(obj) -> bytes:
    out = bytearray(b"\x80\x02")

    def emit(x):
        if isinstance(x, G):
            out.extend(b"c" + f"{x.module}\n{x.name}\n".encode())
        elif isinstance(x, Call):
            emit(x.func), emit(tuple(x.args))
            out.extend(b"R")
        elif isinstance(x, New):
            emit(x.cls), emit(tuple(x.args))
            out.extend(b"\x81")
            if x.state is not None:
                emit(x.state)
                out.extend(b"b")
        elif isinstance(x, Pid):
            emit(x.value)
            out.extend(b"Q")
        elif x is None:
            out.extend(b"N")
        elif x is True or x is False:
            out.extend(b"\x88" if x else b"\x89")
        elif isinstance(x, int):
            if 0 <= x < 2 ** 31:
                out.extend(b"J" + struct.pack("<i", x))
            else:
                raw = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
                out.extend(b"\x8a" + bytes([len(raw)]) + raw)
        elif isinstance(x, float):
            out.extend(b"G" + struct.pack(">d", x))
        elif isinstance(x, str):
            raw = x.encode()
            out.extend(b"X" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(x, tuple):
            out.extend(b"(")
            for item in x:
                emit(item)
            out.extend(b"t")
        elif isinstance(x, list):
            out.extend(b"](")
            for item in x:
                emit(item)
            out.extend(b"e")
        elif isinstance(x, dict):
            out.extend(b"}(")
            for k, v in x.items():
                emit(k), emit(v)
            out.extend(b"u")
        else:
            raise TypeError(type(x))

    emit(obj)
    return bytes(out + b".")


def storage(key: str, kind: str, numel: int, legacy: bool = False) -> Pid:
    ref = ("storage", G(f"torch.{kind}"), key, "cpu", numel)
    return Pid(ref + (None,) if legacy else ref)


def tensor(st: Pid, offset: int, size, stride, fn="torch._utils._rebuild_tensor_v2") -> Call:
    return Call(G(fn), st, offset, tuple(size), tuple(stride), False, Call(G("collections.OrderedDict")))


def state_dict(entries: dict) -> Call:
    """An OrderedDict(...) call, as torch writes a state dict (REDUCE of [(k, v), ...])."""
    return Call(G("collections.OrderedDict"), [tuple(kv) for kv in entries.items()])


def write_zip(path: Path, obj, storages: dict[str, bytes], byteorder: str | None = "little",
              compression=zipfile.ZIP_STORED, data_pkl: bytes | None = None) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr("archive/data.pkl", data_pkl if data_pkl is not None else dumps(obj))
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        for key, raw in storages.items():
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", "3\n")
    return path


def write_legacy(path: Path, obj, storages: dict[str, tuple[int, bytes]],
                 main: bytes | None = None) -> Path:
    sys_info = {"protocol_version": 1001, "little_endian": True,
                "type_sizes": {"short": 2, "int": 4, "long": 4}}
    parts = [dumps(TORCH_MAGIC), dumps(1001), dumps(sys_info),
             main if main is not None else dumps(obj), dumps(list(storages))]
    for numel, raw in storages.values():
        parts.append(struct.pack("<q", numel) + raw)
    path.write_bytes(b"".join(parts))
    return path


def bf16_bits(values) -> bytes:
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


BASE = np.arange(12, dtype=np.float32)         # storage "0": a (3, 4) matrix and views of it


def sample_entries(legacy: bool = False) -> tuple[dict, dict]:
    s0 = storage("0", "FloatStorage", 12, legacy)
    s1 = storage("1", "BFloat16Storage", 3, legacy)
    s2 = storage("2", "LongStorage", 4, legacy)
    s3 = storage("3", "HalfStorage", 6, legacy)
    entries = {
        "a": tensor(s0, 0, (3, 4), (4, 1)),
        "t": tensor(s0, 0, (4, 3), (1, 4)),                       # transposed view
        "s": tensor(s0, 6, (2, 2), (4, 1)),                       # slice a[1:, 2:]
        "col": tensor(s0, 1, (3,), (4,)),                         # a[:, 1]
        "b": tensor(s1, 0, (3,), (1,)),
        "i": tensor(s2, 1, (3,), (1,)),
        "h": tensor(s3, 0, (2, 3), (3, 1)),
        "p": Call(G("torch._utils._rebuild_parameter"), tensor(s0, 4, (4,), (1,)), True,
                  Call(G("collections.OrderedDict"))),
        "x": tensor(s0, 0, (2, 3), (0, 1)),                       # expanded (stride 0)
        "e": tensor(s0, 12, (0, 5), (5, 1)),                      # empty, offset at the end
        "scalar": tensor(s0, 11, (), ()),
    }
    raw = {"0": BASE.astype("<f4").tobytes(), "1": bf16_bits([1.5, -2.0, 3.0e38]),
           "2": np.array([-7, 1, 2 ** 40, -3], "<i8").tobytes(),
           "3": np.arange(6, dtype="<f2").tobytes()}
    return entries, raw


EXPECTED = {
    "a": BASE.reshape(3, 4), "t": BASE.reshape(3, 4).T, "s": BASE.reshape(3, 4)[1:, 2:],
    "col": BASE.reshape(3, 4)[:, 1],
    "b": (np.frombuffer(bf16_bits([1.5, -2.0, 3.0e38]), "<u2").astype(np.uint32)
          << 16).view(np.float32),                                # 3e38 rounded to bf16
    "i": np.array([1, 2 ** 40, -3], np.int64), "h": np.arange(6, dtype=np.float16).reshape(2, 3),
    "p": BASE[4:8], "x": np.broadcast_to(BASE[:3], (2, 3)), "e": np.zeros((0, 5), np.float32),
    "scalar": np.array(11.0, np.float32),
}


def check_sample(arrays: dict[str, np.ndarray]) -> None:
    assert set(arrays) == set(EXPECTED)
    for name, want in EXPECTED.items():
        got = arrays[name]
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert got.shape == want.shape, name
        assert np.array_equal(got, want), name
        assert got.flags.c_contiguous and got.dtype.isnative, name


# -- reading --------------------------------------------------------------------------------------
def test_zip_checkpoint_values_strides_offsets_and_dtypes(tmp_path):
    entries, raw = sample_entries()
    path = write_zip(tmp_path / "w.bin", state_dict(entries), raw)
    arrays = load_torch_state_dict(path)
    check_sample(arrays)
    assert EXPECTED["b"][0] == 1.5 and EXPECTED["b"][1] == -2.0
    arrays["a"][0, 0] = 99            # fresh copies: the views of one storage are independent
    assert arrays["t"][0, 0] == 0 and arrays["p"][0] == 4
    info = TorchFile(path).tensors
    assert (info["a"].dtype, info["b"].dtype, info["i"].dtype, info["h"].dtype) == \
        ("F32", "BF16", "I64", "F16")
    assert info["s"].end - info["s"].start == (1 + 4 + 1) * 4    # elements 6..11 spanned


def test_plain_dict_and_compressed_members_and_big_endian(tmp_path):
    entries, raw = sample_entries()
    check_sample(load_torch_state_dict(write_zip(tmp_path / "d.bin", entries, raw)))
    check_sample(load_torch_state_dict(write_zip(tmp_path / "c.bin", state_dict(entries), raw,
                                                 compression=zipfile.ZIP_DEFLATED)))
    check_sample(load_torch_state_dict(write_zip(tmp_path / "o.bin", state_dict(entries), raw,
                                                 byteorder=None)))     # old files: little
    big = {"0": BASE.astype(">f4").tobytes(), "1": np.frombuffer(raw["1"], "<u2").astype(">u2").tobytes(),
           "2": np.frombuffer(raw["2"], "<i8").astype(">i8").tobytes(),
           "3": np.arange(6, dtype=">f2").tobytes()}
    check_sample(load_torch_state_dict(write_zip(tmp_path / "b.bin", state_dict(entries), big,
                                                 byteorder="big")))


def test_legacy_format(tmp_path):
    entries, raw = sample_entries(legacy=True)
    numels = {"0": 12, "1": 3, "2": 4, "3": 6}
    path = write_legacy(tmp_path / "l.bin", state_dict(entries),
                        {k: (numels[k], raw[k]) for k in ("2", "0", "3", "1")})
    check_sample(load_torch_state_dict(path))


def test_legacy_view_storage(tmp_path):
    view = Pid(("storage", G("torch.FloatStorage"), "0", "cpu", 12, ("v", 4, 6)))
    path = write_legacy(tmp_path / "v.bin", {"w": tensor(view, 1, (2, 2), (2, 1))},
                        {"0": (12, BASE.tobytes())})
    assert np.array_equal(load_torch_state_dict(path)["w"], BASE[5:9].reshape(2, 2))


def test_shared_storage_is_read_once_per_tensor(tmp_path):
    s0 = storage("0", "FloatStorage", 12)
    tied = {"emb.weight": tensor(s0, 0, (3, 4), (4, 1)), "out.weight": tensor(s0, 0, (3, 4), (4, 1))}
    arrays = load_torch_state_dict(write_zip(tmp_path / "t.bin", state_dict(tied),
                                             {"0": BASE.tobytes()}))
    assert np.array_equal(arrays["emb.weight"], arrays["out.weight"])


def test_file_io_reads_equal_mapped_reads_without_mapping(tmp_path):
    # under a memory limit tensors are read with file I/O (mapped pages would count as RSS):
    # every dtype, stride, offset, byte order and row range must read as through the map
    entries, raw = sample_entries()
    big = {"0": BASE.astype(">f4").tobytes(), "1": np.frombuffer(raw["1"], "<u2").astype(">u2").tobytes(),
           "2": np.frombuffer(raw["2"], "<i8").astype(">i8").tobytes(),
           "3": np.arange(6, dtype=">f2").tobytes()}
    legacy_entries, legacy_raw = sample_entries(legacy=True)
    numels = {"0": 12, "1": 3, "2": 4, "3": 6}
    paths = [write_zip(tmp_path / "w.bin", state_dict(entries), raw),
             write_zip(tmp_path / "b.bin", state_dict(entries), big, byteorder="big"),
             write_zip(tmp_path / "c.bin", state_dict(entries), raw, compression=zipfile.ZIP_DEFLATED),
             write_legacy(tmp_path / "l.bin", state_dict(legacy_entries),
                          {k: (numels[k], legacy_raw[k]) for k in ("2", "0", "3", "1")})]
    for path in paths:
        f = TorchFile(path)
        for name, info in f.tensors.items():
            mapped = np.array(f.raw(name))
            read = f.raw(name, mmap=False)
            assert read.dtype == mapped.dtype and np.array_equal(read, mapped), (path.name, name)
            if info.shape and info.shape[0] > 1:
                assert np.array_equal(f.raw(name, mmap=False, rows=(1, info.shape[0])), mapped[1:])
                assert np.array_equal(f.raw(name, rows=(0, 1)), mapped[:1])
        if path.name != "c.bin":  # compressed members are decompressed, never mapped
            assert f._map is not None
        g = TorchFile(path)
        for name in g.tensors:
            g.raw(name, mmap=False)
        assert g._map is None, path.name


def test_file_io_read_of_a_shrunk_file_is_a_clear_error(tmp_path):
    entries, raw = sample_entries()
    path = write_zip(tmp_path / "w.bin", state_dict(entries), raw)
    f = TorchFile(path)
    last = max(f.tensors.values(), key=lambda i: i.end)
    path.write_bytes(path.read_bytes()[:last.end - 2])  # cut inside the last tensor's bytes
    with pytest.raises(CheckpointError) as err:
        f.raw(last.name, mmap=False)
    one_line(err, str(path), "truncated")


# -- lying or broken files ------------------------------------------------------------------------
def one_line(err, *needles) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    assert err.value.__cause__ is None
    return text


def test_truncated_storage_file(tmp_path):
    entries, raw = sample_entries()
    raw["0"] = raw["0"][:40]
    path = write_zip(tmp_path / "w.bin", state_dict(entries), raw)
    with pytest.raises(CheckpointError) as err:
        load_torch_state_dict(path)
    one_line(err, str(path), "archive/data/0", "holds 40 bytes, expected 48")


def test_truncated_legacy_file(tmp_path):
    path = write_legacy(tmp_path / "l.bin", {"w": tensor(storage("0", "FloatStorage", 12, True),
                                                          0, (12,), (1,))},
                        {"0": (12, BASE.tobytes())})
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CheckpointError) as err:
        load_torch_state_dict(path)
    one_line(err, str(path), "runs past the end of the file")


def test_lying_sizes_are_caught_before_allocating(tmp_path):
    s_huge = storage("0", "FloatStorage", 10 ** 15)                     # 4 PB claimed, 48 B present
    path = write_zip(tmp_path / "h.bin", {"w": tensor(s_huge, 0, (10 ** 15,), (1,))},
                     {"0": BASE.tobytes()})
    with pytest.raises(CheckpointError) as err:
        TorchFile(path)
    one_line(err, "holds 48 bytes, expected 4000000000000000")
    s0 = storage("0", "FloatStorage", 12)
    for size, stride, offset in [((4, 4), (4, 1), 0), ((3, 4), (4, 1), 1), ((2,), (20,), 0),
                                 ((0,), (1,), 13)]:
        path = write_zip(tmp_path / "x.bin", {"w": tensor(s0, offset, size, stride)},
                         {"0": BASE.tobytes()})
        with pytest.raises(CheckpointError) as err:
            TorchFile(path)
        one_line(err, "tensor 'w'", "runs past its storage '0' of 12 elements")


@pytest.mark.parametrize("bad, needle", [
    (tensor(storage("0", "FloatStorage", 12), 0, (3, -4), (4, 1)), "malformed tensor size"),
    (tensor(storage("0", "FloatStorage", 12), -1, (3,), (1,)), "malformed storage offset"),
    (tensor(storage("0", "FloatStorage", 12), 0, (3, 4), (1,)), "malformed tensor size"),
    (tensor("not a storage", 0, (3,), (1,)), "tensor storage is a str"),
    (tensor(storage("0", "ComplexFloatStorage", 6), 0, (3,), (1,)),
     "refuses to unpickle global 'torch.ComplexFloatStorage'"),
    (tensor(storage("0", "FloatStorage", 12), 0, (3,), (1,), fn="torch._utils._rebuild_tensor_v3"),
     "refuses to unpickle global 'torch._utils._rebuild_tensor_v3'"),
    (Call(G("torch.storage._load_from_bytes"), "x"), "refuses to unpickle global"),
    (7, "entry 'w' is a int, not a tensor"),
])
def test_malformed_tensors(tmp_path, bad, needle):
    path = write_zip(tmp_path / "m.bin", {"w": bad}, {"0": BASE.tobytes()})
    with pytest.raises(CheckpointError) as err:
        TorchFile(path)
    one_line(err, str(path), needle)


def test_storage_used_with_two_dtypes_or_missing(tmp_path):
    a, b = storage("0", "FloatStorage", 12), storage("0", "IntStorage", 12)
    path = write_zip(tmp_path / "d.bin", {"a": tensor(a, 0, (1,), (1,)), "b": tensor(b, 0, (1,), (1,))},
                     {"0": BASE.tobytes()})
    with pytest.raises(CheckpointError, match="referenced as F32 x 12 and as I32 x 12"):
        TorchFile(path)
    path = write_zip(tmp_path / "m.bin", {"a": tensor(a, 0, (1,), (1,))}, {})
    with pytest.raises(CheckpointError, match="storage file archive/data/0 is missing"):
        TorchFile(path)


@pytest.mark.parametrize("content, needle", [
    (b"", "empty file"),
    (b"hello, not a checkpoint", "not a PyTorch checkpoint: neither a zip archive nor a pickle"),
    (pickle.dumps({"a": 1}), "a pickle, but not torch.save's format"),
    (pickle.dumps([1, 2], protocol=2)[:-3], "not a PyTorch checkpoint"),
    (b"PK\x03\x04" + b"\0" * 40, "unreadable zip archive"),
])
def test_not_a_checkpoint(tmp_path, content, needle):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        TorchFile(path)
    one_line(err, str(path), needle)


def test_tar_format_and_zip_without_data_pkl(tmp_path):
    import tarfile
    path = tmp_path / "old.bin"
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("storages")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(CheckpointError, match="tar checkpoint format"):
        TorchFile(path)
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hi")
    with pytest.raises(CheckpointError, match="without one <archive>/data.pkl"):
        TorchFile(path)


# -- malicious pickles ----------------------------------------------------------------------------
class _Evil:
    """Pickles as a call to os.system (module 'posix' on Linux): the classic payload."""
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payloads(marker: Path) -> dict[str, bytes]:
    """Pickles whose loading would create `marker` (harmless if it ever ran)."""
    return {
        "os.system": dumps(Call(G("os.system"), f"touch {marker}")),
        "posix.system": pickle.dumps({"w": _Evil(marker)}, protocol=2),
        "builtins.exec": dumps({"w": Call(G("builtins.exec"), f"open({str(marker)!r}, 'w').close()")}),
        "subprocess.Popen": dumps([Call(G("subprocess.Popen"), ["touch", str(marker)])]),
        "__builtin__.eval": dumps(Call(G("__builtin__.eval"), f"open({str(marker)!r}, 'w')")),
        "collections.OrderedDict.fromkeys": dumps(Call(G("collections.OrderedDict.fromkeys"), [1])),
        "builtins.getattr": dumps(Call(G("builtins.getattr"),
                                       Call(G("builtins.__import__"), "os"), "system")),
    }


@pytest.mark.parametrize("name", ["os.system", "posix.system", "builtins.exec", "subprocess.Popen",
                                  "__builtin__.eval", "collections.OrderedDict.fromkeys",
                                  "builtins.getattr"])
def test_malicious_pickles_are_refused_everywhere(tmp_path, name):
    marker = tmp_path / "marker"
    data = payloads(marker)[name]
    needle = f"refuses to unpickle global '{name}'"
    checkpoint_files = [
        write_zip(tmp_path / "zip.bin", None, {}, data_pkl=data),
        write_legacy(tmp_path / "legacy.bin", None, {}, main=data),
    ]
    for path in checkpoint_files:
        with pytest.raises(CheckpointError) as err:
            load_torch_state_dict(path)
        one_line(err, str(path), needle, "only tensors and plain containers are allowed")
    vocab_files = [tmp_path / "vocab.pkl", *checkpoint_files]
    vocab_files[0].write_bytes(data)
    for path in vocab_files:
        with pytest.raises(TokenizerError) as err:
            load_pickled_vocab(path)
        one_line(err, str(path), needle)
    assert not marker.exists()


def test_malicious_pickle_through_checkpoint(tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / "config.json").write_text("{}")
    write_zip(tmp_path / "pytorch_model.bin", None, {}, data_pkl=payloads(marker)["posix.system"])
    with pytest.raises(CheckpointError, match="refuses to unpickle global 'posix.system'"):
        Checkpoint(tmp_path)
    assert not marker.exists()


def test_refused_name_is_quoted_on_one_line(tmp_path):
    path = tmp_path / "vocab.pkl"
    def text(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()
    # STACK_GLOBAL takes any strings: a name with a line break must not break the message
    path.write_bytes(b"\x80\x04" + text("os") + text("sys\ntem") + b"\x93)R.")
    with pytest.raises(TokenizerError) as err:
        load_pickled_vocab(path)
    one_line(err, "refuses to unpickle global 'os.sys\\ntem'")


# -- vocabularies ---------------------------------------------------------------------------------
VOCAB = {"idx2sym": ["<eos>", "<unk>", "the"],
         "sym2idx": OrderedDict([("<eos>", 0), ("<unk>", 1), ("the", 2)]),
         "counter": Counter({"the": 5, "<unk>": 2}), "special": ["<eos>"], "lower_case": False,
         "delimiter": None, "min_freq": 0, "max_size": None, "eos_idx": 0,
         "extras": {"tags": {"a", "b"}, "blob": b"\x00\xff", "pair": (1, 2.5)}}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_vocab_pickles(tmp_path, protocol):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(VOCAB, protocol=protocol))
    got = load_pickled_vocab(path)
    assert got == VOCAB
    assert type(got["sym2idx"]) is OrderedDict and type(got["counter"]) is Counter


def test_vocab_in_torch_save_formats(tmp_path):
    obj = {"idx2sym": ["<eos>", "a"], "sym2idx": Call(G("collections.OrderedDict"),
                                                      [("<eos>", 0), ("a", 1)])}
    want = {"idx2sym": ["<eos>", "a"], "sym2idx": OrderedDict([("<eos>", 0), ("a", 1)])}
    assert load_pickled_vocab(write_legacy(tmp_path / "vocab.bin", obj, {})) == want
    assert load_pickled_vocab(write_zip(tmp_path / "vocab2.bin", obj, {})) == want


def test_hf_tokenizer_objects_become_inert_and_are_dropped(tmp_path):
    """What transformers 4.57's TransfoXLTokenizer.save_vocabulary pickles besides the vocabulary:
    Moses (de)tokenizers, compiled regexes, a Trie, AddedTokens. None of them is constructed."""
    moses_state = {"lang": "en", "NONBREAKING_PREFIXES": ["Mr"]}
    obj = {
        "idx2sym": ["<eos>", "<unk>"],
        "sym2idx": Call(G("collections.OrderedDict"), [("<eos>", 0), ("<unk>", 1)]),
        "counter": Call(G("collections.Counter"), {"a": 1}),
        "punction_without_space_before_pattern": Call(G("re._compile"), "(a+)+$", 32),
        "moses_punct_normalizer": New(G("sacremoses.normalize.MosesPunctNormalizer"), moses_state),
        "moses_tokenizer": New(G("sacremoses.tokenize.MosesTokenizer"), moses_state),
        "moses_detokenizer": New(G("sacremoses.tokenize.MosesDetokenizer"), {"lang": "en"}),
        "tokens_trie": New(G("transformers.tokenization_utils.Trie"), {"data": {}}),
        "_added_tokens_decoder": {0: New(G("tokenizers.AddedToken"), {"content": "<eos>"})},
        "language": "en",
        "unk_idx": 1,
    }
    path = tmp_path / "vocab.pkl"
    path.write_bytes(dumps(obj))
    modules_before = set(sys.modules)
    got = load_pickled_vocab(path)
    assert set(sys.modules) == modules_before        # nothing imported (sacremoses, transformers)
    assert got == {"idx2sym": ["<eos>", "<unk>"], "sym2idx": OrderedDict([("<eos>", 0), ("<unk>", 1)]),
                   "counter": Counter({"a": 1}), "language": "en", "unk_idx": 1}
    # a placeholder is only a placeholder: a REDUCE of a forbidden callable inside it is refused
    obj["moses_tokenizer"] = New(G("sacremoses.tokenize.MosesTokenizer"),
                                 {"x": Call(G("os.system"), "true")})
    path.write_bytes(dumps(obj))
    with pytest.raises(TokenizerError, match="refuses to unpickle global 'os.system'"):
        load_pickled_vocab(path)


@pytest.mark.parametrize("content, needle", [
    (b"", "empty file"),
    (b"\x80\x02garbage", "not a pickled vocabulary"),
    (pickle.dumps(["a", "b"]), "holds a list, expected a pickled dict"),
    (dumps(Pid(("storage", "x"))), "refuses a persistent reference"),
])
def test_bad_vocab_files(tmp_path, content, needle):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(content)
    with pytest.raises(TokenizerError) as err:
        load_pickled_vocab(path)
    one_line(err, str(path), needle)


# -- Checkpoint integration -----------------------------------------------------------------------
def test_checkpoint_reads_pytorch_model_bin(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "transfo-xl"}')
    entries, raw = sample_entries()
    bin_path = write_zip(tmp_path / "pytorch_model.bin", state_dict(entries), raw)
    ck = Checkpoint(tmp_path)
    assert set(ck.names()) == set(EXPECTED) and "t" in ck and "nope" not in ck
    info = ck.info("t")
    assert (info.dtype, info.shape, info.file) == ("F32", (4, 3), bin_path)
    assert ck.info("b").dtype == "BF16" and ck.info("h").dtype == "F16"
    assert np.array_equal(ck.read("t"), EXPECTED["t"]) and ck.read("t").flags.c_contiguous
    # "b" holds 3e38 (bf16 rounding at the edge of the range): past the magnitude check
    assert ck.read("b", check=False).dtype == np.float32
    assert np.array_equal(ck.read("b", check=False), EXPECTED["b"])
    with pytest.raises(CheckpointError, match=r"tensor 'b' holds 2.99076e\+38 at \[2\] \(beyond"):
        ck.read("b")
    assert ck.read("h", np.float16).dtype == np.float16
    assert np.array_equal(ck.read("h"), EXPECTED["h"].astype(np.float32))
    with pytest.raises(CheckpointError, match="integer dtype I64"):
        ck.read("i")
    with pytest.raises(CheckpointError, match="tensor 'nope' is missing"):
        ck.read("nope")
    assert ck.stored_dtypes() == {"F32", "BF16", "I64", "F16"}






# -- real files, when torch is importable ---------------------------------------------------------
def torch_tensors(torch):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g)
    return {
        "f32": a, "f16": torch.randn(3, 4, generator=g).half(),
        "bf16": torch.randn(6, generator=g).bfloat16(), "i64": torch.arange(-5, 5),
        "i32": torch.arange(4, dtype=torch.int32), "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False]), "f64": torch.randn(2, dtype=torch.float64),
        "transposed": a.t(), "slice": a[2:, 3:6], "column": a[:, 4],
        "expanded": torch.ones(1, 3).expand(4, 3), "empty": torch.zeros(0, 3), "scalar": a[1, 1],
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "bf16_t": torch.randn(3, 5, generator=g).bfloat16().t(),
    }


@pytest.mark.parametrize("zip_format", [True, False])
def test_torch_save_round_trip(tmp_path, zip_format):
    torch = pytest.importorskip("torch")
    tensors = torch_tensors(torch)
    path = tmp_path / "w.bin"
    torch.save(tensors, path, _use_new_zipfile_serialization=zip_format)
    got = load_torch_state_dict(path)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        t = t.detach()
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), name


@needs_xl_oracle
def test_transformers_transfo_xl_bin(tmp_path):
    """A tiny random TransfoXLLMHeadModel saved by transformers as pytorch_model.bin."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.TransfoXLConfig(vocab_size=30, cutoffs=[10, 20], d_model=8, d_embed=8,
                                          n_head=2, d_head=4, d_inner=16, n_layer=2, div_val=2,
                                          mem_len=4, tgt_len=4)
    torch.manual_seed(0)
    model = transformers.TransfoXLLMHeadModel(config)
    model.save_pretrained(tmp_path, safe_serialization=False)
    assert not (tmp_path / "model.safetensors").exists()
    ck = Checkpoint(tmp_path)
    want = model.state_dict()
    assert sorted(ck.names()) == sorted(want)
    for name, t in want.items():
        assert np.array_equal(ck.read(name, t.numpy().dtype), t.numpy()), name
    # tied tensors are two names over one storage
    assert ck.info("crit.out_layers.1.weight").start == \
        ck.info("transformer.word_emb.emb_layers.1.weight").start
