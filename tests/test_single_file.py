"""Single .safetensors files of T5 / UMT5 encoders, as ComfyUI and model hubs ship them (Hugging
Face's tensor names, no config.json): the config inferred from the tensors, config= and
tokenizer=, fp8 (F8_E4M3, F8_E5M2) widened exactly, ComfyUI's scaled fp8, and the one-line
errors for files that are none of these.

The oracle is minfer loading the same weights from a normal folder with their config.json (that
path is checked against transformers by test_t5_parity.py and the fixtures' reference states);
the fp8 values are checked against a decoder written here from the formats' definitions."""
import json
import pickle
import shutil
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT, rel_err
from factories import encode_fp8, reference_fp8, t5_tensors

import minfer
from minfer_cli.main import cli
from minfer.errors import CheckpointError, ConfigError
from minfer.io.checkpoint import Checkpoint
from minfer.io.tensors import FP8_CODES, fp8_to_bfloat16_bits, fp8_to_float32
from minfer.models.t5 import T5Config
from minfer.models.t5.config import config_from_tensors
from minfer.models.t5.weights import weight_table

FAMILY = ROOT / "weights" / "family"
IDS = np.array([[5, 9, 17, 3, 44, 2, 1], [7, 8, 1, 0, 0, 0, 0]])
MASK = (IDS != 0) | (np.arange(7) == 0)

# Hugging Face configs of the three kinds, in small sizes, with the keys and values the real
# ones (t5-small, google/t5-v1_1-small, google/umt5-small) have for what a file cannot show
V1_0 = dict(model_type="t5", feed_forward_proj="relu", tie_word_embeddings=True)
V1_1 = dict(model_type="t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False)
UMT5 = dict(model_type="umt5", feed_forward_proj="gated-gelu", tie_word_embeddings=False)
SMALL = dict(vocab_size=120, d_model=24, d_kv=6, num_heads=4, d_ff=40, num_layers=3,
             num_decoder_layers=3, relative_attention_num_buckets=32,
             relative_attention_max_distance=128, layer_norm_epsilon=1e-6, pad_token_id=0,
             eos_token_id=1, decoder_start_token_id=0)
KINDS = {"v1_0": V1_0, "v1_1": V1_1, "umt5": UMT5}
# the real XXL shapes (t5-v1_1-xxl, umt5-xxl; t5-11b for v1.0), checked by shape only
XXL = {"v1_0": dict(V1_0, vocab_size=32128, d_model=1024, d_kv=128, num_heads=128, d_ff=65536,
                    num_layers=24, num_decoder_layers=24),
       "v1_1": dict(V1_1, vocab_size=32128, d_model=4096, d_kv=64, num_heads=64, d_ff=10240,
                    num_layers=24, num_decoder_layers=24),
       "umt5": dict(UMT5, vocab_size=256384, d_model=4096, d_kv=64, num_heads=64, d_ff=10240,
                    num_layers=24, num_decoder_layers=24)}


# -- files ---------------------------------------------------------------------------------------
def write_safetensors(path, tensors: dict, metadata: dict | None = None):
    """A safetensors file of {name: array} or {name: (dtype code, uint8 array)} (fp8 is no
    NumPy dtype: its bytes are written under the code given)."""
    codes = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<u2"): "BF16"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        code, a = t if isinstance(t, tuple) else (codes[np.asarray(t).dtype], np.asarray(t))
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def encoder_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the encoder `config` describes, in Hugging Face's names."""
    return t5_tensors(config, "encoder", seed)


def folder_of(tmp_path, name, config, tensors):
    """The oracle: the same weights in a folder with their config.json."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def states(model_path, **options):
    m = minfer.load(model_path, compute="float32", **options)
    return m.encode(IDS, MASK)


# -- the config inferred from the tensors --------------------------------------------------------
@pytest.mark.parametrize("sizes", [SMALL, *XXL.values()], ids=["small", *XXL])
@pytest.mark.parametrize("kind", KINDS)
def test_inferred_configs_equal_the_real_ones(kind, sizes):
    real = {**SMALL, **KINDS[kind], **(sizes if sizes is SMALL else XXL[kind])}
    encoder = T5Config.from_hf(real).with_parts(["encoder.x"], "encoder", "real")
    shapes = weight_table(encoder).tensors
    inferred = T5Config.from_hf(config_from_tensors(shapes, "file.safetensors"))
    assert inferred.with_parts([], "encoder", "file") == encoder


def test_a_single_file_encodes_as_its_folder(tmp_path):
    for kind, flavour in KINDS.items():
        config = {**SMALL, **flavour}
        tensors = encoder_tensors(config, seed=len(kind))
        folder = folder_of(tmp_path, kind, config, tensors)
        single = write_safetensors(tmp_path / f"{kind}.safetensors", tensors)
        want, got = states(folder), states(single)
        assert rel_err(got, want) <= 1e-6, kind
        m = minfer.load(single)
        assert m.parts == ("encoder",) and m.config.model_type == flavour["model_type"]
        assert m.load_recipe["model"] == str(single.resolve())


def test_a_limit_keeps_room_for_a_512_token_input_of_an_encoder_file(tmp_path):
    """A diffusion text encoder under memory_limit: the default workspace is planned for one
    512-token input (Flux's and Wan's length), so the layers kept resident leave room for it."""
    config = {**SMALL, **V1_1}
    single = write_safetensors(tmp_path / "enc.safetensors", encoder_tensors(config))
    free = minfer.load(single)
    need = free.plan(1, 512)["peak"]
    assert need > free.plan(1, 256)["peak"]
    limited = minfer.load(single, memory_limit=sum(free.weight_plan.unit_bytes.values()) + need)
    assert limited.weight_plan.workspace == need
    ids = np.random.default_rng(0).integers(2, config["vocab_size"], size=(1, 512))
    assert rel_err(limited.encode(ids), free.encode(ids)) <= 1e-6


def test_the_fixtures_reference_states_from_their_file_alone():
    """A real transformers UMT5EncoderModel save (bfloat16 weights) as one file with its
    config: the states transformers computed."""
    case = FAMILY / "umt5_encoder"
    ref = np.load(case / "reference.npz")
    m = minfer.load(case / "model.safetensors", config=case / "config.json", compute="float32")
    got = m.encode(ref["input_ids"], ref["attention_mask"])
    assert rel_err(got, ref["encoder_states"]) < 1e-4


def test_config_overrides_the_inference(tmp_path):
    """The fixture's max distance (16) is not what a file's shapes say (128): with config= the
    states are its folder's; without, they are not (so the option is what made them equal)."""
    case = FAMILY / "umt5_encoder"
    file = case / "model.safetensors"
    want = states(case)
    assert rel_err(states(file, config=case), want) <= 1e-6
    assert rel_err(states(file, config=case / "config.json"), want) <= 1e-6
    assert rel_err(states(file), want) > 1e-3
    m = minfer.load(file, config=case)
    assert m.config.max_distance == 16
    assert dict(m.describe())["weights"].endswith(f"config from {case / 'config.json'}")
    with pytest.raises(ConfigError, match="config=.* only a single .safetensors file"):
        minfer.load(case, config=case)
    with pytest.raises(ConfigError, match="config.json: file is missing"):
        minfer.load(file, config=tmp_path)


# -- fp8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FP8_CODES)
def test_fp8_widening_is_exact_for_all_256_codes(fmt):
    codes = np.arange(256, dtype=np.uint8)
    want = np.array([reference_fp8(int(c), fmt) for c in codes])
    got = fp8_to_float32(codes, fmt)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].astype(np.float64), want[~nan])
    bits = fp8_to_bfloat16_bits(codes, fmt)
    np.testing.assert_array_equal(bits[~nan], got.view(np.uint32)[~nan] >> 16)
    assert (np.signbit(got) == (codes >= 128)).all()


def fp8_file(tmp_path, config, fmt="F8_E4M3", scales=None, name="fp8", keep=("layer_norm",)):
    """A single file whose matrices are fp8 (`scales`: name -> scale array for a scaled file);
    returns it and the folder of the same values in float32 (fp8 x scale, in float32)."""
    tensors = encoder_tensors(config)
    stored, exact = {}, {}
    for k, w in tensors.items():
        if w.ndim != 2 or any(s in k for s in keep) or k.endswith("relative_attention_bias.weight"):
            stored[k] = exact[k] = w
            continue
        scale = None if scales is None else scales(k, w)
        codes = encode_fp8(w / (1 if scale is None else scale.reshape(-1, 1)), fmt)
        stored[k] = (fmt, codes)
        value = np.array([reference_fp8(int(c), fmt) for c in range(256)], np.float32)[codes]
        if scale is not None:
            stored[k[:-len(".weight")] + ".scale_weight"] = scale
            value = value * scale.reshape(-1, 1).astype(np.float32)
        exact[k] = value.astype(np.float32)
    if scales is not None:
        stored["scaled_fp8"] = (fmt, np.zeros(0, np.uint8))
    return (write_safetensors(tmp_path / f"{name}.safetensors", stored),
            folder_of(tmp_path, name, config, exact))


@pytest.mark.parametrize("fmt", FP8_CODES)
def test_an_fp8_file_widened_to_bfloat16_encodes_as_its_values(tmp_path, fmt):
    """(By default an fp8 file keeps its codes: test_fp8_storage.py; dtype= widens it.)"""
    config = {**SMALL, **V1_1}
    single, folder = fp8_file(tmp_path, config, fmt)
    m = minfer.load(single, dtype="bfloat16", compute="float32")
    assert m.backend.weight_format == "bfloat16"
    assert f"{fmt} -> bfloat16 values (exact)" in dict(m.describe())["weights"]
    want = states(folder)
    assert rel_err(m.encode(IDS, MASK), want) <= 1e-6
    assert rel_err(states(single, dtype="float32"), want) <= 1e-6
    ckpt = Checkpoint(folder)
    from minfer.io.single_file import SingleFile
    f = SingleFile(single)
    w = "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"
    assert f.info(w).dtype == "BF16" and f.file_dtype(w) == fmt
    np.testing.assert_array_equal(f.read(w), ckpt.read(w))
    np.testing.assert_array_equal(f.read(w, rows=(3, 9)), ckpt.read(w)[3:9])


def test_scaled_fp8_is_fp8_times_scale_exactly(tmp_path):
    config = {**SMALL, **UMT5}
    rng = np.random.default_rng(3)

    def scales(name, w):   # scalars as ComfyUI writes them, per-row ones for the FF output
        if "wo" in name:
            return (np.abs(w).max(axis=1) / 448 * rng.uniform(1, 1.1, w.shape[0])).astype(np.float32)
        return np.array(np.abs(w).max() / 448 * rng.uniform(1, 1.1), np.float32)
    single, folder = fp8_file(tmp_path, config, scales=scales)
    from minfer.io.single_file import SingleFile
    f, ckpt = SingleFile(single), Checkpoint(folder)
    for name in ckpt.names():
        got, want = f.read(name), ckpt.read(name)
        assert got.tobytes() == want.tobytes(), name      # bit for bit
    w = "encoder.block.2.layer.1.DenseReluDense.wo.weight"
    assert f.info(w).dtype == "F32" and f.file_dtype(w) == "F8_E4M3"
    assert not any(n.endswith(("scale_weight", "scaled_fp8")) for n in f.names())
    m = minfer.load(single, dtype="float32")
    assert m.backend.weight_format == "float32"
    assert "x scale_weight -> float32 products (scales not powers of two)" in dict(m.describe())["weights"]
    assert rel_err(m.encode(IDS, MASK), states(folder)) <= 1e-6


def test_power_of_two_scales_widen_to_bfloat16_exactly(tmp_path):
    config = {**SMALL, **V1_0}
    single, folder = fp8_file(
        tmp_path, config, scales=lambda k, w: np.array(2.0 ** np.floor(np.log2(np.abs(w).max() / 448)),
                                                       np.float32))
    m = minfer.load(single, dtype="bfloat16", compute="float32")
    assert m.backend.weight_format == "bfloat16"
    assert "exact: power-of-two scales" in dict(m.describe())["weights"]
    assert rel_err(m.encode(IDS, MASK), states(folder)) <= 1e-6


def stored_tensors(single) -> dict:
    """A file's tensors as write_safetensors takes them (fp8 as their code and bytes)."""
    from minfer.io.single_file import SingleFile
    src = SingleFile(single)
    return {n: (src.file_dtype(n), src.files[0].raw(n, mmap=False))
            if src.file_dtype(n) in FP8_CODES else src.read(n) for n in src.names()}


def test_an_f16_embedding_beside_fp8_keeps_the_file_exact(tmp_path):
    """bfloat16 cannot hold a float16 embedding exactly: widened, the file is float16; kept,
    the embedding alone is float16 beside the fp8 layers."""
    single, _ = fp8_file(tmp_path, {**SMALL, **V1_1})
    tensors = stored_tensors(single)
    code, raw = tensors["shared.weight"]
    tensors["shared.weight"] = fp8_to_float32(raw, code).astype(np.float16)   # (exact)
    write_safetensors(single, tensors)
    m = minfer.load(single, compute="float32")
    assert m.backend.weight_format == "float8_e4m3"
    assert "float16 1 matrix: shared.weight" in m.weight_formats


# -- bad files -----------------------------------------------------------------------------------
def rewrite(tmp_path, tensors, drop=(), **extra):
    kept = {k: v for k, v in tensors.items() if k not in drop}
    return write_safetensors(tmp_path / "bad.safetensors", {**kept, **extra})


def one_line_error(path, match, error=CheckpointError, **options):
    with pytest.raises(error, match=match) as e:
        minfer.load(path, **options)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_fp8_weights_without_their_scale_in_a_scaled_file(tmp_path):
    single, _ = fp8_file(tmp_path, {**SMALL, **V1_1},
                         scales=lambda k, w: np.array(0.01, np.float32))
    raw = stored_tensors(single)
    scales = {n[:-len(".weight")] + ".scale_weight": np.array(0.01, np.float32)
              for n, v in raw.items() if isinstance(v, tuple)}
    marker = {"scaled_fp8": ("F8_E4M3", np.zeros(0, np.uint8))}
    drop = "encoder.block.1.layer.0.SelfAttention.k.scale_weight"
    bad = write_safetensors(tmp_path / "bad.safetensors",
                            {**raw, **{k: v for k, v in scales.items() if k != drop}, **marker})
    msg = one_line_error(bad, r"tensor 'encoder.block.1.layer.0.SelfAttention.k.weight' is "
                              r"F8_E4M3 without its scale 'encoder.block.1.layer.0.SelfAttention."
                              r"k.scale_weight' in a scaled fp8 file")
    assert str(bad) in msg
    # a scale for a weight that is not fp8, a NaN scale, a scale of the wrong size
    for extra, match in [
            ({"encoder.final_layer_norm.scale_weight": np.array(2.0, np.float32)},
             "scales 'encoder.final_layer_norm.weight', which is F32, not fp8"),
            ({drop: np.array(np.nan, np.float32)}, "holds NaN: a scale must be finite"),
            ({drop: np.ones(5, np.float32)}, "must be a float32 scale .one value, or one per row")]:
        bad = write_safetensors(tmp_path / "bad.safetensors", {**raw, **scales, **marker, **extra})
        one_line_error(bad, match)
    # without the mark, scales are tensors no T5 has
    bad = write_safetensors(tmp_path / "bad.safetensors", {**raw, **scales})
    one_line_error(bad, r"unexpected tensor '.*scale_weight' \(and \d+ more\): no part of the T5 "
                        "config inferred from its tensors")


def test_comfyuis_newer_quantised_layout_is_named_as_unsupported(tmp_path):
    tensors = encoder_tensors({**SMALL, **V1_1})
    scale = "encoder.block.0.layer.0.SelfAttention.k.weight_scale"
    one_line_error(rewrite(tmp_path, tensors, **{scale: np.ones((), np.float32)}),
                   "ComfyUI's newer quantised layout .* is not supported yet")


def test_shapes_that_no_t5_config_fits(tmp_path):
    tensors = encoder_tensors({**SMALL, **V1_1})
    q = "encoder.block.0.layer.0.SelfAttention.q.weight"
    one_line_error(rewrite(tmp_path, tensors, **{q: np.zeros((22, 24), np.float32)}),
                   rf"tensor '{q}' has shape \[22, 24\]: no T5 with d_model 24 .* and 4 heads")
    wi = "encoder.block.2.layer.1.DenseReluDense.wi_1.weight"
    msg = one_line_error(rewrite(tmp_path, tensors, **{wi: np.zeros((41, 24), np.float32)}),
                         rf"tensor '{wi}' has shape \[41, 24\], the T5 config inferred from its "
                         r"tensors implies \[40, 24\]")
    assert str(tmp_path / "bad.safetensors") in msg
    one_line_error(rewrite(tmp_path, tensors, drop=[k for k in tensors if ".block.1." in k]),
                   "encoder block 1 is missing")
    far = "encoder.block.1000000000000.layer.0.SelfAttention.q.weight"   # nothing sized by it
    one_line_error(rewrite(tmp_path, tensors, **{far: np.zeros((24, 24), np.float32)}),
                   "encoder block 1000000000000: more than 65536 blocks")
    one_line_error(rewrite(tmp_path, tensors, drop=["encoder.block.1.layer.0.SelfAttention.v.weight"]),
                   r"tensor 'encoder.block.1.layer.0.SelfAttention.v.weight' is missing \(the T5 "
                   r"config inferred from its tensors needs it\)")
    umt5 = encoder_tensors({**SMALL, **UMT5})
    one_line_error(rewrite(tmp_path, umt5,
                           drop=["encoder.block.2.layer.0.SelfAttention.relative_attention_bias.weight"]),
                   "block.2.layer.0.SelfAttention.relative_attention_bias.weight' is missing: some "
                   "blocks after block 0")


def test_files_that_are_no_t5_encoder(tmp_path):
    other = write_safetensors(tmp_path / "clip.safetensors", {
        "text_model.embeddings.token_embedding.weight": np.zeros((10, 4), np.float32)})
    msg = one_line_error(other, "not a T5 / UMT5 encoder in Hugging Face's names .* it holds "
                                "'text_model.embeddings.token_embedding.weight'")
    assert str(other) in msg
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(20))     # (GGUF files: test_gguf.py)
    one_line_error(tmp_path / "x.gguf", "x.gguf: GGUF version 0; minfer reads versions 2 and 3")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05" + bytes(3))
    one_line_error(tmp_path / "junk.safetensors", "junk.safetensors: truncated safetensors file")


@pytest.mark.parametrize("code", ["F8_E8M0", "F4", "C64", "float8"])
def test_an_unknown_dtype_is_named_with_its_tensor(tmp_path, code):
    tensors = encoder_tensors({**SMALL, **V1_1})
    name = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    bad = rewrite(tmp_path, tensors, **{name: (code, np.zeros((24, 40), np.uint8))})
    one_line_error(bad, rf"bad.safetensors: tensor '{name}': unsupported dtype '{code}'")


def test_options_a_single_file_refuses(tmp_path):
    single = write_safetensors(tmp_path / "e.safetensors", encoder_tensors({**SMALL, **V1_1}))
    one_line_error(single, "subfolder='x': .* is a single file", ConfigError, subfolder="x")
    one_line_error(single, "tokenizer=.*: no such folder", ConfigError, tokenizer=tmp_path / "none")
    one_line_error(single, "no tokenizer files", minfer.TokenizerError, tokenizer=tmp_path)
    m = minfer.load(single)
    with pytest.raises(minfer.InputError, match="has no tokenizer|needs a tokenizer"):
        m.embed("text")


# -- tokenizer= and the CLI ----------------------------------------------------------------------
def test_the_cli_embeds_with_a_single_file_and_its_tokenizer(tmp_path):
    """sentence-t5's encoder as one file, its tokenizer and config given apart: `minfer embed`
    prints the embeddings of the same weights loaded from a folder (mean pooling: a single file
    has no sentence-transformers head)."""
    src = FAMILY / "st_sentence_t5"
    single = shutil.copy(src / "model.safetensors", tmp_path / "sentence_t5.safetensors")
    toks = tmp_path / "tok"
    toks.mkdir()
    for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(src / name, toks / name)
    plain = tmp_path / "plain"      # the oracle: the encoder folder without modules.json
    plain.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, plain / name)
    texts = ["a photo of a cat", "two dogs"]
    want = minfer.load(plain, tokenizer=toks, compute="float32").embed(texts)
    result = CliRunner().invoke(cli, ["embed", "-m", str(single), "--tokenizer", str(toks),
                                      "--config", str(src), "--compute", "float32", *texts])
    assert result.exit_code == 0, result.output
    got = np.array([json.loads(line)["embedding"] for line in result.output.splitlines()])
    assert rel_err(got, want) <= 1e-6
    result = CliRunner().invoke(cli, ["embed", "-m", str(single), "hello"])
    assert result.exit_code == 1 and "tokenizer" in result.output
    result = CliRunner().invoke(cli, ["embed", "-m", str(single), "--tokenizer",
                                      str(tmp_path / "none"), "hello"])
    assert result.exit_code == 2 and "--tokenizer" in result.output


def test_info_says_what_the_file_became(tmp_path):
    single, _ = fp8_file(tmp_path, {**SMALL, **UMT5}, scales=lambda k, w: np.array(0.01, np.float32))
    result = CliRunner().invoke(cli, ["info", "-m", str(single)])
    assert result.exit_code == 0, result.output
    assert "single file fp8.safetensors, config inferred from its tensors" in result.output
    assert "F8_E4M3 x scale_weight -> kept as fp8 codes" in result.output
    result = CliRunner().invoke(cli, ["info", "-m", str(single), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "F8_E4M3 x scale_weight -> float32 products" in result.output


def test_a_single_file_model_pickles_as_its_recipe(tmp_path, monkeypatch):
    case = FAMILY / "st_sentence_t5"
    single = shutil.copy(case / "model.safetensors", tmp_path / "enc.safetensors")
    monkeypatch.chdir(tmp_path)
    m = minfer.load("enc.safetensors", config=str(case), tokenizer=str(case), compute="float32")
    assert m.load_recipe["model"] == str(single)
    assert m.load_recipe["config"] == str(case) and m.load_recipe["tokenizer"] == str(case)
    monkeypatch.chdir(ROOT)
    back = pickle.loads(pickle.dumps(m))
    np.testing.assert_array_equal(back.embed(["a text"]), m.embed(["a text"]))


def test_a_whole_t5_in_one_file_loads_its_decoder_when_asked(tmp_path):
    """A file with a decoder still loads as an encoder; parts="all" reads the whole model, as
    its folder does (v1.1: untied head; v1.0: tied)."""
    from factories import write_t5
    for name, flavour in (("v1_1", dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
                          ("v1_0", dict(feed_forward_proj="relu", tie_word_embeddings=True))):
        folder = write_t5(tmp_path / name, relative_attention_num_buckets=32,
                          relative_attention_max_distance=128, **flavour)
        single = shutil.copy(folder / "model.safetensors", tmp_path / f"{name}.safetensors")
        assert minfer.load(single).parts == ("encoder",)
        want = minfer.load(folder, compute="float32").generate(IDS.tolist(), max_new_tokens=6)
        got = minfer.load(single, parts="all", compute="float32").generate(IDS.tolist(),
                                                                          max_new_tokens=6)
        assert got == want
