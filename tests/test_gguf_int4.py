"""GGUF's 4-bit block types (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K) kept as grouped int4 ("int4g32" /
"int4g16": two unsigned codes a byte, a float32 scale and offset per group), exactly.

The oracle of every value is the gguf package's own dequantisation (gguf.quants.dequantize); the
oracle of the states is minfer on a folder of those dequantised float32 weights (as in
test_gguf.py, whose file writer and sizes these tests share). Products are compared with a
float64 product of the dequantised matrix."""
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import rel_err
from factories import t5_tensors
from test_gguf import IDS, KINDS, LONG, MASK, SIZES, blocks_of, oracle, write_gguf

import minfer
from minfer import kernels
from minfer.errors import ConfigError
from minfer.io.formats import FORMATS, SCALE_SUFFIX
from minfer.io.gguf import GGUFFile
from minfer.products import PackedWeight, wrap
from minfer_cli.main import cli

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

GROUP = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q3_K": 16, "Q2_K": 16}   # their (scale, offset) groups
WIDER = ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]                       # codes of 5 bits or more


def one_matrix(tmp_path, kind: str, rows: int = 70, K: int = 512, seed: int = 3):
    """A GGUF file holding one (rows, K) matrix of `kind` as its token embedding, and the
    float32 values gguf's dequantisation gives it."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, K)) / 16).astype(np.float32)
    raw = blocks_of(w, kind, rng)
    path = tmp_path / f"{kind}-{K}.gguf"
    writer = gguf.GGUFWriter(str(path), "t5encoder")
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, gguf.quants.dequantize(raw, Q[kind]).reshape(rows, K)


# -- the values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [*GROUP, *WIDER])
def test_the_4bit_types_are_presented_as_grouped_int4_exactly(tmp_path, kind):
    """read_stored in a grouped int4 format: two codes a byte and the (scale, offset) pairs
    whose q * scale + offset is gguf's float32, in the type's groups or finer ones (pairs
    repeated); a type with wider codes is not held (its float32 values instead)."""
    path, want = one_matrix(tmp_path, kind)
    f = GGUFFile(path)
    for group in (32, 16):
        fmt = FORMATS[f"int4g{group}"]
        f.present_as(fmt.name)
        held = kind in GROUP and GROUP[kind] % group == 0
        assert f.keeps("shared.weight", fmt) == held
        if not held:
            assert f.info("shared.weight").dtype == "F32"
            values, none = f.read_stored("shared.weight", rows=(3, 20))
            assert none is None and np.array_equal(values, want[3:20])
            continue
        assert f.info("shared.weight").dtype == fmt.file_code
        packed, params = f.read_stored("shared.weight", rows=(3, 20))
        assert packed.dtype == np.uint8 and packed.shape == (17, 256)
        assert params.dtype == np.float32 and params.shape == (17, 512 // group, 2)
        assert np.array_equal(fmt.decode(packed, params, (17, 512)), want[3:20])


def test_the_grouped_int4_encoding_of_float_weights():
    """dtype="int4g32" on float weights: per group offset = its least value, scale = its range
    / 15, q rounded to nearest in 0..15 (computed here from the rule)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[2, 32:64] = 0.5                                   # a constant group: scale 1, exact
    for group in (32, 16):
        fmt = FORMATS[f"int4g{group}"]
        arrays = fmt.encode("w", w)
        assert arrays["w"].shape == (6, 48) and arrays["w" + SCALE_SUFFIX].shape == (6, 96 // group, 2)
        g = w.reshape(6, -1, group)
        low = g.min(axis=2, keepdims=True)
        step = (g.max(axis=2, keepdims=True) - low) / np.float32(15)
        step[step == 0] = 1
        want = (np.rint((g - low) / step) * step + low).reshape(6, 96)
        got = fmt.decode(arrays["w"], arrays["w" + SCALE_SUFFIX], w.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        assert np.all(got[2, 32:64] == 0.5)


# -- products ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["numba", "numpy"])
@pytest.mark.parametrize("kind,K", [(k, 512) for k in GROUP] + [("Q4_0", 96), ("Q4_1", 160)])
def test_products_equal_the_dequantised_product(tmp_path, monkeypatch, kind, K, mode):
    """1, 5 and 64 rows (the compiled kernel, or NumPy), 65 and 200 (widened blocks and BLAS),
    and row lookups, in the type's group and (32-value types) in groups of 16; K = 96 / 160:
    a last block of 32 columns."""
    monkeypatch.setattr(kernels, "_mode", mode)
    path, want = one_matrix(tmp_path, kind, K=K)
    f = GGUFFile(path)
    rng = np.random.default_rng(6)
    for group in {GROUP[kind], 16}:
        fmt = FORMATS[f"int4g{group}"]
        f.present_as(fmt.name)
        packed, params = f.read_stored("shared.weight")
        scratch = np.empty(K * 9, np.float32)                  # several blocks of widened rows
        w = wrap(fmt, "w", {"w": packed, "w" + SCALE_SUFFIX: params}, np.float32, scratch,
                 kernels.compiled() if mode == "numba" else None)
        assert isinstance(w, PackedWeight) and w.shape == (70, K)
        assert (w.kernel is not None) == (mode == "numba")
        for M in (1, 5, 64, 65, 200):
            x = rng.standard_normal((M, K)).astype(np.float32)
            out = np.full((M, 70), np.nan, np.float32)
            w.matmul(np, x, out)
            assert rel_err(out, x.astype(np.float64) @ want.T.astype(np.float64)) < 1e-5, (group, M)
        ids = np.array([0, 69, 5, 5])
        rows = np.empty((4, K), np.float32)
        w.rows(np, ids, rows)
        assert np.array_equal(rows, want[ids])


# -- whole models ------------------------------------------------------------------------------------
MIXES = {**{k: (lambda n, k=k: k) for k in GROUP},
         "Q3_K_S": lambda n: "Q2_K" if n.endswith("q.weight") else "Q3_K",
         "Q4_0+F16": lambda n: "F16" if n == "shared.weight" else "Q4_0"}
FORMAT_OF = {"Q4_0": "int4g32", "Q4_1": "int4g32", "Q4_K": "int4g32", "Q3_K": "int4g16",
             "Q2_K": "int4g16", "Q3_K_S": "int4g16", "Q4_0+F16": "int4g32"}


@pytest.mark.parametrize("kind", ["v1_1", "umt5"])
@pytest.mark.parametrize("mix", MIXES)
def test_a_4bit_gguf_encoder_encodes_as_its_values(tmp_path, kernel_mode, kind, mix):
    config = {**SIZES, **KINDS[kind]}
    held = write_gguf(tmp_path / "enc.gguf", config, t5_tensors(config, seed=len(mix)),
                      MIXES[mix])
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32")
    m = minfer.load(tmp_path / "enc.gguf")
    assert m.backend.weight_format == FORMAT_OF[mix]
    for ids in (IDS, LONG):     # the kernels' rows, and BLAS on widened blocks
        mask = (ids != 0) | (np.arange(ids.shape[1]) == 0)
        assert rel_err(m.encode(ids, mask), want.encode(ids, mask)) <= 1e-4, ids.shape


def linear_bytes(m) -> int:
    """The bytes of every linear slot's arrays (stored matrix and its scales) the model holds."""
    total = 0
    for unit in m.params["encoder"].units:
        for name in unit.layout.linear:
            total += unit.resident[name].nbytes + unit.resident[name + SCALE_SUFFIX].nbytes
    embedding = m.params["embedding"]
    return total + embedding.stored.nbytes + embedding.scale.nbytes


@pytest.mark.parametrize("kind", ["Q4_0", "Q2_K"])
def test_4bit_weights_take_about_half_the_bytes_of_int8(tmp_path, kind):
    """Per matrix (N, K): N K / 2 bytes of codes and N K / G (scale, offset) pairs, where the
    grouped int8 of the same group holds N K bytes of q; the states are the same."""
    config = {**SIZES, **KINDS["v1_1"]}
    tensors = t5_tensors(config)
    write_gguf(tmp_path / "m.gguf", config, tensors, lambda n: kind)
    G = GROUP[kind]
    four = minfer.load(tmp_path / "m.gguf")
    eight = minfer.load(tmp_path / "m.gguf", dtype=f"int8g{G}")
    assert (four.backend.weight_format, eight.backend.weight_format) == (f"int4g{G}", f"int8g{G}")
    values = sum(w.size for n, w in tensors.items() if w.ndim == 2 and "relative" not in n)
    pairs = values // G * 2 * 4
    assert linear_bytes(four) == values // 2 + pairs
    assert linear_bytes(eight) == values + pairs
    assert linear_bytes(four) / linear_bytes(eight) < {32: 0.61, 16: 0.67}[G]
    assert sum(four.weight_plan.unit_bytes.values()) < 0.7 * sum(eight.weight_plan.unit_bytes.values())
    np.testing.assert_allclose(four.encode(IDS, MASK), eight.encode(IDS, MASK), rtol=0,
                               atol=1e-5 * np.abs(eight.encode(IDS, MASK)).max())


def test_info_says_what_each_tensor_became(tmp_path):
    config = {**SIZES, **KINDS["v1_1"]}
    write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), MIXES["Q3_K_S"])
    result = CliRunner().invoke(cli, ["info", "-m", str(tmp_path / "m.gguf")])
    assert result.exit_code == 0, result.output
    # k, v, o, wi_0, wi_1, wo (2 layers) and the embedding; q
    assert "Q3_K -> int4g16 (exact: q x scale + offset per group of 16): 13 matrices" in result.output
    assert "Q2_K -> int4g16 (exact: q x scale + offset per group of 16): 2 matrices" in result.output
    assert "cpu / int4g16" in result.output


def test_a_mix_keeps_each_slot_in_the_format_that_holds_it(tmp_path):
    """llama.cpp's Q4_K_M (Q6_K in v and wo): int4g32 for the slots of Q4_K sources, int8g16
    for those with a Q6_K source (q|k|v fused, wo), exact; fewer bytes than int8g16
    throughout. dtype="int8g16" still holds every slot in int8."""
    config = {**SIZES, **KINDS["umt5"]}
    mix = lambda n: "Q6_K" if n.endswith(("v.weight", "wo.weight")) else "Q4_K"   # noqa: E731
    held = write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), mix)
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32").encode(LONG)
    m = minfer.load(tmp_path / "m.gguf")
    assert m.backend.weight_format == "int4g32"
    # o, wi_0, wi_1 in 2 layers and the embedding; q, k, v and wo in 2 layers
    assert "int4g32 7 matrices; int8g16 8 matrices" in m.weight_formats
    assert rel_err(m.encode(LONG), want) <= 1e-4
    eight = minfer.load(tmp_path / "m.gguf", dtype="int8g16")
    assert "int8g16 15 matrices" in eight.weight_formats
    assert rel_err(eight.encode(LONG), want) <= 1e-4
    assert linear_bytes(m) < 0.85 * linear_bytes(eight)


def test_a_slot_of_blocks_and_floats_is_float(tmp_path):
    """A slot fusing a block-typed matrix with a float one (layer 0's q in F16 beside Q4_0 k
    and v) has no grouped form: float32, exact."""
    config = {**SIZES, **KINDS["v1_1"]}
    q0 = "encoder.block.0.layer.0.SelfAttention.q.weight"
    mix = lambda n: "F16" if n == q0 else "Q4_0"   # noqa: E731
    held = write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), mix)
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32").encode(LONG)
    m = minfer.load(tmp_path / "m.gguf")
    assert m.backend.weight_format == "int4g32"
    assert "float32 3 matrices" in m.weight_formats and "int4g32 12 matrices" in m.weight_formats
    assert rel_err(m.encode(LONG), want) <= 1e-4


def test_compute_int8_is_refused_for_4bit_blocks(tmp_path):   # (no int8 product of them)
    config = {**SIZES, **KINDS["v1_1"], "vocab_size": 64}
    write_gguf(tmp_path / "m.gguf", config, t5_tensors(config), MIXES["Q4_0"])
    with pytest.raises(ConfigError, match=r"holds GGUF blocks, which load exactly as int4g32 "
                       r"\(int4 per group of 32, with offsets\)") as e:
        minfer.load(tmp_path / "m.gguf", compute="int8")
    assert "\n" not in str(e.value)


def test_4bit_layers_stream_under_a_memory_limit(tmp_path):
    config = {**SIZES, **KINDS["umt5"], "num_layers": 4}
    write_gguf(tmp_path / "e.gguf", config, t5_tensors(config), MIXES["Q4_K"])
    mask = np.ones(LONG.shape, bool)
    want = minfer.load(tmp_path / "e.gguf").encode(LONG, mask)
    m = minfer.load(tmp_path / "e.gguf", memory_limit="8MiB", workspace="6MiB")
    assert m.backend.weight_format == "int4g32"
    assert dict(m.weight_plan.summary())["streamed layers"].startswith("4 units through 2 slots")
    np.testing.assert_array_equal(m.encode(LONG, mask), want)


@pytest.mark.parametrize("kind", ["v1_0", "umt5"])
def test_a_whole_4bit_t5_generates_as_its_values(tmp_path, kind):
    """Architecture t5 with a decoder: one-row decoding steps through matmul_i4g, the (tied, in
    v1.0) head and the embedding's row lookups in int4g32."""
    config = {**SIZES, **KINDS[kind]}
    held = write_gguf(tmp_path / "t5.gguf", config, t5_tensors(config, "all"), MIXES["Q4_0"],
                      arch="t5")
    want = minfer.load(oracle(tmp_path, "f", config, held), compute="float32")
    m = minfer.load(tmp_path / "t5.gguf", parts="all")
    assert m.backend.weight_format == "int4g32"
    ids = IDS.tolist()
    assert m.generate(ids, max_new_tokens=8) == want.generate(ids, max_new_tokens=8)
    dec = np.array([[0, 3, 4, 9], [0, 5, 6, 7]])
    assert rel_err(m.forward(IDS, dec, MASK), want.forward(IDS, dec, MASK)) <= 1e-4
