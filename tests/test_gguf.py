"""GGUF files of T5 / UMT5 models as llama.cpp's convert_hf_to_gguf.py writes them (architecture
t5encoder, or t5 with a decoder), written here with the gguf package's GGUFWriter: its quantise
functions for the 32-value block types, and random blocks in their byte layout for the K-quants
(which gguf-py cannot quantise).

The oracle of every value is the gguf package's own dequantisation (gguf.quants.dequantize, the
float32 that llama.cpp's reference computes); the oracle of the states is minfer on a normal folder
holding those dequantised float32 weights with their config.json (a path checked against
transformers by test_t5_parity.py). No second rounding is allowed: the states agree within 1e-4
of the largest."""
import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT, rel_err
from factories import t5_tensors

import minfer
from minfer import products
from minfer.errors import CheckpointError, ConfigError
from minfer.io.formats import FORMATS
from minfer.io.gguf import GGUFFile, gguf_name
from minfer.kernels.float_products import matmul_i8g
from minfer.models.t5 import T5Config
from minfer.models.t5.weights import weight_table
from minfer_cli.main import cli

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# sizes whose every matrix holds whole K-quant super-blocks (256 values a row)
SIZES = dict(vocab_size=600, d_model=256, d_kv=64, num_heads=4, d_ff=512, num_layers=2,
             num_decoder_layers=2, relative_attention_num_buckets=32,
             relative_attention_max_distance=128, layer_norm_epsilon=1e-6, pad_token_id=0,
             eos_token_id=1, decoder_start_token_id=0)
KINDS = {"v1_0": dict(model_type="t5", feed_forward_proj="relu", tie_word_embeddings=True),
         "v1_1": dict(model_type="t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False),
         "umt5": dict(model_type="umt5", feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False)}
BLOCKS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# where each K-quant block keeps its float16 d (and dmin), and the largest |sc x q| (with the
# min's share) its integers reach: random blocks get d = 2 / sqrt(in) / that
K_QUANT_HALVES = {"Q2_K": ((80, 82), 60), "Q3_K": ((108,), 128), "Q4_K": ((0, 2), 1900),
                  "Q5_K": ((0, 2), 3900), "Q6_K": ((208,), 4096)}
IDS = np.array([[5, 9, 17, 3, 44, 2, 1], [7, 8, 1, 0, 0, 0, 0]])
MASK = (IDS != 0) | (np.arange(7) == 0)
LONG = np.random.default_rng(9).integers(2, 600, (2, 40))     # 80 rows: the widened BLAS path


# -- writing GGUF files ----------------------------------------------------------------------------
def blocks_of(w: np.ndarray, kind: str, rng) -> np.ndarray:
    """A float matrix (rows, K) as `kind`'s blocks (rows, bytes): gguf's quantiser, or random
    blocks of the K-quant's layout with sane float16 scales."""
    qtype = Q[kind]
    if kind not in K_QUANT_HALVES:
        return gguf.quants.quantize(w, qtype)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, K = w.shape
    raw = rng.integers(0, 256, (rows, K // values, nbytes), dtype=np.uint8)
    at, top = K_QUANT_HALVES[kind]
    d = (2.0 / np.sqrt(K) / top * rng.uniform(0.5, 1.0, (rows, K // values))).astype(np.float16)
    for a in at:
        raw[:, :, a:a + 2] = d.view(np.uint8).reshape(rows, K // values, 2)
    return raw.reshape(rows, -1)


def ggufs_name(name: str) -> str:
    """The GGUF name gguf's own tensor_mapping gives a Hugging Face T5 tensor name (what
    convert_hf_to_gguf.py writes), independent of minfer's mapping."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5, 64)
    return names.get_name(name, try_suffixes=(".weight",)) or name


def write_gguf(path, config: dict, tensors: dict, kind_of, arch="t5encoder", metadata=None,
               seed=0, vocabulary=None):
    """Write `tensors` (Hugging Face names, float32) as GGUF under gguf's names: each matrix in
    `kind_of(name)` ("F32", "F16", "BF16" or a block type), vectors and position-bias tables F32
    (F16 in an F16 file). Returns the values as the file holds them (gguf's dequantisation), in
    Hugging Face's names."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(config["d_model"])
    w.add_feed_forward_length(config["d_ff"])
    w.add_block_count(config["num_layers"])
    w.add_head_count(config["num_heads"])
    w.add_key_length(config["d_kv"])
    w.add_value_length(config["d_kv"])
    w.add_relative_attn_buckets_count(config["relative_attention_num_buckets"])
    w.add_layer_norm_eps(config["layer_norm_epsilon"])
    w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    if arch == "t5":
        w.add_decoder_block_count(config["num_decoder_layers"])
        w.add_decoder_start_token_id(config["decoder_start_token_id"])
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value)
    if vocabulary is not None:   # (writes the tokenizer.ggml.* keys: test_gguf_vocab.py)
        vocabulary(w)
    held = {}
    for name, a in tensors.items():
        kind = kind_of(name) if a.ndim == 2 else "F32"
        if is_bias(name):   # never quantised by llama.cpp; float16 in an F16 file
            kind = "F16" if kind == "F16" else "F32"
        if kind == "F32":
            w.add_tensor(ggufs_name(name), a)
            held[name] = a
        elif kind == "F16":
            w.add_tensor(ggufs_name(name), a.astype(np.float16))
            held[name] = a.astype(np.float16).astype(np.float32)
        else:
            raw = blocks_of(a, kind, rng)
            w.add_tensor(ggufs_name(name), raw, raw_dtype=Q[kind])
            held[name] = gguf.quants.dequantize(raw, Q[kind]).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def is_bias(name: str) -> bool:
    return "relative_attention_bias" in name


def oracle(tmp_path, name, config, held) -> minfer.T5Model:
    """minfer on a folder of the file's values in float32, with their config.json."""
    from safetensors.numpy import save_file
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in held.items()},
              str(folder / "model.safetensors"))
    return folder


def one_line_error(path, match, error=CheckpointError, **options):
    with pytest.raises(error, match=match) as e:
        minfer.load(path, **options)
    assert "\n" not in str(e.value)
    return str(e.value)


# -- the names ------------------------------------------------------------------------------------
def test_names_are_ggufs_own_mapping():
    """Every tensor of every T5 kind, encoder and decoder: the GGUF name is what gguf's
    tensor_mapping gives the Hugging Face name, and it maps back."""
    from minfer.io.gguf import hf_name
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5, SIZES["num_layers"])
    for kind in KINDS.values():
        cfg = T5Config.from_hf({**SIZES, **kind}).with_parts(["decoder.x"], "all", "test")
        table = weight_table(cfg)
        gated = kind["feed_forward_proj"].startswith("gated")
        for name in [*table.tensors, *table.optional]:
            if name.endswith("embed_tokens.weight"):     # aliases of shared.weight
                continue
            want = names.get_name(name, try_suffixes=(".weight",))
            assert want is not None and gguf_name(name) == want, name
            assert hf_name(want, gated) == name


# -- the values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", *BLOCKS])
def test_every_type_reads_as_ggufs_dequantisation(tmp_path, kind):
    """read(): the float32 gguf's dequantisation gives, exactly (a zero may differ in its sign:
    d * 0 with d < 0 is -0 there, 0 * d + 0 here); read_stored(): q and the (scale, offset)
    pairs whose q * scale + offset is that float32, in groups of 16 too."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 512)) / 16).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "t5encoder")
    if kind in ("F32", "F16"):
        raw = w.astype(np.float32 if kind == "F32" else np.float16)
        writer.add_tensor("token_embd.weight", raw)
        want = raw.astype(np.float32)
    else:
        raw = gguf.quants.quantize(w, Q.BF16) if kind == "BF16" else blocks_of(w, kind, rng)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=Q[kind])
        want = gguf.quants.dequantize(raw, Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.names() == ["shared.weight"] and f.info("shared.weight").shape == (24, 512)
    got = f.read("shared.weight")
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(f.read("shared.weight", rows=(5, 9)), want[5:9])
    if kind not in BLOCKS:
        return
    for group in (32, 16):
        fmt = FORMATS[f"int8g{group}"]
        f.present_as(fmt.name)
        if f.info("shared.weight").dtype != fmt.file_code:
            assert group == 32 and kind in ("Q2_K", "Q3_K", "Q6_K")   # 16-value groups
            continue
        q, params = f.read_stored("shared.weight", rows=(3, 20))
        assert q.dtype == np.int8 and params.shape == (17, 512 // group, 2)
        values = fmt.decode(q, params, (17, 512))
        assert np.array_equal(values, want[3:20])


def test_the_grouped_product_kernel_equals_float64(tmp_path):
    rng = np.random.default_rng(2)
    for group in (16, 32):
        fmt = FORMATS[f"int8g{group}"]
        stored = fmt.encode("w", rng.standard_normal((70, 96)).astype(np.float32))
        q, params = stored["w"], stored["w_scale"]
        params[..., 1] = rng.standard_normal(params.shape[:2]) / 10      # offsets too
        w = fmt.decode(q, params, (70, 96)).astype(np.float64)
        for M in (1, 3, 4, 9, 13):
            x = rng.standard_normal((M, 96)).astype(np.float32)
            out = np.zeros((M, 70), np.float32)
            matmul_i8g(x, q, params, out)
            assert rel_err(out, x @ w.T) < 1e-5, (group, M)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("M, K", [(1, 128), (9, 96), (256, 128), (263, 192), (260, 96)])
def test_the_int8_compute_kernel_multiplies_the_blocks_by_quantised_rows(group, M, K):
    # compute="int8" on GGUF's blocks: the blocks' own values (no second rounding) times the
    # inputs quantised per row; from 256 rows with K a multiple of 64 the panels, else the
    # quantised rows as float32 through matmul_i8g; both builds (VNNI and its fallback)
    from minfer.kernels.quantised_products import (grouped_work_bytes, qmatmul_i8g,
                                                   qmatmul_i8g_fallback)
    rng = np.random.default_rng(M + K + group)
    fmt = FORMATS[f"int8g{group}"]
    stored = fmt.encode("w", rng.standard_normal((70, K)).astype(np.float32))
    q, params = stored["w"], stored["w_scale"]
    params[..., 1] = rng.standard_normal(params.shape[:2]) / 10      # offsets too
    w = fmt.decode(q, params, (70, K)).astype(np.float64)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[M // 2, 5] = np.nan                                            # a NaN row stays NaN
    x[-1] = 0 if M > 1 else x[-1]                                    # a zero row stays 0
    want = products.quantise_rows(np, x).astype(np.float64) @ w.T
    for kernel in (qmatmul_i8g, qmatmul_i8g_fallback):
        out = np.full((M, 70), -7.0, np.float32)
        kernel(x, q, params, out, np.empty(grouped_work_bytes(M, K, K // group), np.uint8))
        assert np.isnan(out[M // 2]).all()
        ok = ~np.isnan(want[:, 0])
        assert not ok.any() or rel_err(out[ok], want[ok]) < 1e-5, (kernel, M, K)


@pytest.mark.parametrize("dtype", ["int8g32", "int8g16"])   # (int8g16 holds Q8_0 too)
def test_int8_compute_on_a_trained_t5s_blocks_gives_its_answers(tmp_path, dtype):
    # the trained tiny T5 (weights/tiny-t5-dates) as a whole-T5 GGUF: compute="int8" (the
    # blocks as they are, the inputs quantised per row; the encoder's 128-column products of
    # 200 prompts on the panels, the decoding steps' on the float32 path) answers as float32
    # compute on the same file on its held-out prompts
    from safetensors.numpy import load_file
    dates = ROOT / "weights" / "tiny-t5-dates"
    config = json.loads((dates / "config.json").read_text())
    tensors = {k: v.astype(np.float32) for k, v in load_file(str(dates / "model.safetensors")).items()
               if not k.endswith("embed_tokens.weight")}
    write_gguf(tmp_path / "dates.gguf", config, tensors, MIXES["Q8_0"], arch="t5")
    prompts = [json.loads(line)["prompt"] for line in
               (dates / "heldout.jsonl").read_text().splitlines()[:200]]
    load = dict(tokenizer=dates, parts="all", dtype=dtype)
    want = minfer.load(tmp_path / "dates.gguf", compute="float32", **load).generate(prompts)
    m = minfer.load(tmp_path / "dates.gguf", compute="int8", **load)
    assert (m.backend.compute, m.backend.weight_format) == ("int8", dtype)
    got = m.generate(prompts)
    assert np.mean([g == w for g, w in zip(got, want)]) >= 0.97


# -- whole models ----------------------------------------------------------------------------------
MIXES = {   # the files users hold: one type throughout, or llama.cpp's mixes
    **{b: (lambda n, b=b: b) for b in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K")},
    "Q4_K_M": lambda n: "Q6_K" if n.endswith(("v.weight", "wo.weight")) else "Q4_K",
    "Q3_K_S": lambda n: "Q2_K" if n.endswith("q.weight") else "Q3_K",
    "F16": lambda n: "F16", "BF16": lambda n: "BF16", "F32": lambda n: "F32",
    "Q8_0+F16": lambda n: "F16" if n == "shared.weight" else "Q8_0",
}
FORMAT_OF = {"Q4_K_M": "int4g32", "Q3_K_S": "int4g16", "Q4_0": "int4g32", "Q4_1": "int4g32",
             "F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# ("Q8_0+F16": the blocks int8g32, the F16 embedding float16; Q4_K_M: int4g32, the slots with a
# Q6_K source int8g16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mix", MIXES)
def test_a_gguf_encoder_encodes_as_its_values(tmp_path, kind, mix):
    config = {**SIZES, **KINDS[kind]}
    held = write_gguf(tmp_path / "enc.gguf", config, t5_tensors(config, seed=len(mix)),
                      MIXES[mix])
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32")
    m = minfer.load(tmp_path / "enc.gguf", compute="float32")    # (BF16's default: bfloat16)
    assert m.parts == ("encoder",) and m.config.model_type == config["model_type"]
    assert m.backend.weight_format == FORMAT_OF.get(mix, "int8g32")
    for ids in (IDS, LONG):     # the kernels' rows, and BLAS on widened blocks
        mask = (ids != 0) | (np.arange(ids.shape[1]) == 0)
        assert rel_err(m.encode(ids, mask), want.encode(ids, mask)) <= 1e-4, ids.shape


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_t5_generates_as_its_values(tmp_path, kind):
    """Architecture t5 (a decoder; v1.0's head tied, the others' not): an encoder by default,
    the whole model with parts="all", whose one-row decoding steps run the grouped kernels."""
    config = {**SIZES, **KINDS[kind]}
    held = write_gguf(tmp_path / "t5.gguf", config, t5_tensors(config, "all"),
                      MIXES["Q4_K_M"], arch="t5")
    assert minfer.load(tmp_path / "t5.gguf").parts == ("encoder",)
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32")
    m = minfer.load(tmp_path / "t5.gguf", parts="all")
    assert m.backend.weight_format == "int4g32"
    ids = IDS.tolist()
    assert m.generate(ids, max_new_tokens=8) == want.generate(ids, max_new_tokens=8)
    dec = np.array([[0, 3, 4, 9], [0, 5, 6, 7]])
    assert rel_err(m.forward(IDS, dec, MASK), want.forward(IDS, dec, MASK)) <= 1e-4


def test_the_weight_format_can_be_chosen(tmp_path):
    """dtype= overrides: int8g16 holds Q8_0's blocks exactly too (pairs repeated); float32 is
    exact; int8 re-quantises per channel (info says so); compute bfloat16 would round the
    blocks again and is refused unless a dtype is given; compute int8 keeps them."""
    config = {**SIZES, **KINDS["umt5"]}
    held = write_gguf(tmp_path / "q8.gguf", config, t5_tensors(config), MIXES["Q8_0"])
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32").encode(IDS, MASK)
    for dtype in ("int8g16", "float32"):
        m = minfer.load(tmp_path / "q8.gguf", dtype=dtype)
        assert m.backend.weight_format == dtype
        assert rel_err(m.encode(IDS, MASK), want) <= 1e-4, dtype
    m = minfer.load(tmp_path / "q8.gguf", dtype="int8")
    assert "Q8_0 -> int8 (rounded from its float32 values)" in m.config.source_note
    assert 1e-3 < rel_err(m.encode(IDS, MASK), want) < 0.5   # (random weights: ~10%)
    one_line_error(tmp_path / "q8.gguf", "compute='bfloat16': .*q8.gguf holds GGUF blocks, "
                   "which load exactly as int8g32", ConfigError, compute="bfloat16")
    assert minfer.load(tmp_path / "q8.gguf", dtype="int8", compute="int8").backend.compute == "int8"
    m = minfer.load(tmp_path / "q8.gguf", compute="int8")     # the blocks as they are, int8 inputs
    assert (m.backend.weight_format, m.backend.compute) == ("int8g32", "int8")


def test_the_grouped_format_quantises_a_float_checkpoint(tmp_path):
    """dtype="int8g32" on a float folder: per group of 32, scale absmax / 127, q rounded to
    nearest, no offset (the states of those values, computed here from the rule)."""
    config = {**SIZES, **KINDS["v1_1"]}
    tensors = t5_tensors(config)
    folder = oracle(tmp_path, "float", config, tensors)
    rounded = {}
    for name, w in tensors.items():
        if w.ndim == 2 and not is_bias(name):
            g = w.reshape(w.shape[0], -1, 32)
            d = np.abs(g).max(axis=2, keepdims=True) / np.float32(127)
            w = (np.rint(g / d) * d).reshape(w.shape).astype(np.float32)
        rounded[name] = w
    want = minfer.load(oracle(tmp_path, "rounded", config, rounded), compute="float32")
    m = minfer.load(folder, dtype="int8g32")
    assert rel_err(m.encode(IDS, MASK), want.encode(IDS, MASK)) <= 1e-4


def test_text_needs_the_tokenizer_folder(tmp_path):
    config = {**SIZES, **KINDS["v1_1"]}
    write_gguf(tmp_path / "e.gguf", config, t5_tensors(config), MIXES["Q8_0"])
    with pytest.raises(minfer.InputError, match="tokenizer"):
        minfer.load(tmp_path / "e.gguf").embed("a photo of a cat")
    toks = ROOT / "weights" / "tokenizers" / "tiny-t5"
    m = minfer.load(tmp_path / "e.gguf", tokenizer=toks)
    ids = m.tokenizer.encode("a photo of a cat")
    np.testing.assert_array_equal(m.encode("a photo of a cat"), m.encode(np.array([ids])))


def test_a_float_embedding_beside_blocks_keeps_its_own_format(tmp_path):
    """llama.cpp's --token-embedding-type f16 beside Q8_0 layers: the blocks stay one byte a
    weight (not the whole model in float32), the embedding float16, as info says."""
    config = {**SIZES, **KINDS["v1_1"]}
    held = write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), MIXES["Q8_0+F16"])
    m = minfer.load(tmp_path / "m.gguf")
    assert m.backend.weight_format == "int8g32"
    assert "float16 1 matrix: shared.weight" in m.weight_formats
    assert "int8g32 14 matrices" in m.weight_formats   # q, k, v, o, wi_0, wi_1, wo in 2 layers
    plain = minfer.load(tmp_path / "m.gguf", dtype="float32")
    assert sum(plain.weight_plan.unit_bytes.values()) > 3 * sum(m.weight_plan.unit_bytes.values())
    want = minfer.load(oracle(tmp_path, "f", config, held)).encode(IDS, MASK)
    assert rel_err(m.encode(IDS, MASK), want) < 1e-4
    result = CliRunner().invoke(cli, ["info", "-m", str(tmp_path / "m.gguf")])
    assert "F16 -> float16: 1 matrix" in result.output, result.output


def test_info_says_what_each_tensor_became(tmp_path):
    config = {**SIZES, **KINDS["v1_1"]}
    write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), MIXES["Q4_K_M"])
    result = CliRunner().invoke(cli, ["info", "-m", str(tmp_path / "m.gguf")])
    assert result.exit_code == 0, result.output
    assert "single file m.gguf, config inferred from its GGUF metadata and tensors" in result.output
    # o, wi_0, wi_1 (2 layers) and the embedding in int4; q and k fused with a Q6_K v (2
    # layers) in int8, as are v and wo
    assert "Q4_K -> int4g32 (exact: q x scale + offset per group of 32): 7 matrices" in result.output
    assert "Q4_K -> int8g16 (exact: q x scale + offset per group of 16): 4 matrices" in result.output
    assert "Q6_K -> int8g16 (exact: q x scale + offset per group of 16): 4 matrices" in result.output
    assert "cpu / int4g32" in result.output
    assert "int4g32 7 matrices; int8g16 8 matrices" in result.output


# -- files that are not what they claim --------------------------------------------------------------
def small_file(tmp_path, name="m.gguf", drop=(), metadata=None, mix="Q8_0", arch="t5encoder"):
    config = {**SIZES, **KINDS["v1_1"], "vocab_size": 64}
    tensors = {k: v for k, v in t5_tensors(config).items() if k not in drop}
    write_gguf(tmp_path / name, config, tensors, MIXES[mix], arch=arch, metadata=metadata)
    return tmp_path / name


def test_another_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(tmp_path / "llama.gguf", "llama.gguf: a GGUF file of architecture 'llama'; "
                   "minfer reads T5 / UMT5 models")


def test_an_unsupported_or_unknown_type_is_named_with_its_tensor(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "t5encoder")
    w.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(tmp_path / "iq.gguf", "tensor 'token_embd.weight' is IQ2_XXS: that "
                   "quantisation is not supported")
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    name = b"enc.blk.1.attn_k.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8      # past the rank and the two dimensions
    assert raw[at:at + 4] == int(Q.Q8_0).to_bytes(4, "little")
    raw[at:at + 4] = (77).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    one_line_error(path, "tensor 'enc.blk.1.attn_k.weight' has GGML type 77, which gguf .* does "
                   "not know")


def test_a_truncated_file(tmp_path):
    path = small_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    one_line_error(path, r"m.gguf: tensor 'enc.output_norm.weight' ends at byte \d+, past the end "
                   r"of the file \(\d+ bytes\): the file is truncated")
    path.write_bytes(raw[:200])
    one_line_error(path, "m.gguf: not a GGUF file gguf .* can read")
    path.write_bytes(b"\x05" * 64)
    one_line_error(path, "m.gguf: not a GGUF file")
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(64))
    one_line_error(path, "m.gguf: GGUF version 1; minfer reads versions 2 and 3")
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little")
                     + bytes(64))
    one_line_error(path, r"m.gguf: GGUF header claims 1099511627776 tensors")


def test_a_missing_tensor_and_shapes_no_config_fits(tmp_path):
    path = small_file(tmp_path, drop=("encoder.block.1.layer.0.SelfAttention.k.weight",))
    one_line_error(path, "m.gguf: tensor 'enc.blk.1.attn_k.weight' is missing")
    # metadata that disagrees with the shapes: 8 heads of 64 where the matrices have 4
    path = small_file(tmp_path, "heads.gguf", metadata={"t5encoder.attention.head_count": 8})
    one_line_error(path, r"heads.gguf: tensor 'enc.blk.0.attn_k.weight' has shape \[256, 256\], "
                   r"the T5 config inferred from its GGUF metadata and tensors implies "
                   r"\[512, 256\]")
    path = small_file(tmp_path, "zero.gguf", metadata={"t5encoder.attention.key_length": 0})
    one_line_error(path, "metadata 't5encoder.attention.key_length' is 0, expected a positive "
                   "integer")
    path = small_file(tmp_path, "bias.gguf",
                      drop=("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",))
    one_line_error(path, "bias.gguf: tensor 'enc.blk.0.attn_rel_b.weight' is missing: a T5 "
                   "encoder's block 0 holds the position bias")
    path = small_file(tmp_path, "layers.gguf", metadata={"t5encoder.block_count": 3})
    one_line_error(path, "layers.gguf: tensor 'enc.blk.2.attn_q.weight' is missing")


def test_the_cli_says_it_in_one_line(tmp_path):
    from test_cli import assert_one_line_error, run
    path = small_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    assert_one_line_error(run("info", "-m", str(path)), 1, "the file is truncated")


def test_without_the_gguf_package(tmp_path, monkeypatch):
    path = small_file(tmp_path)
    monkeypatch.setitem(sys.modules, "gguf", None)      # import gguf -> ImportError
    one_line_error(path, r"reading a GGUF file needs the gguf package .*minfer\[gguf\]")


def test_config_replaces_the_metadata(tmp_path):
    """config= (a folder with config.json) replaces what the metadata and shapes say: here
    another layer_norm_epsilon and max distance, which the states follow."""
    config = {**SIZES, **KINDS["v1_1"], "layer_norm_epsilon": 1e-3,
              "relative_attention_max_distance": 40}
    held = write_gguf(tmp_path / "e.gguf", config, t5_tensors(config), MIXES["Q8_0"])
    folder = oracle(tmp_path, "f", config, held)
    mask = np.ones(LONG.shape, bool)      # distances past 8: the max distance matters
    want = minfer.load(folder, compute="float32").encode(LONG, mask)
    assert rel_err(minfer.load(tmp_path / "e.gguf", config=folder).encode(LONG, mask), want) <= 1e-4
    assert rel_err(minfer.load(tmp_path / "e.gguf").encode(LONG, mask), want) > 1e-3


def test_layers_stream_under_a_memory_limit(tmp_path):
    """A limit below the four layers: they stream through two slots (their grouped int4 / int8
    bytes and pairs, as packed), and the states are the unlimited run's."""
    config = {**SIZES, **KINDS["umt5"], "num_layers": 4}
    write_gguf(tmp_path / "e.gguf", config, t5_tensors(config), MIXES["Q4_K_M"])
    want = minfer.load(tmp_path / "e.gguf").encode(LONG, np.ones(LONG.shape, bool))
    m = minfer.load(tmp_path / "e.gguf", memory_limit="8500KiB", workspace="6MiB")
    assert dict(m.weight_plan.summary())["streamed layers"].startswith("4 units through 2 slots")
    np.testing.assert_array_equal(m.encode(LONG, np.ones(LONG.shape, bool)), want)


def test_damaged_files_are_one_line_errors(tmp_path):
    """Bytes of a small file's header changed at random, and the file cut at random places:
    every load either works or is a one-line minfer error (never another exception), quickly."""
    import time
    config = {**SIZES, **KINDS["v1_1"], "vocab_size": 64, "num_layers": 1}
    write_gguf(tmp_path / "good.gguf", config, t5_tensors(config), MIXES["Q4_K_M"])
    good = (tmp_path / "good.gguf").read_bytes()
    header = gguf.GGUFReader(tmp_path / "good.gguf").data_offset
    rng = np.random.default_rng(5)
    bad = tmp_path / "bad.gguf"
    start, outcomes = time.perf_counter(), set()
    for trial in range(150):
        raw = bytearray(good)
        if trial % 3:
            for at in rng.integers(0, header, int(rng.integers(1, 4))):
                raw[at] = int(rng.integers(0, 256))
        else:
            del raw[int(rng.integers(0, len(raw))):]
        bad.write_bytes(bytes(raw))
        try:
            minfer.load(bad).encode(IDS[:, :3])
            outcomes.add("loaded")
        except minfer.MinferError as e:
            assert "\n" not in str(e), str(e)
            outcomes.add(type(e).__name__)
    assert "CheckpointError" in outcomes, outcomes
    assert time.perf_counter() - start < 60
