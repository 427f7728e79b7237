"""`minfer convert` (convert.py): pytorch_model.bin to safetensors, and int8 files."""
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
