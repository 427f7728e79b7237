"""One safetensors file (io/safetensors.py, io/tensors.py): header validation, dtypes, bounded reads."""
import struct

import numpy as np
import pytest

from factories import folder_with, write_raw
from minfer.errors import CheckpointError
from minfer.io.checkpoint import Checkpoint
from minfer.io.safetensors import SafetensorsFile
from minfer.io.tensors import bf16_to_float32






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
    ("not json", None, b"", None, "not valid JSON"),
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
