"""Build the tiny Transformer-XL test fixtures (the "oracle") for minfer.

What this makes
---------------
For every case in ``CASES`` a folder ``weights/transfo_xl/<case>/`` laid out
like a Hugging Face checkpoint:

* ``config.json``        -- written by ``save_pretrained``
* ``model.safetensors``  -- ``save_pretrained(..., safe_serialization=True)``.
                            HF drops the tied copies: ``crit.out_layers.<i>.weight``
                            (= ``transformer.word_emb.emb_layers.<i>.weight``) and
                            ``crit.out_projs.<i>`` when it is tied to an embedding
                            projection (``tie_projs[i]``); a loader must take them
                            from ``word_emb``.  With untie_r false the
                            per-layer ``dec_attn.r_w_bias`` / ``r_r_bias`` are
                            stored too, as copies of the shared
                            ``transformer.r_w_bias`` / ``r_r_bias`` (see
                            ``_save_safetensors``).
* ``reference.npz``      -- inputs and what HF ``transformers`` (PyTorch) computes

and one extra folder, ``adaptive_div4_bin/``, holding the *same* model as
``adaptive_div4`` (same seed, same weights) the way old hub checkpoints come:
``pytorch_model.bin`` written with plain ``torch.save(model.state_dict())``
(torch's zip format, tied duplicates included), ``config.json``, a word
vocabulary ``vocab.pkl`` written by transformers' ``TransfoXLTokenizer.
save_vocabulary`` and ``vocab_words.txt`` (its ``idx2sym`` list, one symbol a
line, for tests to compare against).  That folder has no reference.npz: its
outputs are those of ``adaptive_div4``.

The models are tiny random Transformer-XLs.  HF's initialisation (std 0.02,
projections 0.01) gives almost uniform log-probs, so after it the weights are
redrawn at unit scale (see ``_perturb_weights``).  For each case the script
tries seeds ``first_seed, first_seed+1, ...`` until the outputs are
"interesting": the greedy continuations contain several distinct tokens (and,
for adaptive softmax, tokens of more than one cluster), every greedy step has
a top-1 / top-2 log-prob margin of at least ``MIN_MARGIN``, the log-probs are
far from uniform, and carrying memory visibly changes segment 2.  The chosen
seed is printed.

Everything stored is computed from the checkpoint *as saved*: reloaded with
``TransfoXLLMHeadModel.from_pretrained(folder)`` in float32, ``eval()``,
``torch.no_grad()``.

``reference.npz`` keys (plain numeric arrays; ``allow_pickle=False`` works)
-----------------------------------------------------------------------------
B = 2 rows, S = ``segment_len`` = config ``tgt_len``, V = vocab size.

``input_ids`` int64 (B, 3*S)        three consecutive segments; ids drawn from
                                    1..V-1 plus a few eos (0)
``segment_len`` int64 ()            S
``log_probs_<k>`` float32 (B, S, V) k = 0, 1, 2: ``model(input_ids=segment_k,
                                    mems=mems).prediction_scores`` (log-probs:
                                    no labels given), mems carried from the call
                                    before; segment 0 starts from EMPTY memory
                                    (n_layer tensors of shape (0, B, d_model))
``mems_<k>`` float32 (n_layer, M_k, B, d_model)
                                    HF's returned ``mems`` after segment k,
                                    time-major as HF keeps them; M_k =
                                    min(mem_len, tokens seen so far)
``log_probs_nomem_2`` float32       segment 2 run alone from empty memory
``greedy_prompt`` int64 (B, S+3)    run in ONE call from empty memory
``greedy_ids`` int64 (B, N)         greedy continuation: argmax of the last
                                    position's log-probs (first index on ties),
                                    then feed that token as a (B, 1) input with
                                    the carried mems, N times
``greedy_max_new_tokens`` int64 ()  N = 12

Starting from empty memory matters: HF's ``mems=None`` starts from ``mem_len``
ZERO vectors per layer (``init_mems``), which attends to zeros and changes the
numbers; the original Transformer-XL code starts from nothing.  Passing
``mems=[torch.empty(0, B, d_model)] * n_layer`` runs HF's own code path with
mlen = 0 (``torch.cat`` with the empty tensor, klen = qlen, memory update
keeping the last ``mem_len`` hidden states).

The transformers 4.57 fix-up
----------------------------
transformers 4.57's deprecated ``TransfoXLModel.forward`` computes the
relative positions as ``torch.arange(klen - 1, -1, -1.0, ..., dtype=torch.int64)
.type_as(dtype=word_emb.dtype)``, which raises ``TypeError`` under current
torch (``type_as`` takes a tensor, not ``dtype=``).  ``patch_transfo_xl()``
recompiles that one method from HF's own source with that single expression
replaced by the one upstream used before,
``torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)``
(same values, klen-1 .. 0 as floats); nothing else changes.  It is applied
lazily by the functions that build or load a model, never at import.

Importable helpers (importing this module has no side effects):

* ``reference_outputs(case_dir, inputs=None)`` reloads the checkpoint in
  ``case_dir`` and recomputes every array above from the inputs stored in its
  reference.npz (for ``adaptive_div4_bin``, from ``../adaptive_div4/
  reference.npz``), so a test can regenerate the references live.
* ``load_model(case_dir)``, ``patch_transfo_xl()``.

How to rerun
------------
    pip install -e .[dev]          # plus sacremoses: TransfoXLTokenizer needs it
    python weights/make_transfo_xl_fixtures.py                 # all -> weights/transfo_xl
    python weights/make_transfo_xl_fixtures.py --only plain_softmax
    python weights/make_transfo_xl_fixtures.py --out /tmp/xlfixtures

``--only adaptive_div4_bin`` redoes the seed search of ``adaptive_div4``
(deterministic) to get the same weights.  ``vocab.pkl`` is written in a child
process with ``PYTHONHASHSEED=0``: HF's tokenizer keeps a ``set`` in the
pickled state, so the bytes would otherwise change from run to run.  Rerunning
gives byte-identical files (checked with torch 2.13.0 CPU, transformers
4.57.6, sacremoses 0.2.0).  No network access is needed: configs are built by
hand with ``TransfoXLConfig``.
"""

import argparse
import contextlib
import inspect
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from typing import NamedTuple

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "transfo_xl")

BATCH = 2
N_SEGMENTS = 3
PROMPT_EXTRA = 3  # greedy prompt length = tgt_len + PROMPT_EXTRA
MAX_NEW = 12
EOS_ID = 0
MIN_MARGIN = 1e-3  # smallest allowed top-1 minus top-2 log-prob gap in greedy steps
MIN_MEMORY_EFFECT = 0.05  # max |log_probs_2 - log_probs_nomem_2| must exceed this
MAX_ENTROPY_FRACTION = 0.85  # mean entropy of the log-probs / log(V) must stay below this


# --------------------------------------------------------------------------
# Case table
# --------------------------------------------------------------------------


class Case(NamedTuple):
    # A NamedTuple rather than a dataclass: tests may load this file with
    # importlib's exec_module without registering it in sys.modules.
    name: str
    config: dict  # kwargs for TransfoXLConfig (dropout 0 added)
    first_seed: int  # seed search starts here
    gain: float = 1.0  # multiplier on the transformer's nn.Linear weights
    emb_gain: float = 1.0  # multiplier on embedding tables (and so on the tied output layers)
    cluster_bias: float = 0.0  # mean of crit.cluster_bias (raises the tail clusters' probability)
    weights_of: str | None = None  # save the model of this other case as pytorch_model.bin


CASES = {
    c.name: c
    for c in (
        Case(
            name="adaptive_div4",
            # The wt103 layout, shrunk.  d_embed is 64 rather than d_model (32):
            # with div_val 4 the cluster widths are d_embed // 4**i, and 32
            # would make the last cluster 0 wide (an empty embedding and an
            # output layer that is bias only); 64 gives 64, 16, 4, 1.
            config=dict(
                vocab_size=1000,
                cutoffs=[100, 300, 600],
                div_val=4,
                d_model=32,
                d_embed=64,
                n_head=4,
                d_head=8,
                d_inner=64,
                n_layer=3,
                tgt_len=8,
                mem_len=12,  # memory longer than a segment
                clamp_len=6,  # on, and smaller than klen
                same_length=True,
                pre_lnorm=False,
                untie_r=True,
                tie_word_embeddings=True,
                eos_token_id=EOS_ID,
            ),
            first_seed=1000,
            gain=1.0,
            emb_gain=3.0,
            cluster_bias=2.0,
        ),
        Case(
            name="plain_softmax",
            # cutoffs=[] works in HF: one cluster, no cluster_weight/bias, a
            # plain log_softmax over out_layers.0 (tied to emb_layers.0).
            config=dict(
                vocab_size=200,
                cutoffs=[],
                div_val=1,
                d_model=32,
                d_embed=32,
                n_head=2,
                d_head=16,
                d_inner=48,
                n_layer=2,
                tgt_len=8,
                mem_len=5,  # memory shorter than a segment
                clamp_len=0,  # off (HF clamps only when clamp_len > 0)
                same_length=False,
                pre_lnorm=True,
                untie_r=False,  # one shared transformer.r_w_bias / r_r_bias
                eos_token_id=EOS_ID,
            ),
            first_seed=2000,
            gain=2.5,
            emb_gain=1.0,
        ),
        Case(
            name="adaptive_div1_proj",
            # div_val 1 with d_embed != d_model: one embedding table and one
            # projection emb_projs.0 (d_model, d_embed); the softmax slices
            # out_layers.0 per cluster, out_projs.0 is its own (untied)
            # projection and out_projs.1/.2 are tied to emb_projs.0.
            config=dict(
                vocab_size=500,
                cutoffs=[50, 150],
                div_val=1,
                d_model=32,
                d_embed=24,
                n_head=4,
                d_head=8,
                d_inner=64,
                n_layer=2,
                tgt_len=6,
                mem_len=6,
                clamp_len=0,
                same_length=True,
                pre_lnorm=False,
                untie_r=True,
                eos_token_id=EOS_ID,
            ),
            first_seed=3000,
            gain=1.5,
            emb_gain=3.0,
            cluster_bias=2.0,
        ),
        Case(
            name="adaptive_div4_bin",
            config={},  # taken from weights_of
            first_seed=0,
            weights_of="adaptive_div4",
        ),
    )
}

# Word corpus of the tiny vocab.pkl: WikiText-style, pre-tokenised and
# whitespace split (numbers with @,@ / @.@, like the wt103 data).
VOCAB_CORPUS = """\
= The Old Harbour Bridge =
The Old Harbour Bridge is a stone arch bridge over the river in the town centre .
Work on the bridge began in 1852 , and it carried 12 @,@ 400 carts a day by 1900 .
Its main span is 31 @.@ 5 metres long and the deck is 8 @.@ 2 metres wide .
The city of Zürich has a café on every corner — or so it is said .
<unk> is what the model writes when it does not know a word .
"""


def _base_case(case: Case) -> Case:
    return CASES[case.weights_of] if case.weights_of else case


# --------------------------------------------------------------------------
# transformers 4.57 fix-up
# --------------------------------------------------------------------------

_BROKEN_ARANGE = re.compile(
    r"torch\.arange\(klen - 1, -1, -1\.0, device=word_emb\.device, dtype=torch\.int64\)"
    r"\.type_as\(\s*dtype=word_emb\.dtype\s*\)"
)
_UPSTREAM_ARANGE = "torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)"


def _hf_modules():
    from transformers.models.deprecated.transfo_xl import modeling_transfo_xl

    return modeling_transfo_xl


def patch_transfo_xl() -> bool:
    """Make HF's TransfoXLModel.forward run under current torch (idempotent).

    Recompiles ``TransfoXLModel.forward`` from its own source with the one
    broken expression (see the module docstring) replaced by upstream's.  The
    docstring decorators are left out (they only build ``__doc__``, which is
    copied over).  Returns True if the method was replaced, False if it was
    already patched or does not contain the broken expression.
    """
    mod = _hf_modules()
    cls = mod.TransfoXLModel
    old = cls.forward
    if getattr(old, "_minfer_patched", False):
        return False
    lines, first_line = inspect.getsourcelines(old)
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def forward"))
    source = textwrap.dedent("".join(lines[start:]))
    found = len(_BROKEN_ARANGE.findall(source))
    if found == 0:
        return False
    if found != 1:
        raise RuntimeError(f"expected the broken torch.arange once in TransfoXLModel.forward, found {found}")
    source = _BROKEN_ARANGE.sub(_UPSTREAM_ARANGE, source)
    # pad with newlines so tracebacks point at the right lines of HF's file
    code = compile("\n" * (first_line - 1 + start) + source, inspect.getsourcefile(old), "exec")
    namespace: dict = {}
    exec(code, vars(mod), namespace)
    new = namespace["forward"]
    new.__doc__ = old.__doc__
    new.__qualname__ = old.__qualname__
    new._minfer_patched = True
    cls.forward = new
    return True


@contextlib.contextmanager
def _hf_silent(level=None):
    """Quiet transformers' logging (and its TransfoXL deprecation warnings) for a while.

    Restores the previous logging level and warning filters afterwards, so
    calling the helpers of this module changes no global state (besides the
    idempotent ``patch_transfo_xl``).
    """
    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity(transformers.logging.ERROR if level is None else level)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TransfoXL.*")
            yield
    finally:
        transformers.logging.set_verbosity(old)


# --------------------------------------------------------------------------
# Model construction / saving / loading
# --------------------------------------------------------------------------


def _make_config(config_kwargs: dict):
    from transformers import TransfoXLConfig

    kwargs = dict(config_kwargs)
    kwargs.setdefault("dropout", 0.0)
    kwargs.setdefault("dropatt", 0.0)
    return TransfoXLConfig(**kwargs)


def _perturb_weights(model, gain: float, emb_gain: float, cluster_bias: float = 0.0) -> None:
    """Redraw the weights of a freshly initialised model at unit scale.

    HF's init (normal std 0.02, projections 0.01, LayerNorm gains ~1, biases 0)
    gives nearly uniform log-probs.  Instead:

    * embedding tables ``emb_layers.i``: N(0, 1/d_i) * emb_gain (d_i = table
      width); embedding and output projections: N(0, 1/d_model); with the
      sqrt(d_model) input scaling and the tied output layers this gives
      O(emb_gain) embeddings and logits;
    * ``crit.cluster_weight``: N(0, 1/d_embed) * emb_gain; output-layer biases
      N(0, 0.5^2), cluster biases N(cluster_bias, 0.5^2) (a positive mean makes
      greedy decoding pick tail-cluster tokens now and then);
    * transformer nn.Linear weights (qkv_net, o_net, r_net, CoreNet):
      N(0, 1/fan_in) * gain; their biases N(0, 0.1^2);
    * LayerNorm gains U(0.6, 1.4), biases N(0, 0.1^2);
    * r_w_bias / r_r_bias: N(0, 0.5^2), so both position terms matter.

    ``transformer.pos_emb.inv_freq`` is left as HF computes it.  Tied tensors
    are shared objects, so each is drawn once.
    """
    from torch import nn

    mod = _hf_modules()
    seen: set[int] = set()

    def once(t) -> bool:
        if t is None or id(t) in seen:
            return False
        seen.add(id(t))
        return True

    with torch.no_grad():
        emb = model.transformer.word_emb
        for table in emb.emb_layers:
            if once(table.weight) and table.weight.numel():
                table.weight.normal_(0.0, emb_gain / math.sqrt(table.weight.shape[1]))
        for proj in list(emb.emb_projs) + list(model.crit.out_projs):
            if once(proj):
                proj.normal_(0.0, 1.0 / math.sqrt(proj.shape[0]))
        crit = model.crit
        for layer in crit.out_layers:
            if once(layer.weight):  # untied output layers only
                layer.weight.normal_(0.0, emb_gain / math.sqrt(layer.weight.shape[1]))
            if once(layer.bias):
                layer.bias.normal_(0.0, 0.5)
        if getattr(crit, "cluster_weight", None) is not None:
            crit.cluster_weight.normal_(0.0, emb_gain / math.sqrt(crit.cluster_weight.shape[1]))
            crit.cluster_bias.normal_(cluster_bias, 0.5)
        for module in model.transformer.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, gain / math.sqrt(module.weight.shape[1]))
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.6, 1.4)
                module.bias.normal_(0.0, 0.1)
            elif isinstance(module, (mod.RelPartialLearnableMultiHeadAttn, mod.TransfoXLModel)):
                for name in ("r_w_bias", "r_r_bias"):
                    p = module._parameters.get(name)
                    if once(p):
                        p.normal_(0.0, 0.5)


def _new_model(case: Case, seed: int):
    from transformers import TransfoXLLMHeadModel

    patch_transfo_xl()
    config = _make_config(case.config)
    torch.manual_seed(seed)
    with _hf_silent():
        model = TransfoXLLMHeadModel(config)
    _perturb_weights(model, case.gain, case.emb_gain, case.cluster_bias)
    return model.eval()


def _from_pretrained_kwargs() -> dict:
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: torch.float32}


def load_model(case_dir: str, return_info: bool = False):
    """Load the checkpoint in ``case_dir`` with HF, in float32, in eval mode."""
    from transformers import TransfoXLLMHeadModel

    patch_transfo_xl()
    with _hf_silent():
        model, info = TransfoXLLMHeadModel.from_pretrained(
            case_dir, output_loading_info=True, **_from_pretrained_kwargs()
        )
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        if info.get(kind):
            raise RuntimeError(f"{case_dir}: HF reports {kind} {info[kind]}")
    model = model.to(torch.float32).eval()
    return (model, info) if return_info else model


def _save_safetensors(model, folder: str) -> None:
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    if not model.config.untie_r:
        # With untie_r false every layer's dec_attn.r_w_bias / r_r_bias *is*
        # transformer.r_w_bias / r_r_bias.  save_pretrained refuses to write
        # such undeclared aliases, and transformers 4.57's from_pretrained does
        # not restore the sharing: a file holding only transformer.r_w_bias /
        # r_r_bias reloads with the per-layer ones missing and left at random
        # init.  So the file stores the per-layer names too, as copies of the
        # shared values (what a torch.save'd state_dict also holds).
        from torch import nn

        for layer in model.transformer.layers:
            layer.dec_attn.r_w_bias = nn.Parameter(model.transformer.r_w_bias.detach().clone())
            layer.dec_attn.r_r_bias = nn.Parameter(model.transformer.r_r_bias.detach().clone())
    model.save_pretrained(folder, safe_serialization=True)
    for fname in os.listdir(folder):
        if fname not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(folder, fname))


def _save_bin(model, folder: str) -> None:
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    # config.json exactly as save_pretrained writes it; the weights file it
    # writes alongside is replaced by a plain torch.save of the state dict
    model.save_pretrained(folder, safe_serialization=True)
    for fname in os.listdir(folder):
        if fname != "config.json":
            os.remove(os.path.join(folder, fname))
    torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))


# --------------------------------------------------------------------------
# Inputs and references
# --------------------------------------------------------------------------


def make_inputs(config, seed: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    vocab, seg = config.vocab_size, config.tgt_len
    ids = torch.randint(1, vocab, (BATCH, N_SEGMENTS * seg), generator=gen)
    ids[0, seg + 2] = EOS_ID  # a few eos tokens inside the text
    ids[1, 2 * seg + seg // 2] = EOS_ID
    prompt = torch.randint(1, vocab, (BATCH, seg + PROMPT_EXTRA), generator=gen)
    return {
        "input_ids": ids.numpy().astype(np.int64),
        "segment_len": np.array(seg, dtype=np.int64),
        "greedy_prompt": prompt.numpy().astype(np.int64),
        "greedy_max_new_tokens": np.array(MAX_NEW, dtype=np.int64),
    }


def _empty_mems(model, batch: int) -> list:
    cfg = model.config
    return [torch.empty(0, batch, cfg.d_model, dtype=torch.float32) for _ in range(cfg.n_layer)]


def _compute_references(model, inputs: dict):
    """Return (reference arrays, greedy margins) for ``inputs``."""
    ids = torch.from_numpy(np.asarray(inputs["input_ids"], dtype=np.int64))
    seg = int(inputs["segment_len"])
    prompt = torch.from_numpy(np.asarray(inputs["greedy_prompt"], dtype=np.int64))
    max_new = int(inputs["greedy_max_new_tokens"])
    batch = ids.shape[0]
    if ids.shape[1] != N_SEGMENTS * seg:
        raise ValueError(f"input_ids has {ids.shape[1]} columns, expected {N_SEGMENTS} * {seg}")
    out = {
        "input_ids": ids.numpy(),
        "segment_len": np.array(seg, dtype=np.int64),
        "greedy_prompt": prompt.numpy(),
        "greedy_max_new_tokens": np.array(max_new, dtype=np.int64),
    }
    with torch.no_grad():
        mems = _empty_mems(model, batch)
        for k in range(N_SEGMENTS):
            res = model(input_ids=ids[:, k * seg : (k + 1) * seg], mems=mems)
            mems = res.mems
            out[f"log_probs_{k}"] = res.prediction_scores.float().numpy()
            out[f"mems_{k}"] = torch.stack(mems).float().numpy()
        res = model(input_ids=ids[:, 2 * seg :], mems=_empty_mems(model, batch))
        out["log_probs_nomem_2"] = res.prediction_scores.float().numpy()

        res = model(input_ids=prompt, mems=_empty_mems(model, batch))
        mems, last = res.mems, res.prediction_scores[:, -1]
        greedy, margins = [], []
        for step in range(max_new):
            top2 = torch.topk(last, 2, dim=-1).values
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
            nxt = torch.argmax(last, dim=-1)  # first index on ties
            greedy.append(nxt)
            if step == max_new - 1:
                break
            res = model(input_ids=nxt[:, None], mems=mems)
            mems, last = res.mems, res.prediction_scores[:, -1]
        out["greedy_ids"] = torch.stack(greedy, dim=1).numpy().astype(np.int64)
    return out, margins


def _inputs_from(npz_path: str) -> dict:
    with np.load(npz_path, allow_pickle=False) as data:
        return {k: data[k] for k in ("input_ids", "segment_len", "greedy_prompt", "greedy_max_new_tokens")}


def reference_outputs(case_dir: str, inputs: dict | None = None) -> dict[str, np.ndarray]:
    """Reload the HF checkpoint in ``case_dir`` and recompute all reference arrays.

    The inputs (``input_ids``, ``segment_len``, ``greedy_prompt``,
    ``greedy_max_new_tokens``) are read from ``case_dir/reference.npz`` unless
    given in ``inputs``; a folder without reference.npz whose case is the
    ``.bin`` copy of another case (``adaptive_div4_bin``) reads the other
    case's file next to it.  Returns a dict with the same keys as
    reference.npz.
    """
    if inputs is None:
        npz = os.path.join(case_dir, "reference.npz")
        if not os.path.exists(npz):
            name = os.path.basename(os.path.normpath(case_dir))
            if name in CASES and CASES[name].weights_of:
                npz = os.path.join(os.path.dirname(os.path.normpath(case_dir)), CASES[name].weights_of, "reference.npz")
        inputs = _inputs_from(npz)
    model = load_model(case_dir)
    refs, _ = _compute_references(model, inputs)
    return refs


# --------------------------------------------------------------------------
# Seed search
# --------------------------------------------------------------------------


def _cluster_of(config, token: int) -> int:
    return sum(token >= c for c in config.cutoffs)


def _judge(config, refs: dict, margins: list) -> str | None:
    """Return None if the outputs are interesting, else the reason."""
    greedy = refs["greedy_ids"]
    if (greedy == EOS_ID).any():
        return "eos generated"  # keeps the reference free of any stop-at-eos question
    if len({int(t) for t in greedy.ravel()}) < 8:
        return "too few distinct greedy tokens"
    if min(len(set(row.tolist())) for row in greedy) < 5:
        return "a greedy row has fewer than 5 distinct tokens"
    if max(len(list(run)) for row in greedy.tolist() for _, run in itertools.groupby(row)) > 3:
        return "a token repeats more than 3 times in a row"
    if config.cutoffs and len({_cluster_of(config, int(t)) for t in greedy.ravel()}) < 2:
        return "greedy tokens from one cluster only"
    if min(margins) < MIN_MARGIN:
        return "greedy margin too small"
    lp = np.concatenate([refs[f"log_probs_{k}"] for k in range(N_SEGMENTS)], axis=1)
    entropy = -(np.exp(lp) * lp).sum(-1).mean()
    if entropy > MAX_ENTROPY_FRACTION * math.log(config.vocab_size):
        return "log-probs too close to uniform"
    if np.abs(refs["log_probs_2"] - refs["log_probs_nomem_2"]).max() < MIN_MEMORY_EFFECT:
        return "memory makes no difference"
    return None


def _search_seed(case: Case, max_tries: int):
    config = _make_config(case.config)
    reasons: dict[str, int] = {}
    for seed in range(case.first_seed, case.first_seed + max_tries):
        model = _new_model(case, seed)
        refs, margins = _compute_references(model, make_inputs(config, seed))
        reason = _judge(config, refs, margins)
        if reason is None:
            return seed, refs, margins, reasons
        reasons[reason] = reasons.get(reason, 0) + 1
    raise RuntimeError(f"{case.name}: no acceptable seed in {max_tries} tries: {reasons}")


# --------------------------------------------------------------------------
# Word vocabulary (vocab.pkl)
# --------------------------------------------------------------------------


def _vocab_symbols(vocab_size: int) -> list[list[str]]:
    """Sentences whose counted words, after the specials, give ``vocab_size`` symbols."""
    sents = [line.split() for line in VOCAB_CORPUS.splitlines() if line.strip()]
    distinct = {w for s in sents for w in s} - {"<eos>", "<unk>"}
    n_filler = vocab_size - 2 - len(distinct)
    if n_filler < 0:
        raise ValueError("vocab_size too small for the corpus")
    # filler words seen once each, so they come last in the count order
    sents.append([f"word{i:04d}" for i in range(n_filler)])
    return sents


def write_vocab_pkl(folder: str, vocab_size: int) -> list[str]:
    """Write ``folder/vocab.pkl`` with HF's TransfoXLTokenizer; return idx2sym.

    The pickle contains a set (inside HF's added-token Trie), so its bytes
    depend on PYTHONHASHSEED; ``_write_vocab_files`` runs this in a child
    process with PYTHONHASHSEED=0.
    """
    from transformers import TransfoXLTokenizer

    with _hf_silent(transformers.logging.CRITICAL):  # the constructor logs a deprecation error
        tok = TransfoXLTokenizer(special=["<eos>", "<unk>"], lower_case=False)
    tok.count_sents(_vocab_symbols(vocab_size))
    tok.build_vocab()
    if len(tok.idx2sym) != vocab_size:
        raise RuntimeError(f"vocab has {len(tok.idx2sym)} symbols, wanted {vocab_size}")
    (path,) = tok.save_vocabulary(folder)
    if os.path.basename(path) != "vocab.pkl":
        raise RuntimeError(f"save_vocabulary wrote {path}")
    return list(tok.idx2sym)


def _write_vocab_files(folder: str, vocab_size: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--write-vocab-pkl", folder, str(vocab_size)],
        env=env,
        check=True,
    )
    import pickle

    class RecordingUnpickler(pickle.Unpickler):
        """Plain unpickling that notes every class the file refers to."""

        def find_class(self, module, name):
            classes.add(f"{module}.{name}")
            return super().find_class(module, name)

    classes: set[str] = set()
    with open(os.path.join(folder, "vocab.pkl"), "rb") as f:
        state = RecordingUnpickler(f).load()  # our own file, just written
    idx2sym = list(state["idx2sym"])
    with open(os.path.join(folder, "vocab_words.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(sym + "\n" for sym in idx2sym))
    # HF's own loader must read it back to the same symbols (it unpickles
    # only when TRUST_REMOTE_CODE is set)
    from transformers import TransfoXLTokenizer

    saved = os.environ.get("TRUST_REMOTE_CODE")
    os.environ["TRUST_REMOTE_CODE"] = "True"
    try:
        with _hf_silent(transformers.logging.CRITICAL):
            tok = TransfoXLTokenizer.from_pretrained(folder)
    finally:
        if saved is None:
            del os.environ["TRUST_REMOTE_CODE"]
        else:
            os.environ["TRUST_REMOTE_CODE"] = saved
    if list(tok.idx2sym) != idx2sym or tok.sym2idx["<eos>"] != EOS_ID:
        raise RuntimeError("TransfoXLTokenizer does not read vocab.pkl back")
    sample = "The bridge in Zürich carried 12 @,@ 400 carts ."
    ids = tok.convert_tokens_to_ids(sample.split())
    return {
        "keys": list(state),
        "classes": sorted(classes),
        "sample": (sample, ids),
        "size": len(idx2sym),
    }


# --------------------------------------------------------------------------
# Writing one case
# --------------------------------------------------------------------------


def _fmt_rows(arr: np.ndarray) -> str:
    return "\n".join("      " + " ".join(str(int(t)) for t in row) for row in arr)


def _safetensors_names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return sorted(f.keys())


def _check_same(name: str, refs: dict, expected: dict, exact_floats: bool = False) -> None:
    for key, value in expected.items():
        got = refs[key]
        if got.shape != value.shape or got.dtype != value.dtype:
            raise RuntimeError(f"{name}: {key} has {got.dtype}{got.shape}, expected {value.dtype}{value.shape}")
        if value.dtype.kind in "iu" or exact_floats:
            if not np.array_equal(got, value):
                raise RuntimeError(f"{name}: {key} differs")
        elif not np.allclose(got, value, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"{name}: {key} differs by {np.abs(got - value).max()}")


def build_case(case: Case, out_dir: str, max_tries: int = 500) -> dict:
    base = _base_case(case)
    seed, search_refs, margins, rejected = _search_seed(base, max_tries)
    folder = os.path.join(out_dir, case.name)
    model = _new_model(base, seed)
    inputs = {k: search_refs[k] for k in ("input_ids", "segment_len", "greedy_prompt", "greedy_max_new_tokens")}

    if case.weights_of:
        _save_bin(model, folder)
        vocab = _write_vocab_files(folder, model.config.vocab_size)
    else:
        _save_safetensors(model, folder)
        vocab = None

    # Everything below comes from the checkpoint as written.
    model, info = load_model(folder, return_info=True)
    refs = reference_outputs(folder, inputs)
    _check_same(case.name, refs, search_refs)
    if case.weights_of:
        # the .bin copy must give exactly what the safetensors case stored
        base_npz = os.path.join(out_dir, case.weights_of, "reference.npz")
        if os.path.exists(base_npz):
            with np.load(base_npz, allow_pickle=False) as data:
                _check_same(case.name, refs, {k: data[k] for k in data.files}, exact_floats=True)
            print(f"   {case.name}: outputs identical to {case.weights_of}/reference.npz")
    else:
        np.savez_compressed(os.path.join(folder, "reference.npz"), **refs)
        with np.load(os.path.join(folder, "reference.npz"), allow_pickle=False) as check:
            assert sorted(check.files) == sorted(refs), "reference.npz round trip"

    cfg = model.config
    files = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    print(f"== {case.name}  (seed {seed}, {sum(rejected.values())} seeds rejected: {rejected})")
    print(f"   cutoffs {cfg.cutoffs}, div_val {cfg.div_val}, d_model {cfg.d_model}, d_embed {cfg.d_embed}, "
          f"tie_projs {cfg.tie_projs}, mem_len {cfg.mem_len}, clamp_len {cfg.clamp_len}, "
          f"same_length {cfg.same_length}, pre_lnorm {cfg.pre_lnorm}, untie_r {cfg.untie_r}")
    print(f"   mems shapes: {[refs[f'mems_{k}'].shape for k in range(N_SEGMENTS)]}")
    lp = refs["log_probs_0"]
    print(f"   mean max prob {np.exp(lp.max(-1)).mean():.3f}, "
          f"memory effect on segment 2 {np.abs(refs['log_probs_2'] - refs['log_probs_nomem_2']).max():.3f}, "
          f"smallest greedy margin {min(margins):.4f}")
    print("   greedy_prompt:\n" + _fmt_rows(refs["greedy_prompt"]))
    print("   greedy_ids:\n" + _fmt_rows(refs["greedy_ids"]))
    weights_file = os.path.join(folder, "model.safetensors")
    if os.path.exists(weights_file):
        names = _safetensors_names(weights_file)
        all_names = sorted(model.state_dict())
        print(f"   model.safetensors holds {len(names)} tensors; left out (tied): "
              f"{sorted(set(all_names) - set(names))}")
    else:
        sd = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
        print(f"   pytorch_model.bin holds {len(sd)} tensors")
    if vocab:
        print(f"   vocab.pkl: {vocab['size']} symbols, top-level keys {vocab['keys']}")
        print(f"   vocab.pkl classes: {vocab['classes']}")
        print(f"   sample {vocab['sample'][0]!r} -> {vocab['sample'][1]}")
    print("   HF loading info:", {k: v for k, v in info.items() if v})
    print("   files:", ", ".join(f"{k} ({v} B)" for k, v in files.items()))
    return {"seed": seed, "files": files}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: the transfo_xl folder next to this script)")
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="build only this case (repeatable)")
    parser.add_argument("--max-tries", type=int, default=500, help="seeds to try per case")
    parser.add_argument("--write-vocab-pkl", nargs=2, metavar=("DIR", "VOCAB_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.write_vocab_pkl:
        write_vocab_pkl(args.write_vocab_pkl[0], int(args.write_vocab_pkl[1]))
        return 0

    torch.set_num_threads(1)  # deterministic reductions, and it is tiny anyway
    os.makedirs(args.out, exist_ok=True)
    names = args.only or list(CASES)
    summary = {}
    for name in names:
        summary[name] = build_case(CASES[name], args.out, args.max_tries)
    print("seeds:", json.dumps({k: v["seed"] for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
