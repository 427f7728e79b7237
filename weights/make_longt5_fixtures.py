"""Build the tiny LongT5 test fixtures (transformers 4.57 as the oracle) for minfer.

What this makes
---------------
For every case in ``CASES`` a folder ``weights/longt5/<case>/``: ``config.json`` and
``model.safetensors`` as ``LongT5ForConditionalGeneration.save_pretrained`` writes them (float32),
and ``reference.npz`` with what transformers computes from the saved weights. The configs are
google/long-t5-local-base and google/long-t5-tglobal-base (gated-GELU, untied head, LongT5's
defaults) scaled down; the inputs are longer than several local blocks, right-padded in a
batch, of a length that no block size divides:

* ``local``: local attention, radius 3 (blocks of 4), T = 27 (7 blocks, the last one short);
  16 position buckets up to distance 20, so the window reaches the logarithmic buckets.
* ``tglobal``: transient-global, radius 3, a global token per 3 tokens: T = 29 gives 9 global
  tokens; the shortest row (22 tokens) has 7, so its last two global tokens are masked, and
  every row has tokens past its last complete global block (they join that block).
* ``tglobal_float_blocks``: transient-global with global_block_size 47, radius 15, T = 190,
  a ReLU FF, 2 encoder layers and 1 decoder layer. transformers numbers the global blocks with
  a float32 cumulative sum of 1/47, which puts token 141 in block 2 instead of 141 // 47 = 3;
  minfer must do the same (with the exact block the encoder states differ by 6e-2).

The weights are HF's initialisation redrawn a little, as in make_t5_fixtures.py: norm gains
from U(0.6, 1.4), both relative-bias tables (local and global) at std 1, a gain on the linear
layers. Seeds are tried from ``first_seed`` until greedy decoding is "interesting" (the same
judge as make_t5_fixtures.py: eos early in one row, the limit in another, several distinct
tokens, each row alone equal to the batch, top-1/top-2 margins >= 1e-3).

``reference.npz`` keys (``allow_pickle=False`` works)
------------------------------------------------------
``input_ids``, ``attention_mask`` int64 (3, T)   rows of T, T-3, T-7 tokens, right-padded with 0
``encoder_states`` float32 (3, T, C)   ``model.encoder(...).last_hidden_state`` (compare only
                                       where mask == 1: minfer's padded positions differ)
``decoder_input_ids`` int64 (3, 7), ``logits`` float32 (3, 7, V)
``greedy_ids`` int64 (3, N)            ``generate(do_sample=False, num_beams=1,
                                       max_new_tokens=greedy_max_new_tokens)``
``greedy_single_ids_<i>`` (1, N_i)     row i generated alone, without padding

Rerun (deterministic: torch 2.13.0 CPU, transformers 4.57.6):

    pip install -e .[dev]
    python weights/make_longt5_fixtures.py            # or --only CASE, --out DIR

``reference_outputs(case_dir)`` recomputes every array live from a folder (the parity test's
live oracle), and ``write_random_checkpoint(folder, config_kwargs)`` writes a LongT5 of any
shape with the stock initialisation (benchmarks/bench_longt5.py).
"""

import argparse
import os
import sys
from typing import NamedTuple

import numpy as np
import torch
import transformers
from transformers import LongT5Config, LongT5ForConditionalGeneration
from transformers.models.longt5.modeling_longt5 import LongT5LayerNorm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_t5_fixtures as t5fx  # noqa: E402  (the T5 script's inputs, greedy runs and judge)

DEFAULT_OUT = os.path.join(HERE, "longt5")

# google/long-t5-*-base minus its sizes: what the cases share
_BASE = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


class Case(NamedTuple):
    name: str
    config: dict        # kwargs for LongT5Config
    seq_len: int        # T, the padded encoder length
    max_new: int        # new tokens of the greedy references
    first_seed: int
    gain: float = 1.5   # multiplier on every nn.Linear weight after HF's initialisation


CASES = {c.name: c for c in (
    Case("local", dict(_BASE, vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=24,
                       num_layers=2, num_decoder_layers=2, relative_attention_num_buckets=16,
                       relative_attention_max_distance=20, encoder_attention_type="local",
                       local_radius=3),
         seq_len=27, max_new=14, first_seed=100),
    Case("tglobal", dict(_BASE, vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=24,
                         num_layers=2, num_decoder_layers=2, relative_attention_num_buckets=16,
                         relative_attention_max_distance=20,
                         encoder_attention_type="transient-global", local_radius=3,
                         global_block_size=3),
         seq_len=29, max_new=14, first_seed=200),
    Case("tglobal_float_blocks", dict(_BASE, vocab_size=64, d_model=16, d_kv=8, num_heads=2,
                                      d_ff=32, num_layers=2, num_decoder_layers=1,
                                      feed_forward_proj="relu",
                                      encoder_attention_type="transient-global",
                                      local_radius=15, global_block_size=47),
         seq_len=190, max_new=12, first_seed=300, gain=2.0),
)}


def _new_model(config: LongT5Config, seed: int, gain: float, perturb: bool = True):
    torch.manual_seed(seed)
    model = LongT5ForConditionalGeneration(config)
    if perturb:
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, LongT5LayerNorm):
                    module.weight.uniform_(0.6, 1.4)
                elif isinstance(module, torch.nn.Embedding) and name.endswith("relative_attention_bias"):
                    module.weight.normal_(0.0, 1.0)   # relative_ and global_relative_
                elif isinstance(module, torch.nn.Linear):
                    module.weight.mul_(gain)
    return model.eval()


def load_model(case_dir: str):
    model, info = LongT5ForConditionalGeneration.from_pretrained(
        case_dir, output_loading_info=True, **t5fx._from_pretrained_kwargs())
    # transformers 4.57 lists LongT5's embed_tokens as missing: they are tied to `shared`
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    if set(info.get("missing_keys", ())) - tied or info.get("mismatched_keys"):
        raise RuntimeError(f"{case_dir}: HF reports {info}")
    for embedding in (model.encoder.embed_tokens, model.decoder.embed_tokens):
        if not torch.equal(embedding.weight, model.shared.weight):
            raise RuntimeError(f"{case_dir}: embed_tokens is not the shared embedding")
    return model.to(torch.float32).eval()


def _references(model, inputs: dict, max_new: int) -> tuple[dict, dict]:
    ids = torch.from_numpy(inputs["input_ids"])
    mask = torch.from_numpy(inputs["attention_mask"])
    dec = torch.from_numpy(inputs["decoder_input_ids"])
    out = {k: inputs[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    out["greedy_max_new_tokens"] = np.array(max_new, np.int64)
    margins = {}
    with torch.no_grad():
        out["encoder_states"] = model.encoder(input_ids=ids, attention_mask=mask)\
            .last_hidden_state.float().numpy()
        out["logits"] = model(input_ids=ids, attention_mask=mask,
                              decoder_input_ids=dec).logits.float().numpy()
        out["greedy_ids"], margins["greedy"] = t5fx._greedy(model, ids, mask, max_new, 0)
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            single = ids[row:row + 1, :n]
            out[f"greedy_single_ids_{row}"], margins[f"single_{row}"] = t5fx._greedy(
                model, single, torch.ones_like(single), max_new, 0)
    return out, margins


def _judge(refs: dict, margins: dict, max_new: int) -> str | None:
    reason = t5fx._judge(refs["greedy_ids"], max_new)
    if reason:
        return reason
    for row in range(refs["greedy_ids"].shape[0]):
        if (t5fx._new_tokens(refs[f"greedy_single_ids_{row}"][0])
                != t5fx._new_tokens(refs["greedy_ids"][row])):
            return f"row {row} alone differs from the batch"
    if min(margins.values()) < t5fx.MIN_MARGIN:
        return "greedy margin too small"
    return None


def reference_outputs(case_dir: str, inputs: dict | None = None) -> dict[str, np.ndarray]:
    """Reload ``case_dir`` with transformers and recompute every array of its reference.npz
    (from the inputs stored there unless ``inputs`` gives them)."""
    if inputs is None:
        with np.load(os.path.join(case_dir, "reference.npz"), allow_pickle=False) as data:
            inputs = {k: data[k] for k in ("input_ids", "attention_mask", "decoder_input_ids",
                                           "greedy_max_new_tokens")}
    refs, _ = _references(load_model(case_dir), inputs, int(inputs["greedy_max_new_tokens"]))
    return refs


def build_case(case: Case, out_dir: str, max_tries: int = 300) -> int:
    config = LongT5Config(**case.config)
    reasons: dict[str, int] = {}
    for seed in range(case.first_seed, case.first_seed + max_tries):
        inputs = t5fx.make_inputs(config, case.seq_len, seed)
        refs, margins = _references(_new_model(config, seed, case.gain), inputs, case.max_new)
        reason = _judge(refs, margins, case.max_new)
        if reason is None:
            break
        reasons[reason] = reasons.get(reason, 0) + 1
    else:
        raise RuntimeError(f"{case.name}: no acceptable seed in {max_tries} tries: {reasons}")
    folder = os.path.join(out_dir, case.name)
    t5fx._save_model(_new_model(config, seed, case.gain), folder, "float32")
    saved = reference_outputs(folder, {**inputs, "greedy_max_new_tokens": case.max_new})
    for key, value in saved.items():   # the checkpoint as written reproduces the search's run
        same = (np.array_equal(value, refs[key]) if value.dtype.kind in "iu"
                else np.allclose(value, refs[key], rtol=1e-5, atol=1e-6))
        if not same:
            raise RuntimeError(f"{case.name}: {key} changed after save/reload")
    np.savez_compressed(os.path.join(folder, "reference.npz"), **saved)
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    print(f"== {case.name}: seed {seed} ({sum(reasons.values())} rejected: {reasons}), "
          f"smallest margin {min(margins.values()):.4f}")
    print("   greedy_ids:\n" + t5fx._fmt_rows(saved["greedy_ids"]))
    print("   files:", ", ".join(f"{k} ({v} B)" for k, v in sizes.items()))
    return seed


def write_random_checkpoint(folder, config_kwargs: dict, seed: int = 0) -> str:
    """A LongT5 with transformers' stock initialisation (``config_kwargs`` for LongT5Config;
    dropout 0), saved as float32 into ``folder`` (replaced)."""
    config = LongT5Config(**{"dropout_rate": 0.0, "decoder_start_token_id": 0, **config_kwargs})
    t5fx._save_model(_new_model(config, seed, 1.0, perturb=False), str(folder), "float32")
    return str(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--only", action="append", choices=sorted(CASES))
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    seeds = {name: build_case(CASES[name], args.out) for name in args.only or CASES}
    print("seeds:", seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
