"""`minfer convert` (convert.py): pytorch_model.bin to safetensors, and int8 files."""
from pathlib import Path

import numpy as np
import pytest
from conftest import XL_FIXTURES, load_xl_reference, needs_xl_fixtures, rel_err
from factories import DEC, IDS

import minfer

TOL = 1e-4


@needs_xl_fixtures
def test_convert_bin_to_safetensors(tmp_path):
    folder = XL_FIXTURES / "adaptive_div4_bin"
    if not (folder / "pytorch_model.bin").is_file():
        pytest.skip("no .bin fixture")
    from minfer.convert import convert
    summary = convert(folder, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file() and summary["tensors"] > 0
    ref = load_xl_reference("adaptive_div4")
    lp, mem = minfer.load(tmp_path / "out").forward(ref["input_ids"][:, :int(ref["segment_len"])])
    mem.release()
    assert rel_err(lp, ref["log_probs_0"]) < TOL












def test_convert_int8_file_loads_as_int8_with_the_same_outputs(folder, reference, tmp_path):
    from minfer.convert import convert
    summary = convert(folder, tmp_path / "q", dtype="int8")
    size_f = (folder / "model.safetensors").stat().st_size
    assert summary["bytes"] < 0.45 * size_f
    q_file = minfer.load(tmp_path / "q")
    assert q_file.backend.weight_format == "int8"  # an int8 file loads as int8 by default
    q_mem = minfer.load(folder, dtype="int8")
    lf, lm = q_file.forward(IDS, DEC), q_mem.forward(IDS, DEC)
    assert np.abs(lm - reference[0]).max() / np.abs(reference[0]).max() < 0.05
    # the file holds the norm-folded matrices quantised once, so loading it re-quantises to the
    # same int8 as quantising the float file at load (scales equal up to float rounding)
    np.testing.assert_allclose(lf, lm, rtol=0, atol=1e-5 * np.abs(lm).max())
    assert q_file.generate(IDS, max_new_tokens=12) == q_mem.generate(IDS, max_new_tokens=12)
    as_float = minfer.load(tmp_path / "q", dtype="float32")
    assert as_float.backend.weight_format != "int8"


def test_int8_scale_with_a_wrong_shape_is_a_clear_error(folder, tmp_path):
    from safetensors.numpy import save_file

    from minfer.io.checkpoint import Checkpoint
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((4, 4), np.int8),
               "encoder.block.0.layer.0.SelfAttention.q.weight_scale": np.ones(3, np.float32)},
              str(out / "model.safetensors"))
    with pytest.raises(minfer.CheckpointError, match=r"q\.weight_scale.*shape \[4\]"):
        Checkpoint(out)


def test_converted_file_is_standard_safetensors_equal_to_the_source(folder, tmp_path):
    """Written as it goes, the file still reads with the safetensors package, tensor for tensor."""
    from safetensors.numpy import load_file

    from minfer.convert import convert
    from minfer.io.checkpoint import Checkpoint
    src = Checkpoint(folder)
    for dtype, np_dtype in [("float32", np.float32), ("float16", np.float16)]:
        convert(folder, tmp_path / dtype, dtype=dtype)
        got = load_file(str(tmp_path / dtype / "model.safetensors"))
        assert sorted(got) == sorted(src.names())
        for name in src.names():
            np.testing.assert_array_equal(got[name], src.read(name, np_dtype))
    convert(folder, tmp_path / "q8", dtype="int8")
    q = load_file(str(tmp_path / "q8" / "model.safetensors"))
    ints = [n for n, a in q.items() if a.dtype == np.int8]
    assert ints and all(q[n + "_scale"].shape == q[n].shape[:1] for n in ints)


def test_output_problems_are_one_line_errors_naming_the_path(folder, tmp_path, monkeypatch):
    import errno

    import minfer.convert as conv
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old").write_text("x")
    for output, needle in [(a_file / "out", "cannot create the output folder"),
                           (a_file, "exists and is not an empty folder"),
                           (tmp_path / "full", "exists and is not an empty folder"),
                           (Path("/proc/minfer-test/out"), "cannot create the output folder")]:
        with pytest.raises(minfer.ConfigError) as err:
            conv.convert(folder, output)
        assert str(output) in str(err.value) and needle in str(err.value)
        assert "\n" not in str(err.value)

    # a full disk / read-only folder, midway: the error names the file, nothing is left behind
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return f

        class Full:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, data):
                if f.tell() > 4096:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return f.write(data)
        return Full()

    for fail, needle in [(failing_open, "No space left on device")]:
        monkeypatch.setattr(conv, "open", fail, raising=False)
        with pytest.raises(minfer.ConfigError) as err:
            conv.convert(folder, tmp_path / "new" / "out")
        assert str(err.value) == (f"convert: cannot write {tmp_path / 'new' / 'out' / 'model.safetensors'}: "
                                  f"{needle}")
        assert not (tmp_path / "new" / "out").exists()
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(minfer.ConfigError, match="cannot create the output folder .*ro: Read-only file system"):
        conv.convert(folder, tmp_path / "ro")


def test_convert_refuses_a_source_with_bad_values(folder, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from minfer.convert import convert
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    tensors = load_file(str(src / "model.safetensors"))
    name = sorted(tensors)[3]
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[5] = np.nan
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(minfer.CheckpointError, match=f"tensor '{name}' holds NaN"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["decoder.block.1.layer.0.SelfAttention.v.weight",
                                    "encoder.final_layer_norm.weight"])
def test_a_value_beyond_float16_is_refused_naming_it_when_narrowing(folder, tmp_path, target):
    # a legal float32 weight of 1e5 used to load as inf with dtype="float16" (a warning only), and
    # convert --dtype float16 wrote a file that then failed to load
    import shutil

    from safetensors.numpy import load_file, save_file

    from minfer.convert import convert
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors[target] = tensors[target].copy()
    tensors[target].reshape(-1)[3] = 1e5
    save_file(tensors, str(src / "model.safetensors"))
    where = "[0, 3]" if tensors[target].ndim == 2 else "[3]"
    needle = f"tensor '{target}' holds 100000 at {where}, beyond float16's range"
    with pytest.raises(minfer.CheckpointError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        convert(src, tmp_path / "out16", "float16")
    assert not (tmp_path / "out16").exists()
    if tensors[target].ndim == 2:   # linear slots are stored float16 on the CPU too
        with pytest.raises(minfer.CheckpointError, match="beyond float16's range"):
            minfer.load(src, dtype="float16")
    convert(src, tmp_path / "outbf", "bfloat16")   # bfloat16 has float32's range
    assert minfer.load(tmp_path / "outbf").generate(IDS, max_new_tokens=2)


def test_a_tokenizer_file_that_loops_is_named_not_left_out(text_model_folder, tmp_path):
    """convert copies the folder's tokenizer files: a looping one was left out without a word."""
    import shutil

    from minfer.convert import convert
    from minfer.errors import CheckpointError, TokenizerError
    src = tmp_path / "src"
    shutil.copytree(text_model_folder, src)
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").symlink_to("tokenizer_config.json")
    with pytest.raises((CheckpointError, TokenizerError), match="tokenizer_config.json: not a "
                       "readable file \\(a link that loops back on itself\\)"):
        convert(src, tmp_path / "out")
