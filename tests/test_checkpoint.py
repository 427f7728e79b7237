import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from minfer.checkpoint import Checkpoint, SafetensorsFile, bf16_to_float32
from minfer.errors import CheckpointError


def write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None):
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def folder_with(tmp_path, tensors=None, raw=None):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    if tensors is not None:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_reads_f32_f16_and_widens_bf16_exactly(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    h = rng.standard_normal((5,)).astype(np.float16)
    folder_with(tmp_path, {"a": a, "h": h})
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names()) == ["a", "h"]
    np.testing.assert_array_equal(ckpt.read("a"), a)
    np.testing.assert_array_equal(ckpt.read("h"), h.astype(np.float32))
    assert ckpt.read("h").dtype == np.float32

    # bf16: the high 16 bits of a float32; build values exactly representable in bf16
    values = np.array([1.0, -2.5, 3.140625, 0.0, 65536.0, -1e-3], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    header = {"b": {"dtype": "BF16", "shape": [6], "data_offsets": [0, 12]}}
    write_raw(tmp_path / "model.safetensors", header, bits.tobytes())
    ckpt = Checkpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.read("b"), expected)
    np.testing.assert_array_equal(bf16_to_float32(bits[:3]), values[:3])


def test_tensors_are_memory_mapped_not_read_whole(tmp_path):
    folder_with(tmp_path, {"a": np.ones((64, 64), np.float32)})
    f = SafetensorsFile(tmp_path / "model.safetensors")
    view = f.raw("a")
    assert isinstance(view.base, np.memmap) or isinstance(view, np.memmap) or \
        isinstance(getattr(view.base, "base", None), np.memmap)
    assert not view.flags.writeable


@pytest.mark.parametrize("case,header,data,header_len,needle", [
    ("truncated", None, b"", None, "truncated"),
    ("huge header", {}, b"", 1 << 60, "exceeds"),
    ("header past end", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"", 5000,
     "past the end"),
    ("not json", None, b"", None, "not JSON"),
    ("bad dtype", {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
     "unsupported dtype"),
    ("outside", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None,
     "outside the data section"),
    ("lying shape", {"w": {"dtype": "F32", "shape": [1000000, 1000000], "data_offsets": [0, 4]}},
     b"\0" * 4, None, "expected 4000000000000"),
    ("bad shape", {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
     "malformed shape"),
    ("overlap", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None,
     "overlap"),
])
def test_malformed_files_fail_with_file_and_tensor_named(tmp_path, case, header, data, header_len,
                                                         needle):
    path = tmp_path / "model.safetensors"
    if case == "truncated":
        path.write_bytes(b"\1\2\3")
    elif case == "not json":
        path.write_bytes(struct.pack("<Q", 6) + b"{oops}")
    else:
        write_raw(path, header, data, header_len)
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    msg = str(err.value)
    assert needle in msg and str(path) in msg
    if header and len(header) == 1 and case not in ("huge header", "header past end"):
        assert f"'{next(iter(header))}'" in msg


def test_sharded_index(tmp_path):
    folder_with(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, str(tmp_path / "s2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names()) == ["a", "b"]
    np.testing.assert_array_equal(ckpt.read("b"), np.ones(3))


@pytest.mark.parametrize("weight_map,needle", [
    ({"a": "../escape.safetensors"}, "not a file name inside"),
    ({"a": "missing.safetensors"}, "missing.safetensors is missing"),
    ({"a": "s1.safetensors", "zzz": "s1.safetensors"}, "'zzz' is not in its shard"),
    ({}, "weight_map"),
])
def test_bad_index_is_named(tmp_path, weight_map, needle):
    folder_with(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=needle):
        Checkpoint(tmp_path)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: file is missing"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")   # read by legacy.py when no safetensors
    with pytest.raises(CheckpointError, match="pytorch_model.bin: empty file"):
        Checkpoint(tmp_path)


def test_integer_tensor_is_not_a_weight(tmp_path):
    folder_with(tmp_path, {"i": np.arange(3, dtype=np.int64)})
    with pytest.raises(CheckpointError, match="integer dtype I64"):
        Checkpoint(tmp_path).read("i")


@pytest.mark.parametrize("mapped", [False, True])
def test_reads_a_range_of_rows_by_file_io_or_map(tmp_path, mapped):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    h = rng.standard_normal((6, 2)).astype(np.float16)
    folder_with(tmp_path, {"a": a, "h": h})
    ckpt = Checkpoint(tmp_path)
    ckpt.use_mmap = mapped
    np.testing.assert_array_equal(ckpt.read("a", rows=(2, 5)), a[2:5])
    np.testing.assert_array_equal(ckpt.read("h", rows=(0, 6)), h.astype(np.float32))
    assert ckpt.read("a", rows=(3, 3)).shape == (0, 5)
    out = ckpt.read("a")
    out[0, 0] = 99.0  # a private, writable copy either way
    assert ckpt.read("a")[0, 0] == a[0, 0]
    with pytest.raises(CheckpointError, match=r"rows \(5, 9\) outside tensor 'a'"):
        ckpt.read("a", rows=(5, 9))
