"""Build the T5-family fixtures (issue 18) with Hugging Face transformers and sentence-transformers
as the oracle: encoder-only saves, UMT5, and checkpoints shaped like ByT5, MADLAD-400, UL2 and
CodeT5+, and sentence-transformers folders.

What this makes
---------------
For every case in ``CASES`` a folder ``weights/family/<case>/`` laid out as the real checkpoint's
hub folder (scaled down: a few tens of KB), written by ``save_pretrained`` (or by
``SentenceTransformer.save``), with ``reference.npz``: the inputs and the outputs the oracle
computes for them from the weights *as saved* (reloaded in float32).

Seq2seq cases (``kind="seq2seq"``): ``input_ids``, ``attention_mask`` (B=3 rows of lengths T,
T-3, T-7, right padded with the case's pad id), ``encoder_states`` (B, T, C),
``decoder_input_ids`` (B, 7) and ``logits`` (B, 7, V) from ``model(...)``, and unless the case
says ``generate=False`` ``greedy_ids`` from ``model.generate(do_sample=False, num_beams=1,
max_new_tokens=greedy_max_new_tokens)`` (rows start with the decoder start id; finished rows are
padded with pad). transformers 4.57's generate breaks for configs with more decoder than encoder
layers: those cases are checked through ``forward`` only. The seed search takes the first seed
whose greedy output has several distinct tokens, one row ending at eos early and one running to
the limit, and a top-1/top-2 logit margin of at least 1e-3 at every step.

Encoder cases (``kind="encoder"``, saved by ``T5EncoderModel`` / ``UMT5EncoderModel``):
``input_ids``, ``attention_mask``, ``encoder_states``; with a tokenizer (the project's tiny T5
tokenizer, copied in) also ``texts`` and the diffusers text-encoder call: ``padded_ids``
(tokenized with padding="max_length", max_length=``padded_length``, truncation=True) and
``padded_states`` = ``model(padded_ids)`` with no attention mask, every position's state.

Sentence-transformers cases (``kind="sentence"``): ``texts`` and ``embeddings`` =
``SentenceTransformer(folder).encode(texts)``, plus ``embeddings_prompt_<name>`` for each prompt
name the folder declares.

How to rerun
------------
    pip install -e .[dev]
    python weights/make_family_fixtures.py                  # all cases -> weights/family
    python weights/make_family_fixtures.py --only umt5_seq2seq --out /tmp/family

Tested with torch 2.13.0 (CPU), transformers 4.57.6 and sentence-transformers 5.1.2; reruns give
the same arrays.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from typing import NamedTuple

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (AutoTokenizer, T5Config, T5EncoderModel, T5ForConditionalGeneration,
                          UMT5Config, UMT5EncoderModel, UMT5ForConditionalGeneration)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "family")
TINY_TOKENIZER = os.path.join(HERE, "tokenizers", "tiny-t5")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model")
SHORTENING = (0, 3, 7)
DECODER_LEN = 7
MIN_MARGIN = 1e-3
TEXTS = ["A quick brown fox jumps over the lazy dog.", "Hello world",
         "  Dates like 4th of July 1976 and numbers like 1234 are spelled out here, at length.  ",
         "x", "The same sentence, once more: the same sentence."]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_TINY = dict(vocab_size=96, d_model=16, d_kv=8, num_heads=2, d_ff=24, num_layers=2,
             num_decoder_layers=2, relative_attention_num_buckets=8,
             relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0)


class Case(NamedTuple):
    name: str
    kind: str              # "seq2seq", "encoder" or "sentence"
    config: dict           # config kwargs
    dtype: str = "float32"
    umt5: bool = False
    seq_len: int = 20
    max_new: int = 12
    first_seed: int = 0
    gain: float = 1.5
    generate: bool = True
    shards: int = 1
    embed_names: bool = False      # MADLAD: encoder/decoder.embed_tokens in the file, no shared
    drop_model_type: bool = False  # config.json names only the architecture
    tokenizer: bool = False        # copy the tiny tokenizer in (vocab 600)
    sentence: dict = {}            # sentence-transformers modules (kind "sentence")


CASES = {c.name: c for c in (
    # google/umt5-small scaled down: gated-gelu, untied head, a bias table in every layer
    Case("umt5_seq2seq", "seq2seq", dict(_TINY, feed_forward_proj="gated-gelu",
                                          tie_word_embeddings=False), umt5=True, first_seed=100),
    # the Wan text encoder's layout: UMT5EncoderModel, bfloat16, config without model_type
    Case("umt5_encoder", "encoder", dict(_TINY, feed_forward_proj="gated-gelu",
                                          tie_word_embeddings=False, num_layers=3),
         dtype="bfloat16", umt5=True, drop_model_type=True, first_seed=200),
    # the Flux / SD3 text_encoder_2 layout: the t5-v1.1-xxl encoder, bfloat16, sharded
    Case("t5_encoder_sharded", "encoder", dict(_TINY, vocab_size=600, d_model=16, d_kv=4,
                                               num_heads=4, d_ff=32, feed_forward_proj="gated-gelu",
                                               tie_word_embeddings=False),
         dtype="bfloat16", shards=2, tokenizer=True, first_seed=300),
    # google/byt5-small scaled down: the byte vocabulary (384), 3 encoder / 1 decoder layers
    Case("byt5_shape", "seq2seq", dict(_TINY, vocab_size=384, num_layers=3, num_decoder_layers=1,
                                        feed_forward_proj="gated-gelu", tie_word_embeddings=False),
         dtype="bfloat16", first_seed=400, seq_len=16),
    # google/madlad400-3b-mt scaled down: pad 1, eos 2, start 0; heads x d_kv != d_model; the
    # embedding stored as encoder/decoder.embed_tokens (no shared.weight)
    Case("madlad_shape", "seq2seq", dict(_TINY, d_kv=6, num_heads=4,
                                          feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                          pad_token_id=1, eos_token_id=2, decoder_start_token_id=0),
         dtype="bfloat16", embed_names=True, first_seed=500),
    # google/flan-ul2 scaled down: gated-silu, heads x d_kv (24) != d_model (16), bfloat16
    Case("ul2_shape", "seq2seq", dict(_TINY, d_kv=12, num_heads=2, feed_forward_proj="gated-silu",
                                       tie_word_embeddings=False), dtype="bfloat16", first_seed=600),
    # Salesforce/codet5p-220m and -770m scaled down: T5 v1.0 (relu, tied), bos 1, eos 2, pad 0
    Case("codet5p_220m_shape", "seq2seq", dict(_TINY, vocab_size=100, feed_forward_proj="relu",
                                                tie_word_embeddings=True, bos_token_id=1,
                                                eos_token_id=2, pad_token_id=0),
         first_seed=700, gain=3.0),
    Case("codet5p_770m_shape", "seq2seq", dict(_TINY, vocab_size=100, d_model=24, d_kv=6,
                                                num_heads=4, d_ff=32, num_layers=3,
                                                num_decoder_layers=3, feed_forward_proj="relu",
                                                tie_word_embeddings=True, bos_token_id=1,
                                                eos_token_id=2, pad_token_id=0),
         dtype="float16", first_seed=800, gain=3.0),
    # more decoder than encoder layers: transformers' generate breaks there, forward does not
    Case("deeper_decoder", "seq2seq", dict(_TINY, num_layers=1, num_decoder_layers=3,
                                            feed_forward_proj="gated-gelu",
                                            tie_word_embeddings=False),
         dtype="bfloat16", generate=False, first_seed=900),
    # sentence-t5 / GTR-T5 layout: the encoder at the top, mean pooling, Dense (no bias,
    # identity) stored as pytorch_model.bin, Normalize; type names in the old form
    Case("st_sentence_t5", "sentence", dict(_TINY, vocab_size=600, d_model=16, d_kv=4, num_heads=4,
                                             d_ff=32, feed_forward_proj="relu"),
         tokenizer=True, first_seed=1000,
         sentence=dict(max_seq_length=12, pooling=dict(pooling_mode_mean_tokens=True),
                       dense=[dict(out=20, bias=False, act="Identity")], normalize=True,
                       safe=False)),
    # a newer folder: the encoder in 0_Transformer, type names with the class repeated, four
    # poolings, two Dense layers with bias (tanh, identity), lower-casing, prompts with a default
    # left out of the pooling (include_prompt false), bfloat16 encoder weights
    Case("st_prompts", "sentence", dict(_TINY, vocab_size=600, d_model=16, d_kv=4, num_heads=4,
                                         d_ff=32, feed_forward_proj="gated-gelu",
                                         tie_word_embeddings=False),
         dtype="bfloat16", tokenizer=True, first_seed=1100,
         sentence=dict(max_seq_length=16, do_lower_case=True, subfolder="0_Transformer",
                       new_type_names=True,
                       pooling=dict(pooling_mode_max_tokens=True,
                                    pooling_mode_mean_sqrt_len_tokens=True,
                                    pooling_mode_weightedmean_tokens=True,
                                    pooling_mode_lasttoken=True, include_prompt=False),
                       dense=[dict(out=24, bias=True, act="Tanh"),
                              dict(out=8, bias=True, act="Identity")],
                       normalize=False, prompts={"query": "query: ", "passage": "passage: "},
                       default_prompt_name="query", safe=True)),
)}


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
def _classes(case: Case):
    config_cls = UMT5Config if case.umt5 else T5Config
    model_cls = ((UMT5EncoderModel if case.umt5 else T5EncoderModel) if case.kind != "seq2seq"
                 else (UMT5ForConditionalGeneration if case.umt5 else T5ForConditionalGeneration))
    return config_cls, model_cls


def _new_model(case: Case, seed: int):
    """A random model, re-drawn so that dropping any piece changes the numbers: norm gains in
    U(0.6, 1.4), bias tables with std 1, linear weights times `gain`."""
    config_cls, model_cls = _classes(case)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**case.config))
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.endswith("LayerNorm"):
                module.weight.uniform_(0.6, 1.4)
            elif isinstance(module, torch.nn.Embedding) and name.endswith("relative_attention_bias"):
                module.weight.normal_(0.0, 1.0)
            elif isinstance(module, torch.nn.Linear):
                module.weight.mul_(case.gain)
    return model.eval()


def _save(model, folder: str, case: Case) -> None:
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    model = model.to(DTYPES[case.dtype])
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, safe_serialization=True,
                          max_shard_size=int(size / case.shards * 1.1) if case.shards > 1 else "100GB")
    for extra in os.listdir(folder):   # only what a hub folder of this kind holds
        if extra == "generation_config.json":
            os.remove(os.path.join(folder, extra))
    if case.embed_names:   # MADLAD's file: the embedding under the stacks' names only
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        shared = tensors.pop("shared.weight")
        tensors["encoder.embed_tokens.weight"] = shared.clone()
        tensors["decoder.embed_tokens.weight"] = shared.clone()
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, path, metadata={"format": "pt"})
    if case.drop_model_type:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        del cfg["model_type"]
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    if case.tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(TINY_TOKENIZER, name), folder)


def _reload(folder: str, case: Case):
    _, model_cls = _classes(case)
    model, info = model_cls.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    missing = [k for k in info.get("missing_keys", ()) if not (case.embed_names and k == "shared.weight")]
    if missing or info.get("mismatched_keys"):
        raise RuntimeError(f"{folder}: HF reports missing {missing} / mismatched "
                           f"{info.get('mismatched_keys')}")
    return model.float().eval()


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------
def _inputs(case: Case, seed: int) -> dict:
    cfg = case.config
    pad, start = cfg.get("pad_token_id", 0), cfg.get("decoder_start_token_id", 0)
    low = 3   # ids 0..2 are pad / eos / unk (or bos) in every case
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, cfg["vocab_size"], (len(SHORTENING), case.seq_len), generator=gen)
    mask = torch.ones_like(ids)
    for row, k in enumerate(SHORTENING):
        ids[row, case.seq_len - k:] = pad
        mask[row, case.seq_len - k:] = 0
    dec = torch.randint(low, cfg["vocab_size"], (len(SHORTENING), DECODER_LEN), generator=gen)
    dec[:, 0] = start
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}


def _greedy(model, case: Case, ids, mask):
    out = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1,
                         max_new_tokens=case.max_new, min_new_tokens=0, output_scores=True,
                         return_dict_in_generate=True)
    eos = case.config.get("eos_token_id", 1)
    margin = math.inf
    for step, scores in enumerate(out.scores):
        live = ~(out.sequences[:, 1:1 + step] == eos).any(dim=1)
        if live.any():
            top2 = torch.topk(scores[live].float(), 2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    return out.sequences, margin


def _interesting(seqs, case: Case, margin: float) -> str | None:
    eos, pad = case.config.get("eos_token_id", 1), case.config.get("pad_token_id", 0)
    rows = []
    for row in seqs.tolist():
        new = row[1:]
        rows.append(new[:new.index(eos) + 1] if eos in new else new)
    if any(pad in r for r in rows):
        return "pad generated"
    if not any(r[-1] == eos and 3 <= len(r) <= case.max_new - 3 for r in rows):
        return "no row ends early"
    if all(r[-1] == eos for r in rows):
        return "every row ends"
    if len({t for r in rows for t in r}) < 6:
        return "too few distinct tokens"
    if margin < MIN_MARGIN:
        return "greedy margin too small"
    return None


def _references(model, case: Case, inputs: dict) -> dict:
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    out = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    with torch.no_grad():
        encoder = model if case.kind != "seq2seq" else model.encoder
        out["encoder_states"] = encoder(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
        if case.kind == "seq2seq":
            dec = inputs["decoder_input_ids"]
            out["decoder_input_ids"] = dec.numpy()
            out["logits"] = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits.numpy()
            if case.generate:
                seqs, _ = _greedy(model, case, ids, mask)
                out["greedy_ids"] = seqs.numpy()
                out["greedy_max_new_tokens"] = np.array(case.max_new, np.int64)
    return {k: np.ascontiguousarray(v) if np.ndim(v) else np.asarray(v) for k, v in out.items()}


def _diffusers_call(folder: str, model, length: int) -> dict:
    """What diffusers' Flux / SD3 `_get_t5_prompt_embeds` computes: ids padded to max_length,
    cut there, and the encoder run with no attention mask."""
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXTS, padding="max_length", max_length=length, truncation=True,
              return_tensors="pt").input_ids
    with torch.no_grad():
        states = model(ids, output_hidden_states=False)[0]
    return {"texts": np.array(TEXTS), "padded_length": np.array(length, np.int64),
            "padded_ids": ids.numpy(), "padded_states": states.numpy()}


def _find_seed(case: Case, max_tries: int) -> int:
    if case.kind != "seq2seq" or not case.generate:
        return case.first_seed
    reasons: dict = {}
    for seed in range(case.first_seed, case.first_seed + max_tries):
        model = _new_model(case, seed).to(DTYPES[case.dtype]).float()
        inputs = _inputs(case, seed)
        with torch.no_grad():
            seqs, margin = _greedy(model, case, inputs["input_ids"], inputs["attention_mask"])
        reason = _interesting(seqs, case, margin)
        if reason is None:
            return seed
        reasons[reason] = reasons.get(reason, 0) + 1
    raise RuntimeError(f"{case.name}: no acceptable seed in {max_tries} tries: {reasons}")


# --------------------------------------------------------------------------
# sentence-transformers folders
# --------------------------------------------------------------------------
def _sentence_folder(case: Case, folder: str, seed: int) -> dict:
    from sentence_transformers import SentenceTransformer, models
    spec = case.sentence
    with tempfile.TemporaryDirectory() as tmp:
        encoder_dir = os.path.join(tmp, "encoder")
        _save(_new_model(case, seed), encoder_dir, case)
        word = models.Transformer(encoder_dir, max_seq_length=spec["max_seq_length"],
                                  do_lower_case=spec.get("do_lower_case", False))
        pool = models.Pooling(case.config["d_model"],
                              **{"pooling_mode_mean_tokens": False, **spec["pooling"]})
        modules, width = [word, pool], pool.get_sentence_embedding_dimension()
        torch.manual_seed(seed + 1)
        for d in spec["dense"]:
            layer = models.Dense(width, d["out"], bias=d["bias"],
                                 activation_function=getattr(torch.nn, d["act"])())
            with torch.no_grad():
                layer.linear.weight.normal_(0.0, width ** -0.5)
                if d["bias"]:
                    layer.linear.bias.normal_(0.0, 0.5)
            modules.append(layer)
            width = d["out"]
        if spec["normalize"]:
            modules.append(models.Normalize())
        st = SentenceTransformer(modules=modules, prompts=spec.get("prompts"),
                                 default_prompt_name=spec.get("default_prompt_name"), device="cpu")
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        st.save(folder, safe_serialization=True)
    if not spec["safe"]:   # Dense weights as older sentence-transformers wrote them: torch.save
        for name in os.listdir(folder):
            dense = os.path.join(folder, name, "model.safetensors")
            if name.endswith("_Dense") and os.path.isfile(dense):
                torch.save(load_file(dense), os.path.join(folder, name, "pytorch_model.bin"))
                os.remove(dense)
    # the encoder weights as the case stores them (ST saves float32 modules)
    sub = spec.get("subfolder")
    with open(os.path.join(folder, "modules.json")) as f:
        entries = json.load(f)
    if sub:   # older folders keep the Transformer module in its own folder
        os.makedirs(os.path.join(folder, sub))
        for name in os.listdir(folder):
            if name not in ("modules.json", "config_sentence_transformers.json", "README.md", sub) \
                    and not name[:1].isdigit():
                shutil.move(os.path.join(folder, name), os.path.join(folder, sub, name))
        entries[0]["path"] = sub
    for entry in entries:
        if spec.get("new_type_names"):
            entry["type"] = entry["type"] + "." + entry["type"].rsplit(".", 1)[1]
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(entries, f, indent=2)
    transformer = os.path.join(folder, sub or "")
    _resave_dtype(transformer, case.dtype)
    for extra in ("README.md", os.path.join(sub or "", "generation_config.json")):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    st = SentenceTransformer(folder, device="cpu")
    refs = {"texts": np.array(TEXTS), "embeddings": st.encode(TEXTS, convert_to_numpy=True)}
    for name in (spec.get("prompts") or {}):
        refs[f"embeddings_prompt_{name}"] = st.encode(TEXTS, prompt_name=name, convert_to_numpy=True)
    return refs


def _resave_dtype(folder: str, dtype: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in sorted(tensors.items())}, path,
              metadata={"format": "pt"})


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------
def build_case(case: Case, out_dir: str, max_tries: int) -> None:
    folder = os.path.join(out_dir, case.name)
    seed = _find_seed(case, max_tries)
    if case.kind == "sentence":
        refs = _sentence_folder(case, folder, seed)
    else:
        _save(_new_model(case, seed), folder, case)
        model = _reload(folder, case)
        refs = _references(model, case, _inputs(case, seed))
        if case.tokenizer:
            refs.update(_diffusers_call(folder, model, length=24))
    np.savez_compressed(os.path.join(folder, "reference.npz"), **refs)
    files = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
             if os.path.isfile(os.path.join(folder, f))}
    print(f"== {case.name} (seed {seed}): " + ", ".join(f"{k} {v} B" for k, v in files.items()))
    if "greedy_ids" in refs:
        print("   greedy_ids:", refs["greedy_ids"].tolist())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--only", action="append", choices=sorted(CASES))
    parser.add_argument("--max-tries", type=int, default=300)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or list(CASES):
        build_case(CASES[name], args.out, args.max_tries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
