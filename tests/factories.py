"""Test inputs written with NumPy (no torch): random T5 checkpoints in the HF layout, raw
safetensors files with whatever header a test needs, and calls run side by side in threads."""
import json
import math
import struct
import threading

import numpy as np
from safetensors.numpy import save_file

from minfer.models.t5 import T5Config
from minfer.models.t5.weights import weight_table

BASE = dict(model_type="t5", vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=32,
            num_layers=2, num_decoder_layers=2, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, feed_forward_proj="relu",
            tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            layer_norm_epsilon=1e-6)


def write_t5(folder, seed=0, extra_tensors=None, drop=(), **overrides):
    config = {**BASE, **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    cfg = T5Config.from_hf(config)
    tensors = {}
    for name, shape in weight_table(cfg).tensors.items():
        if name in drop:
            continue
        scale = 1.0 if name.endswith("layer_norm.weight") else shape[-1] ** -0.5
        tensors[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("layer_norm.weight"):
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# A T5 with 4 + 3 layers, big enough to stream (tests of params/ and convert)
SHAPE = dict(d_model=64, d_kv=16, num_heads=4, d_ff=256, num_layers=4, num_decoder_layers=3,
             vocab_size=200)
IDS = [[5, 6, 7, 8, 1], [9, 10, 1]]
DEC = [[0, 3, 4, 9], [0, 5, 6, 7]]


def write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None):
    """A safetensors file with exactly this header (and header length) and data."""
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def folder_with(tmp_path, tensors=None):
    """A model folder with a minimal config.json and, given tensors, a model.safetensors."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    if tensors is not None:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def t5_tensors(config: dict, parts: str = "encoder", seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the T5 `config` describes (its `parts`), in Hugging Face's
    names: norm gains near 1, matrices scaled by their fan-in."""
    cfg = T5Config.from_hf(config).with_parts(["decoder.x"], parts, "test")
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_table(cfg).tensors.items():
        if name.endswith("layer_norm.weight"):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
    return out


# -- fp8, from the definitions (tests and benchmarks: no ml_dtypes, no minfer) ---------------
def reference_fp8(code: int, fmt: str) -> float:
    """One fp8 code's value from the format's definition (integer significand x power of two)."""
    e_bits, m_bits = (4, 3) if fmt == "F8_E4M3" else (5, 2)
    bias = 2 ** (e_bits - 1) - 1
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> m_bits) & (2 ** e_bits - 1), code & (2 ** m_bits - 1)
    if fmt == "F8_E4M3" and code & 0x7F == 0x7F:
        return math.nan
    if fmt == "F8_E5M2" and e == 2 ** e_bits - 1:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - m_bits)
    return sign * math.ldexp(2 ** m_bits + m, e - bias - m_bits)


def encode_fp8(x: np.ndarray, fmt: str) -> np.ndarray:
    """float -> the fp8 code of the nearest finite value (a test's own encoder: no ml_dtypes)."""
    values = np.array([reference_fp8(c, fmt) for c in range(256)])
    finite = np.flatnonzero(np.isfinite(values))
    order = finite[np.argsort(values[finite], kind="stable")]
    table = values[order]
    at = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
    nearer = np.where(np.abs(x - table[at - 1]) <= np.abs(table[at] - x), at - 1, at)
    return order[nearer].astype(np.uint8)


def in_threads(calls):
    """Run each call in its own thread; their results (or exceptions) in order, and the
    threads (started)."""
    out = [None] * len(calls)

    def work(i, call):
        try:
            out[i] = call()
        except BaseException as e:   # (the test reads it)
            out[i] = e
    threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return out, threads
