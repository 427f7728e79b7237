"""fp8 weights kept as the file stores them: the float8_e4m3 / float8_e5m2 formats (io/formats.py),
their widening and products (kernels/widening.py, kernels/float_products.py) and an fp8 single
file or folder loading at one byte a weight (Checkpoint.read_fp8, params/loader.slot_formats).

Oracles: each code's value from the formats' definitions (test_single_file.reference_fp8), float64
products on those values, and minfer running float32 weights that are the file's dequantised
values (fp8 -> float, x scale, rounded to float32 as torch computes them) from a normal folder."""
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import rel_err
from test_single_file import (UMT5, V1_1, encoder_tensors, folder_of, fp8_file, reference_fp8,
                              stored_tensors, write_safetensors)

import minfer
from minfer import kernels, products
from minfer.errors import CheckpointError, ConfigError
from minfer.io.checkpoint import Checkpoint
from minfer.io.formats import FORMATS
from minfer.io.safetensors import SafetensorsFile
from minfer.kernels.registry import BY_FORMAT
from minfer_cli.main import cli

FP8 = {"F8_E4M3": "float8_e4m3", "F8_E5M2": "float8_e5m2"}
# inner sizes of at least 64 (products.KERNEL_MIN_INNER): the compiled kernels take the small
# products, BLAS over widened blocks the large ones
MID = dict(vocab_size=120, d_model=64, d_kv=16, num_heads=4, d_ff=96, num_layers=2,
           num_decoder_layers=2, relative_attention_num_buckets=32,
           relative_attention_max_distance=128, layer_norm_epsilon=1e-6, pad_token_id=0,
           eos_token_id=1, decoder_start_token_id=0)
RNG = np.random.default_rng(11)
SHORT = np.array([[5, 9, 17, 3, 44, 2, 1], [7, 8, 1, 0, 0, 0, 0]])       # 14 rows: kernels
LONG = RNG.integers(2, 120, (2, 40))                                       # 80 rows: BLAS
LONG[:, -1] = 1


def values_of(fmt: str) -> np.ndarray:
    return np.array([reference_fp8(c, fmt) for c in range(256)])


def finite_codes(fmt: str, shape) -> np.ndarray:
    values = values_of(fmt)
    codes = RNG.integers(0, 256, shape).astype(np.uint8)
    codes[~np.isfinite(values[codes])] = 0x38      # (1.0 in E4M3; a finite value in E5M2)
    return codes


def encodings(path, **options):
    m = minfer.load(path, **options)
    return m, [m.encode(ids, (ids != 0) | (np.arange(ids.shape[1]) == 0)) for ids in (SHORT, LONG)]


def close(got, want):
    """Within 1e-4 of the largest state (float32 sums in another order)."""
    return all(rel_err(g, w) <= 1e-4 for g, w in zip(got, want))


# -- the codes' widening and the products --------------------------------------------------------
@pytest.mark.parametrize("fmt", FP8)
def test_every_code_widens_to_its_value(fmt):
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    want = values_of(fmt).reshape(2, 128)
    nan = np.isnan(want)
    for widen in (BY_FORMAT[FP8[fmt]].widen, FORMATS[FP8[fmt]].widen):   # compiled, NumPy
        got = np.empty((2, 128), np.float32)
        widen(codes, got)
        assert (np.isnan(got) == nan).all()
        np.testing.assert_array_equal(got[~nan].astype(np.float64), want[~nan])
        assert (np.signbit(got[~nan]) == np.signbit(want[~nan])).all()     # -0 too
    x = np.zeros((1, 64), np.float32)                  # in registers: a row of one code
    x[0, 0] = 1.0
    for code in np.flatnonzero(np.isfinite(want.reshape(-1))):
        out = np.empty((1, 1), np.float32)
        row = np.full((1, 64), code, np.uint8)
        BY_FORMAT[FP8[fmt]].product(x, row, np.ones(1, np.float32), out)
        assert out[0, 0] == want.reshape(-1)[code]


@pytest.mark.parametrize("M", [1, 4, 5, 12])
def test_a_nan_or_infinite_code_is_not_hidden_by_the_products(M):
    """(The loader refuses such files; with its checks off, the products still say so.)"""
    x = np.ones((M, 64), np.float32)
    for fmt, code, special in (("F8_E4M3", 0x38, (0x7F, 0xFF)), ("F8_E5M2", 0x3C, (0x7F, 0x7C))):
        w = np.full((3, 64), code, np.uint8)
        w[1, 5], w[2, 9] = special
        out = np.empty((M, 3), np.float32)
        BY_FORMAT[FP8[fmt]].product(x, w, np.ones(3, np.float32), out)
        want = x.astype(np.float64) @ values_of(fmt)[w].T
        np.testing.assert_array_equal(out, want.astype(np.float32))     # 64, NaN, NaN / inf


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("M", [1, 3, 4, 7, 8, 9, 64, 65, 300])
def test_products_are_the_codes_times_their_scales(fmt, M):
    """x @ (codes x scale).T through `products.wrap` as the loader wraps a slot: compiled
    kernels (M <= 64), widened blocks + BLAS (above), and NumPy alone."""
    N, K = 70, 192
    codes = finite_codes(fmt, (N, K))
    scale = RNG.uniform(0.001, 0.01, N).astype(np.float32)
    x = RNG.standard_normal((M, K)).astype(np.float32)
    want = x.astype(np.float64) @ (values_of(fmt)[codes] * scale[:, None].astype(np.float64)).T
    arrays = {"w": codes, "w_scale": scale}
    scratch = np.empty(products.scratch_bytes(FORMATS[FP8[fmt]], (N, K), np.float32) // 4,
                       np.float32)
    for compiled in (kernels.compiled(), None):
        w = products.wrap(FORMATS[FP8[fmt]], "w", arrays, np.float32, scratch, compiled)
        out = np.empty((M, N), np.float32)
        w.matmul(np, x, out)
        assert rel_err(out, want) <= 2e-6, compiled
    rows = np.array([3, 0, 69, 3])
    got = np.empty((4, K), np.float32)
    w.rows(np, rows, got)                               # the embedding's gathers
    np.testing.assert_array_equal(got, (values_of(fmt)[codes[rows]] * scale[rows, None]).astype(np.float32))


# -- a file loads compact and exact --------------------------------------------------------------
def per_tensor(k, w):          # ComfyUI's scalars, not powers of two
    return np.array(np.abs(w).max() / 448 * 1.037, np.float32)


def per_row(k, w):
    return (np.abs(w).max(axis=1) / 448 * RNG.uniform(1, 1.1, w.shape[0])).astype(np.float32)


def power_of_two(k, w):
    return np.array(2.0 ** np.ceil(np.log2(np.abs(w).max() / 448)), np.float32)


CASES = {"e4m3": ("F8_E4M3", None), "e5m2": ("F8_E5M2", None), "scaled": ("F8_E4M3", per_tensor),
         "scaled_rows": ("F8_E4M3", per_row), "scaled_pow2": ("F8_E4M3", power_of_two),
         "e5m2_scaled": ("F8_E5M2", per_tensor)}


def linear_bytes(m) -> tuple[int, int]:
    """(bytes, weights) of the linear slots as placed: each layer's layout arrays of its
    linear slots (codes and scales), and the embedding."""
    nbytes = weights = 0
    for stack in ("encoder",):
        for unit in m.params[stack].units:
            for slot, fmt in unit.layout.linear.items():
                for name in fmt.array_names(slot):
                    nbytes += unit.layout.entries[name].dtype.itemsize * int(
                        np.prod(unit.layout.entries[name].shape))
                out, inner = unit.layout.entries[slot].shape
                weights += out * inner
    emb = m.params["embedding"]
    nbytes += emb.stored.nbytes + (0 if emb.scale is None else emb.scale.nbytes)
    weights += emb.stored.size
    return nbytes, weights


@pytest.mark.parametrize("kind", ["t5", "umt5"])
@pytest.mark.parametrize("case", CASES)
def test_an_fp8_file_keeps_one_byte_a_weight_and_encodes_as_its_values(tmp_path, kind, case):
    code, scales = CASES[case]
    config = {**MID, **(V1_1 if kind == "t5" else UMT5)}
    single, folder = fp8_file(tmp_path, config, code, scales=scales)
    m, got = encodings(single)
    assert (m.backend.weight_format, m.backend.compute) == (FP8[code], "float32")
    assert "kept as fp8 codes" in dict(m.describe())["weights"]
    _, want = encodings(folder, compute="float32")          # float32: the dequantised values
    assert close(got, want)
    nbytes, weights = linear_bytes(m)
    rows = sum(u.layout.entries[s].shape[0] for u in m.params["encoder"].units
               for s in u.layout.linear) + m.params["embedding"].shape[0]
    assert nbytes == weights + 4 * rows                     # a byte a weight, a scale a row
    assert m.params["embedding"].stored.dtype == np.uint8
    # the same file widened: float32 holds every value, 4 bytes a weight
    wide = minfer.load(single, dtype="float32")
    assert sum(wide.weight_plan.unit_bytes.values()) > 3.5 * sum(m.weight_plan.unit_bytes.values())


def test_under_a_memory_limit_the_codes_stream_as_they_are(tmp_path):
    config = {**MID, **UMT5, "num_layers": 4}
    single, _ = fp8_file(tmp_path, config, scales=per_row)
    m, want = encodings(single)
    layers = sum(m.weight_plan.unit_bytes.values())
    workspace = 2 * max(m.plan(2, 40)["peak"], 1 << 16)
    fixed = m.weight_plan.fixed + m.weight_plan.scratch_bytes
    limited, got = encodings(single, memory_limit=fixed + workspace + layers // 2 + 8192,
                             workspace=workspace)
    plan = limited.weight_plan
    assert plan.streamed
    assert plan.unit_bytes == m.weight_plan.unit_bytes                   # the same packed bytes
    assert plan.slot_bytes == max(plan.unit_bytes.values())              # streamed as they are
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    f32 = minfer.load(single, dtype="float32", memory_limit="64MiB", workspace=workspace)
    assert sum(f32.weight_plan.unit_bytes.values()) > 3.5 * layers


def test_a_bfloat16_embedding_beside_scaled_fp8_keeps_its_own_format(tmp_path):
    """ComfyUI's scaled files keep the embedding in 16 bits: it stays bfloat16 (exact), the
    layers fp8."""
    config = {**MID, **V1_1}
    single, folder = fp8_file(tmp_path, config, scales=per_tensor)
    file = SafetensorsFile(single)         # every tensor, the scales and the mark included
    tensors = {n: (i.dtype, file.raw(n, False)) if i.dtype in FP8 else file.raw(n, False)
               for n, i in file.tensors.items()}
    emb = encoder_tensors(config)["shared.weight"]
    bf16 = (emb.view(np.uint32) >> 16).astype(np.uint16)
    tensors["shared.weight"] = bf16
    del tensors["shared.scale_weight"]
    write_safetensors(single, tensors)
    m, got = encodings(single)
    assert m.backend.weight_format == "float8_e4m3"
    assert m.params["embedding"].stored.dtype == np.uint16                 # bfloat16 bits
    assert "bfloat16 1 matrix: shared.weight" in m.weight_formats
    # the oracle: the dequantised folder with that embedding's bfloat16 values in float32
    values = Checkpoint(folder)
    exact = {n: values.read(n) for n in values.names()}
    exact["shared.weight"] = (bf16.astype(np.uint32) << 16).view(np.float32)
    _, want = encodings(folder_of(tmp_path, "oracle", config, exact), compute="float32")
    assert close(got, want)


def test_an_fp8_folder_loads_compact(tmp_path):
    config = {**MID, **UMT5}
    single, folder = fp8_file(tmp_path, config, "F8_E5M2")
    fp8_folder = folder_of(tmp_path, "fp8_folder", config, stored_tensors(single))
    m, got = encodings(fp8_folder)
    assert m.backend.weight_format == "float8_e5m2"
    assert close(got, encodings(folder, compute="float32")[1])


# -- options and refusals ------------------------------------------------------------------------
def one_line(error, match, *args, **options):
    with pytest.raises(error, match=match) as e:
        minfer.load(*args, **options)
    assert "\n" not in str(e.value)


def test_what_other_options_do_with_an_fp8_file(tmp_path):
    config = {**MID, **V1_1}
    single, folder = fp8_file(tmp_path, config, scales=power_of_two)
    _, want = encodings(folder, compute="float32")
    # dtype widens (exactly here: power-of-two scales); compute="bfloat16" keeps the codes
    for options in (dict(dtype="bfloat16"), dict(compute="bfloat16"), dict(dtype="float32")):
        m, got = encodings(single, **options)
        assert m.backend.weight_format == options.get("dtype", "float8_e4m3")
        if m.backend.compute == "float32":
            assert close(got, want)
    m = minfer.load(single, compute="int8")           # int8 quantises the widened rows
    assert m.backend.weight_format == "int8"
    one_line(ConfigError, "compute='int8' multiplies int8 or int4 weights, not dtype 'float8_e4m3'",
             single, dtype="float8_e4m3", compute="int8")
    one_line(ConfigError, "dtype 'float8_e5m2' keeps a file's F8_E5M2 weights .* holds no "
             "F8_E5M2 matrix", single, dtype="float8_e5m2")
    one_line(ConfigError, "dtype 'float8_e4m3' keeps a file's F8_E4M3 weights", folder,
             dtype="float8_e4m3")


def test_a_nan_code_is_named(tmp_path):
    single, _ = fp8_file(tmp_path, {**MID, **V1_1})
    tensors = stored_tensors(single)
    name = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    code, raw = tensors[name]
    raw = raw.copy()
    raw[5, 7] = 0xFF                                  # S.1111.111: E4M3's NaN
    tensors[name] = (code, raw)
    write_safetensors(single, tensors)
    one_line(CheckpointError, rf"{single}: tensor '{name}' holds NaN at \[5, 7\]", single)


def test_info_shows_each_kind_of_tensor(tmp_path):
    single, _ = fp8_file(tmp_path, {**MID, **UMT5}, scales=per_tensor)
    result = CliRunner().invoke(cli, ["info", "-m", str(single)])
    assert result.exit_code == 0, result.output
    line = next(s for s in result.output.splitlines() if s.startswith("weight formats"))
    # 2 layers x (q, k, v, o, wi_0, wi_1, wo) + the embedding
    assert "float8_e4m3 (codes, a float32 scale per row) 15 matrices" in line
    assert "other parameters float32" in line
    assert "device / dtype               cpu / float8_e4m3" in result.output


@pytest.mark.parametrize("code", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("rows, tokens", [(1, 9), (3, 100)])   # 9 rows: small M; 300: the panels
def test_bfloat16_compute_multiplies_the_codes_exactly(tmp_path, code, rows, tokens):
    # compute="bfloat16" on an fp8 file keeps one byte a weight and multiplies the codes' own
    # values (every fp8 value is a bfloat16): the same as widening the file to bfloat16 weights
    # first and computing in bfloat16, up to the order of the float32 sums
    if kernels.compiled() is None:
        pytest.skip("the compiled kernels are off")
    config = {**MID, **V1_1}
    single, _ = fp8_file(tmp_path, config, fmt=code, scales=power_of_two)   # (bfloat16 holds code x scale)
    ids = np.random.default_rng(0).integers(2, 110, (rows, tokens))
    kept = minfer.load(single, compute="bfloat16")
    assert (kept.backend.weight_format, kept.backend.compute) == (FP8[code], "bfloat16")
    widened = minfer.load(single, dtype="bfloat16", compute="bfloat16")
    exact = minfer.load(single, compute="float32")
    got, want, full = (np.asarray(m.encode(ids)) for m in (kept, widened, exact))
    # (another order of the sums can flip an activation's bfloat16 rounding in a later layer:
    # a few 1e-4; a second rounding of the weights moved these states by 2e-2)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert 0 < np.abs(got - full).max() <= 5e-2 * np.abs(full).max()   # bfloat16's rounding
    assert linear_bytes(kept)[0] < 0.6 * linear_bytes(widened)[0]   # one byte a weight, not 2


@pytest.mark.parametrize("code", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("M", [1, 5, 255, 256, 301])
def test_the_bfloat16_fp8_product_is_the_rounded_inputs_times_the_codes(code, M):
    # below 256 rows the float32 fp8 product on rounded inputs, from 256 the bfloat16 panels
    if kernels.compiled() is None:
        pytest.skip("the compiled kernels are off")
    rng = np.random.default_rng(M)
    N, K = 70, 130
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = finite_codes(code, (N, K))
    scale = (rng.random(N) + 0.5).astype(np.float32)
    rounded = products.round_to_bfloat16(np, x).astype(np.float64)
    want = rounded @ (values_of(code)[w].astype(np.float64) * scale[:, None]).T
    product, work_bytes = BY_FORMAT[FP8[code]].rounded["bfloat16"]
    builds = [product]
    if code == "F8_E4M3":   # (and the tiles a CPU without AVX512_BF16 runs)
        from minfer.kernels.bfloat16_products import bmatmul_e4m3_fallback
        builds.append(bmatmul_e4m3_fallback)
    for build in builds:
        got = np.full((M, N), np.nan, np.float32)
        build(x, w, scale, got, np.empty(work_bytes(M, K, 1), np.uint8))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
