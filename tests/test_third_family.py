"""docs/architecture.md's "How to add a model family", followed step by step (issue 31).

A third family is declared here, inside the test, with nothing changed in minfer/: "toy-lm", a
decoder-only LM small enough to check by hand. Its math, per position t of a row:

    m_t    = mean(E[x_0], ..., E[x_t])                      the causal running mean of embeddings
    x      = m_t; per layer: x = x + relu(rms(x) * ln @ W1.T) @ W2.T
    logits = (rms(x) * g) @ H.T                            H = E (tied) or lm_head

Its per-request decoding state (its "KV cache") is the running sum of the embeddings seen and
their count, held in an arena `BufferSet`. Each numbered section below is the doc's step of the
same number; the tests load the family through `minfer.load` and compare `generate` with a
plain NumPy reference of the same math. What the doc left unsaid and the generic code asked for
anyway is marked "not in the doc" where the declaration has to do it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pytest
from safetensors.numpy import save_file

import minfer
from minfer import ops
from minfer.arena import BufferSet, BufferSpec
from minfer.errors import ConfigError, InputError
from minfer.generation.protocol import DecodeState, DecodingModel, TokenIds
from minfer.models import config as model_config, registry
from minfer.models.base import Model
from minfer.models.config import MAX_COUNT, MAX_VOCAB, MAX_WIDTH, ConfigReader
from minfer.models.family import Family
from minfer.numerics import all_finite, non_finite, quiet
from minfer.params.table import Linear, Tensor, View, WeightTable


# =====================================================================================================
# 1. config.py: a frozen config class read through ConfigReader
# =====================================================================================================
@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int          # (not in the doc: Model.batch reads config.vocab_size to check ids)
    d_model: int
    d_ff: int
    n_layer: int
    eps: float
    tie_word_embeddings: bool
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ToyConfig":
        read = ConfigReader(cfg, source)
        vocab = read.get_int("vocab_size", maximum=MAX_VOCAB)
        return cls(vocab_size=vocab, d_model=read.get_int("d_model", maximum=MAX_WIDTH),
                   d_ff=read.get_int("d_ff", maximum=MAX_WIDTH),
                   n_layer=read.get_int("n_layer", maximum=MAX_COUNT),
                   eps=read.get_eps("rms_norm_eps", 1e-6),
                   tie_word_embeddings=read.get_bool("tie_word_embeddings", True),
                   eos_token_id=read.get_id("eos_token_id", None, vocab),
                   pad_token_id=read.get_id("pad_token_id", 0, vocab))

    def token_ids(self) -> TokenIds:
        return TokenIds(eos=(self.eos_token_id,), pad=self.pad_token_id)

    def describe(self) -> list[tuple[str, str]]:
        return [("family", f"toy-lm ({'tied' if self.tie_word_embeddings else 'separate'} head)"),
                ("layers", str(self.n_layer)),
                ("width", f"d_model {self.d_model}, d_ff {self.d_ff}"),
                ("vocab", str(self.vocab_size))]

    def summary(self) -> str:
        return f"layers={self.n_layer}, d_model={self.d_model}, vocab={self.vocab_size}"


# =====================================================================================================
# 2. weights.py: weight_table(cfg) -> WeightTable, Linear slots for what takes the weight format
# =====================================================================================================
def weight_table(cfg: ToyConfig) -> WeightTable:
    V, C, F = cfg.vocab_size, cfg.d_model, cfg.d_ff
    tensors: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, C), "norm.weight": (C,)}
    layers = []
    for i in range(cfg.n_layer):
        p = f"layers.{i}"
        tensors.update({f"{p}.norm.weight": (C,), f"{p}.fc1.weight": (F, C),
                        f"{p}.fc2.weight": (C, F)})
        layers.append({"ln": Tensor(f"{p}.norm.weight"), "w_in": Linear((f"{p}.fc1.weight",)),
                       "w_out": Linear((f"{p}.fc2.weight",))})
    optional = {}
    if cfg.tie_word_embeddings:
        # one (V, C) slot: the head multiplies by it, the embedding gathers its rows (as T5's)
        head = {"lm_head": Linear(("embed_tokens.weight",)), "embedding": View("lm_head")}
        optional["lm_head.weight"] = (V, C)    # a saved copy of the tied head
    else:
        tensors["lm_head.weight"] = (V, C)
        head = {"embedding": Linear(("embed_tokens.weight",)),
                "lm_head": Linear(("lm_head.weight",))}
    return WeightTable(tensors=tensors, fixed={**head, "final_ln": Tensor("norm.weight")},
                       stacks={"layers": layers}, optional=optional)


# =====================================================================================================
# 3. buffers.py: the run's arena buffers as BufferSets, and run_bytes
# =====================================================================================================
@dataclass
class DecodeBuffers(BufferSet):
    """A request's state for B rows (an arena hold) and its step's scratch: a step allocates
    nothing."""
    total: Any       # (B, C) the sum of the embeddings seen: the family's "KV cache"
    count: Any       # (B, 1) how many positions that sum holds
    ids: Any         # (B,) int64 the step's tokens, uploaded
    x: Any           # (B, C) the stream
    h: Any           # (B, C) normed input, then a layer's output
    ff: Any          # (B, F)
    logits: Any      # (B, V)
    rows: Any        # (B,) int64 a reorder's rows, uploaded
    moved: Any       # (B, C) a reorder's gathered sums
    moved_count: Any  # (B, 1)

    @classmethod
    def specs(cls, cfg: ToyConfig, B: int, dtype: Any) -> BufferSpec:
        C = cfg.d_model
        return {"total": ((B, C), dtype), "count": ((B, 1), dtype), "ids": ((B,), np.int64),
                "x": ((B, C), dtype), "h": ((B, C), dtype), "ff": ((B, cfg.d_ff), dtype),
                "logits": ((B, cfg.vocab_size), dtype), "rows": ((B,), np.int64),
                "moved": ((B, C), dtype), "moved_count": ((B, 1), dtype)}


@dataclass
class PromptScratch(BufferSet):
    """The prompt's pass (a scope inside start_decoding): B rows of P tokens."""
    ids: Any         # (B, P) int64
    keep: Any        # (B, P, 1) 1 for the positions summed (real, and not the last: step 0's)
    emb: Any         # (B, P, C)

    @classmethod
    def specs(cls, cfg: ToyConfig, B: int, P: int, dtype: Any) -> BufferSpec:
        return {"ids": ((B, P), np.int64), "keep": ((B, P, 1), dtype),
                "emb": ((B, P, cfg.d_model), dtype)}


def run_bytes(cfg: ToyConfig, dtype: Any, batch: int, input_len: int | None,
              max_new_tokens: int | None = None, compute: str = "float32",
              repeat: int = 1) -> dict[str, int]:
    # (not in the doc: Model.load calls this with input_len=None and max_new_tokens=None, and
    # every caller reads the "peak" key; compute: the backend's compute mode, and repeat: rows
    # per prompt, unused here)
    state = DecodeBuffers.nbytes(cfg, batch, dtype)
    prompt = PromptScratch.nbytes(cfg, batch, input_len or 1, dtype)
    return {"decode_state": state, "prompt_scratch": prompt, "peak": state + prompt}


# =====================================================================================================
# 4. family.py: the Family record
# =====================================================================================================
FAMILY = Family(name="toy-lm", model_types=("toy-lm",), config=ToyConfig,
                weight_table=weight_table, run_bytes=run_bytes, is_encoder_decoder=False,
                add_eos_to_prompt=False)


# =====================================================================================================
# 5. math.py: pure functions over be.xp, the placed parameters and the buffers, through ops
# =====================================================================================================
def reorder_state(be: Any, buf: DecodeBuffers, b: int, rows: np.ndarray) -> None:
    """Rows `rows` of the first b rows' sums become rows 0..n-1 (rows leave, or spread)."""
    xp, n = be.xp, len(rows)
    be.upload(buf.rows[:n], rows)
    ops.take_into(xp, buf.total[:b], buf.rows[:n], 0, buf.moved[:n])
    ops.take_into(xp, buf.count[:b], buf.rows[:n], 0, buf.moved_count[:n])
    buf.total[:n] = buf.moved[:n]
    buf.count[:n] = buf.moved_count[:n]


def start_state(be: Any, cfg: ToyConfig, params: dict, ids: np.ndarray, mask: np.ndarray,
                buf: DecodeBuffers, scratch: PromptScratch, repeat: int) -> None:
    """Sum each row's prompt embeddings but its last real token (step 0 reads that one), then
    spread input i over rows i * repeat .. i * repeat + repeat - 1."""
    xp, B = be.xp, ids.shape[0]
    lengths = mask.sum(axis=1)
    keep = mask.astype(scratch.keep.dtype)
    keep[np.arange(B), lengths - 1] = 0
    be.upload(scratch.ids, ids)
    be.upload(scratch.keep, keep[..., None])
    ops.embed(xp, params["embedding"], scratch.ids, scratch.emb)
    xp.multiply(scratch.emb, scratch.keep, out=scratch.emb)
    scratch.emb.sum(axis=1, out=buf.total[:B])
    be.upload(buf.count[:B], (lengths - 1)[:, None].astype(buf.count.dtype))
    if repeat > 1:
        reorder_state(be, buf, B, np.repeat(np.arange(B), repeat))


def step_logits(be: Any, cfg: ToyConfig, params: dict, buf: DecodeBuffers, b: int,
                tokens: np.ndarray) -> Any:
    """One token per live row -> that position's logits (b, V), a view of buf.logits."""
    xp = be.xp
    x, h, ff = buf.x[:b], buf.h[:b], buf.ff[:b]
    be.upload(buf.ids[:b], tokens)
    ops.embed(xp, params["embedding"], buf.ids[:b], x)
    buf.total[:b] += x
    buf.count[:b] += 1
    xp.divide(buf.total[:b], buf.count[:b], out=x)      # the running mean
    for blk in params["layers"]:                          # a LayerStack: resident or streamed
        ops.rms_norm(xp, x, blk["ln"], cfg.eps, out=h)
        ops.linear(xp, h, blk["w_in"], out=ff)
        ops.relu_(xp, ff)
        ops.linear(xp, ff, blk["w_out"], out=h)
        x += h
    ops.rms_norm(xp, x, params["final_ln"], cfg.eps, out=h)
    return ops.linear(xp, h, params["lm_head"], out=buf.logits[:b])


# =====================================================================================================
# 6. model.py: a Model subclass with family = FAMILY and start_decoding
# =====================================================================================================
class ToyDecodeState(DecodeState):
    def __init__(self, model: "ToyModel", buf: DecodeBuffers, batch: int, max_len: int,
                 first_tokens: np.ndarray):
        self.model, self.be, self.buf = model, model.backend, buf
        self.batch, self.max_len, self.steps = batch, max_len, 0
        self.first_tokens = first_tokens

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self.steps >= self.max_len:
            raise InputError(f"decode state is full ({self.max_len} positions)")
        m = self.model
        with m.lock, quiet(), self.be.arena.scope():
            logits = step_logits(self.be, m.config, m.params, self.buf, self.batch,
                                 np.asarray(tokens, np.int64))
            out = np.asarray(self.be.to_host(logits), np.float32)
        self.steps += 1
        # (not in the doc: the protocol wants a state's own NaN / infinity raised as
        # NonFiniteError; nothing generic checks a family's scores)
        if not all_finite(np, out):
            raise non_finite(m, "logits", None)
        return out

    def reorder(self, rows: Sequence[int] | np.ndarray, cross: bool = True) -> None:
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or not 0 < len(rows) <= self.batch or rows.min() < 0 \
                or rows.max() >= self.batch:
            raise InputError(f"reorder: rows must be 1..{self.batch} indices below {self.batch}")
        with self.model.lock:
            reorder_state(self.be, self.buf, self.batch, rows)
        self.batch = len(rows)


class ToyModel(Model):
    """The toy LM: the shared façade plus its decoding state."""

    family = FAMILY

    @contextlib.contextmanager
    def start_decoding(self, input_ids: np.ndarray, attention_mask: np.ndarray, max_len: int,
                       repeat: int = 1) -> Iterator[ToyDecodeState]:
        be, cfg = self.backend, self.config
        B, P = input_ids.shape
        with self.lock:   # the request's own hold, released in any order
            buf, held = DecodeBuffers.hold(be.arena, cfg, B * repeat, be.dtype)
        try:
            with self.lock, quiet(), be.arena.scope():
                scratch = PromptScratch.allocate(be.arena, cfg, B, P, be.dtype)
                start_state(be, cfg, self.params, input_ids, attention_mask, buf, scratch, repeat)
            last = input_ids[np.arange(B), attention_mask.sum(axis=1) - 1]
            yield ToyDecodeState(self, buf, B * repeat, max_len, np.repeat(last, repeat))
        finally:
            held.release()


# =====================================================================================================
# 7. registration, and 8. a small random checkpoint with a reference (NumPy, no torch)
# =====================================================================================================
@pytest.fixture
def toy_registered(monkeypatch):
    """The class registered for this test only, as step 7 says for a family outside the tree
    (registry.register); the tables it extends are copies, put back after the test."""
    monkeypatch.setattr(registry, "MODEL_TYPES", dict(registry.MODEL_TYPES))
    monkeypatch.setattr(model_config, "ARCHITECTURE_TYPES", list(model_config.ARCHITECTURE_TYPES))
    registry.register(ToyModel, architectures=(("ToyLM", "toy-lm"),))
    return ToyModel


SIZES = {"vocab_size": 96, "d_model": 64, "d_ff": 128, "n_layer": 4}
PROMPTS = [[5, 17, 3], [40], [7, 7, 60, 2, 33], [90, 1, 12]]
NEW = 10


def toy_weights(tied: bool, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    V, C, F, L = (SIZES[k] for k in ("vocab_size", "d_model", "d_ff", "n_layer"))
    w = {"embed_tokens.weight": rng.normal(0, 1, (V, C)),
         "norm.weight": rng.uniform(0.5, 1.5, C)}
    for i in range(L):
        w[f"layers.{i}.norm.weight"] = rng.uniform(0.5, 1.5, C)
        # (twice the usual scale: the layers, not the running mean, pick most tokens)
        w[f"layers.{i}.fc1.weight"] = rng.normal(0, 2 * C ** -0.5, (F, C))
        w[f"layers.{i}.fc2.weight"] = rng.normal(0, 2 * F ** -0.5, (C, F))
    if not tied:
        w["lm_head.weight"] = rng.normal(0, C ** -0.5, (V, C))
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_checkpoint(folder, weights: dict[str, np.ndarray], tied: bool, eos: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "toy-lm", **SIZES, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": tied, "eos_token_id": eos, "pad_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))


def dequantised(w: np.ndarray) -> np.ndarray:
    """What an int8 slot multiplies by: per output row, absmax / 127 steps, round half even."""
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    return (np.clip(np.rint(w / scale), -127, 127) * scale).astype(np.float32)


def reference_logits(w: dict[str, np.ndarray], tied: bool, seq: Sequence[int]) -> np.ndarray:
    """The toy LM's logits after `seq`, in plain NumPy."""
    def rms(x, g):
        return x / np.sqrt(np.mean(x * x) + np.float32(1e-6)) * g
    E = w["embed_tokens.weight"]
    x = E[list(seq)].mean(axis=0)
    for i in range(SIZES["n_layer"]):
        h = rms(x, w[f"layers.{i}.norm.weight"])
        x = x + np.maximum(h @ w[f"layers.{i}.fc1.weight"].T, 0) @ w[f"layers.{i}.fc2.weight"].T
    return rms(x, w["norm.weight"]) @ (E if tied else w["lm_head.weight"]).T


def reference_greedy(w: dict[str, np.ndarray], tied: bool, prompt: list[int], n: int,
                     eos: int | None) -> list[int]:
    seq, new = list(prompt), []
    for _ in range(n):
        t = int(np.argmax(reference_logits(w, tied, seq)))
        seq.append(t)
        new.append(t)
        if t == eos:
            break
    return new


def as_int8(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights an int8 load computes with: every Linear source quantised, norms as they are."""
    return {k: dequantised(v) if v.ndim == 2 else v for k, v in w.items()}


def eos_for(w: dict[str, np.ndarray], tied: bool) -> int:
    """An eos that some row emits after its first new token and some other row never does, so
    the test sees rows end early while others run to max_new_tokens."""
    rows = [reference_greedy(w, tied, p, NEW, None) for p in PROMPTS]
    for t in (t for row in rows for t in row[1:]):
        if all(t not in row[:1] for row in rows) and any(t not in row for row in rows):
            return t
    raise AssertionError(f"no token fits as eos in {rows}")


@pytest.fixture(params=[True, False], ids=["tied", "separate-head"])
def toy(request, tmp_path, toy_registered):
    """(folder, float32 weights, tied, eos) of a written toy checkpoint."""
    tied = request.param
    w = toy_weights(tied)
    eos = eos_for(w, tied)
    write_checkpoint(tmp_path / "toy", w, tied, eos)
    return tmp_path / "toy", w, tied, eos


# =====================================================================================================
# The tests
# =====================================================================================================
def test_the_family_loads_through_minfer_load_and_describes_itself(toy):
    folder, w, tied, eos = toy
    with minfer.load(str(folder)) as m:
        assert type(m) is ToyModel and isinstance(m, DecodingModel)
        assert m.config == ToyConfig(96, 64, 128, 4, 1e-6, tied, eos, 0)
        assert m.parameter_count() == sum(a.size for a in w.values())
        assert dict(m.describe())["family"].startswith("toy-lm (")
        assert "layers=4, d_model=64, vocab=96" in repr(m)
        assert len(m.params["layers"]) == 4 and not m.weight_plan.streamed
        # the tied head is one slot under two names; a separate head is its own
        assert (m.params["embedding"] is m.params["lm_head"]) == tied
        plan = m.plan(2, 5, NEW)
        assert plan["peak"] == plan["decode_state"] + plan["prompt_scratch"] > 0


def test_a_config_without_model_type_is_read_by_its_architecture(toy):
    assert registry.model_class_of({"architectures": ["ToyLMForCausalLM"]}, "c") is ToyModel
    assert registry.model_class_of({"architectures": ["T5ForConditionalGeneration"]}, "c") \
        is minfer.T5Model


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_greedy_generation_matches_the_numpy_reference(toy, kernel_mode, dtype):
    folder, w, tied, eos = toy
    ref_w = as_int8(w) if dtype == "int8" else w
    want = [reference_greedy(ref_w, tied, p, NEW, eos) for p in PROMPTS]
    if dtype == "float32":   # (eos was chosen from the float32 run)
        assert any(row[-1] == eos and len(row) < NEW for row in want)   # a row ends early
    assert any(len(row) == NEW for row in want)   # and some rows run to max_new_tokens
    with minfer.load(str(folder), dtype=dtype) as m:
        arena = m.backend.arena
        before = arena.stats().used
        arena.reset_peak()
        got = m.generate(PROMPTS, max_new_tokens=NEW)
        assert got == want
        # what a run allocates stays within the family's plan: a decoder-only model's batches
        # hold one prompt length each, here 1 x 1, 2 x 3 and 1 x 5 tokens, all within 2 x 5
        assert arena.stats().used == before
        assert arena.stats().peak - before <= m.plan(2, 5, NEW)["peak"]


def test_step_logits_match_the_reference_for_a_padded_batch(toy):
    """start_decoding / step / reorder straight (the protocol), right-padded rows of different
    lengths in one batch, and rows leaving and repeating."""
    folder, w, tied, _ = toy
    with minfer.load(str(folder)) as m:
        idle = m.backend.arena.stats().used
        ids, mask = m.batch(PROMPTS)
        assert not mask.all()                      # padded
        with m.start_decoding(ids, mask, 4, repeat=2) as state:
            assert state.first_tokens.tolist() == [p[-1] for p in PROMPTS for _ in range(2)]
            seqs = [list(p) for p in PROMPTS for _ in range(2)]
            logits = state.step(state.first_tokens)
            for row, seq in zip(logits, seqs):
                np.testing.assert_allclose(row, reference_logits(w, tied, seq), rtol=1e-4,
                                           atol=1e-4)
            keep = np.array([6, 1, 2])              # rows leave, and out of order
            state.reorder(keep)
            seqs = [seqs[i] + [t] for i, t in zip(keep, (11, 12, 13))]
            logits = state.step(np.array([11, 12, 13]))
            for row, seq in zip(logits, seqs):
                np.testing.assert_allclose(row, reference_logits(w, tied, seq), rtol=1e-4,
                                           atol=1e-4)
            with pytest.raises(InputError, match="reorder: rows"):
                state.reorder(np.array([3]))
        assert m.backend.arena.stats().used == idle   # the state's hold was given back


def test_int8_layers_stream_under_a_memory_limit(toy):
    folder, w, tied, eos = toy
    want = [reference_greedy(as_int8(w), tied, p, NEW, eos) for p in PROMPTS]
    workspace = 256 << 10
    with minfer.load(str(folder), dtype="int8") as whole:
        plan = whole.weight_plan
        assert not plan.streamed
    # room for the fixed weights, two streaming slots, one resident layer and the workspace
    layer = max(plan.unit_bytes.values())
    limit = plan.fixed + plan.scratch_bytes + workspace + 3 * layer
    with minfer.load(str(folder), dtype="int8", memory_limit=limit, workspace=workspace) as m:
        assert m.weight_plan.streamed and m.weight_plan.resident
        assert m.backend.arena.capacity == limit
        assert m.generate(PROMPTS, max_new_tokens=NEW) == want
        assert m.backend.arena.stats().peak <= limit


def test_convert_and_info_go_through_the_registry(toy, tmp_path):
    """`minfer convert --dtype int8` quantises exactly the table's Linear sources; the converted
    folder loads as its own int8 bytes and generates the same; `minfer info` prints the family."""
    from minfer.convert import convert
    from minfer.io.checkpoint import Checkpoint
    import contextlib as cl
    import io
    import re

    from minfer_cli.main import main
    folder, w, tied, eos = toy
    out = tmp_path / "toy-int8"
    convert(str(folder), str(out), "int8")
    ckpt = Checkpoint(out)
    assert ckpt.quantised_format() == "int8"
    quantised = {n for n in ckpt.names() if ckpt.info(n).dtype == "I8"}
    assert quantised == {n for n, a in w.items() if a.ndim == 2}
    with minfer.load(str(out)) as m:
        assert m.backend.weight_format == "int8"
        assert m.generate(PROMPTS, max_new_tokens=NEW) == \
            [reference_greedy(as_int8(w), tied, p, NEW, eos) for p in PROMPTS]
    text, err = io.StringIO(), io.StringIO()
    code = 0
    with cl.redirect_stdout(text), cl.redirect_stderr(err):
        try:
            main(["info", "--model", str(folder), "--src-len", "5", "--max-new-tokens", "8"])
        except SystemExit as e:
            code = e.code
    assert code in (0, None), err.getvalue()
    # "key<padding>  value" lines (keys hold single spaces only)
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.getvalue().splitlines())
    assert lines["family"].startswith("toy-lm (")
    assert lines["parameters"] == f"{sum(a.size for a in w.values()):,}"
    assert lines["layer weights"].endswith("in 4 units: layers 4")
    assert lines["fits"].startswith("yes")


def test_a_bad_config_is_one_line_naming_the_field(toy):
    folder, *_ = toy
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "d_ff": 0}))
    with pytest.raises(ConfigError, match=r"config\.json: 'd_ff' must be an integer"):
        minfer.load(str(folder))


def test_a_checkpoint_that_does_not_fit_the_table_is_refused_by_the_generic_loader(toy):
    folder, w, tied, eos = toy
    bad = dict(w)
    bad["layers.2.fc1.weight"] = bad["layers.2.fc1.weight"][:, :32].copy()
    write_checkpoint(folder, bad, tied, eos)
    with pytest.raises(minfer.CheckpointError, match="layers.2.fc1.weight' has shape"):
        minfer.load(str(folder))


def test_the_same_math_runs_on_the_strict_cuda_stand_in(toy, strict_cuda):
    """Step 5's "no numpy-only math": the declared family runs on the device path unchanged, its
    device work allocating nothing outside the arena, within its plan, beams included."""
    folder, w, tied, eos = toy
    want = [reference_greedy(w, tied, p, NEW, eos) for p in PROMPTS]
    with minfer.load(str(folder)) as cpu:
        beams = cpu.generate(PROMPTS[2], max_new_tokens=6, num_beams=3)
    with minfer.load(str(folder), device="cuda", dtype="float32") as m:
        assert m.backend.device == "cuda:0" and m.backend.xp is not np
        arena = m.backend.arena
        for run, expected, (rows, length, new) in (
                (lambda: m.generate(PROMPTS, max_new_tokens=NEW), want, (2, 5, NEW)),
                (lambda: m.generate(PROMPTS[2], max_new_tokens=6, num_beams=3), beams, (3, 5, 6))):
            arena.reset_peak()
            base = arena.used
            strict_cuda.STATE.outside, strict_cuda.STATE.counting_outside = 0, True
            got = run()
            strict_cuda.STATE.counting_outside = False
            assert got == expected and strict_cuda.STATE.outside == 0
            assert arena.used == base
            assert arena.stats().peak - base <= m.plan(rows, length, new)["peak"]
