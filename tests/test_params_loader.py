"""The one loader (params/loader.py): names and shapes checked before anything is read, aliases."""
import shutil

import numpy as np
import pytest
from conftest import XL_FIXTURES, needs_xl_fixtures
from safetensors.numpy import save_file
from factories import write_t5

import minfer
from minfer.errors import CheckpointError


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    name = "decoder.block.1.layer.2.DenseReluDense.wo.weight"
    write_t5(tmp_path / "missing", drop=(name,))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        minfer.load(tmp_path / "missing")

    write_t5(tmp_path / "extra", extra_tensors={"encoder.block.0.surprise": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'encoder.block.0.surprise'"):
        minfer.load(tmp_path / "extra")

    write_t5(tmp_path / "shape", extra_tensors={name: np.zeros((16, 31), np.float32)})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[16, 31\], config implies \[16, 32\]"):
        minfer.load(tmp_path / "shape")


def test_aliases_and_legacy_tensors_are_accepted(tmp_path):
    base = write_t5(tmp_path / "a", seed=3)
    tensors = {}
    from minfer.io.checkpoint import Checkpoint
    ckpt = Checkpoint(base)
    for n in ckpt.names():
        tensors[n] = ckpt.read(n)
    shared = tensors.pop("shared.weight")
    tensors["encoder.embed_tokens.weight"] = shared  # only an alias of the embedding
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = \
        np.ones((8, 4), np.float32)
    other = tmp_path / "b"
    other.mkdir()
    (other / "config.json").write_text((base / "config.json").read_text())
    save_file(tensors, str(other / "model.safetensors"))
    ids = [[5, 6, 7, 1]]
    np.testing.assert_array_equal(minfer.load(base).forward(ids, [[0, 9, 4]]),
                                  minfer.load(other).forward(ids, [[0, 9, 4]]))


@needs_xl_fixtures
def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.numpy import save_file

    from minfer.io.checkpoint import Checkpoint
    src = XL_FIXTURES / "plain_softmax"
    ckpt = Checkpoint(src)
    tensors = {n: ckpt.read(n) for n in ckpt.names()}
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    name = "transformer.layers.1.pos_ff.CoreNet.3.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{name}' is missing"):
        minfer.load(folder)
    save_file({**tensors, name: np.zeros(3, np.float32)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        minfer.load(folder)


@pytest.mark.parametrize("folder_name,dtype", [("weights/tiny-t5-dates", None),
                                                ("weights/tiny-t5-dates", "int8"),
                                                ("weights/t5/v1_1_gated_untied", None),
                                                ("weights/transfo_xl/adaptive_div4", None),
                                                ("weights/transfo_xl/adaptive_div1_proj", "int8")])
def test_the_plan_counts_exactly_what_placement_allocates(folder_name, dtype):
    """Under a limit every weight lives in the arena: the plan's bytes are the arena's use."""
    from conftest import ROOT
    m = minfer.load(ROOT / folder_name, dtype=dtype, memory_limit="1GiB")
    plan = m.weight_plan
    assert not plan.streamed
    assert m.backend.arena.used == plan.fixed + sum(plan.unit_bytes.values()) + plan.scratch_bytes


def as_array(w):
    """A float32 slot as an array, whether or not the compiled kernels wrap it."""
    return getattr(w, "stored", w)


def test_fused_slots_hold_what_the_checkpoint_says(tmp_path):
    """w_qkv of a layer is [q; k; v] exactly; the norm's weight stays beside it."""
    from minfer.io.checkpoint import Checkpoint
    folder = write_t5(tmp_path / "m", seed=4, feed_forward_proj="gated-gelu")
    ckpt = Checkpoint(folder)
    blk = next(iter(minfer.load(folder).params["decoder"]))
    p = "decoder.block.0.layer"
    g = ckpt.read(f"{p}.0.layer_norm.weight")
    qkv = np.concatenate([ckpt.read(f"{p}.0.SelfAttention.{w}.weight") for w in "qkv"])
    np.testing.assert_array_equal(as_array(blk["w_qkv"]), qkv)
    np.testing.assert_array_equal(blk["ln_self"], g)
    g2 = ckpt.read(f"{p}.2.layer_norm.weight")
    wi = np.concatenate([ckpt.read(f"{p}.2.DenseReluDense.wi_{j}.weight") for j in (0, 1)])
    np.testing.assert_array_equal(as_array(blk["w_in"]), wi)
    np.testing.assert_array_equal(blk["ln_ff"], g2)
