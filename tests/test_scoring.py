"""model.score_pairs and model.rerank (issue 29): log-likelihoods of given targets equal the
log-softmax of `forward`'s logits (itself checked against transformers by the parity tests),
monoT5's P("true"), cosine similarity for an embedding model, batching that changes nothing,
one-line errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from factories import write_t5

import minfer
from minfer import InputError, scoring

ROOT = Path(__file__).resolve().parent.parent
DATES = ROOT / "weights" / "tiny-t5-dates"
ST = ROOT / "weights" / "family" / "st_sentence_t5"
T5_TOKENIZER = Path("/work/shared/t5-tokenizer")


@pytest.fixture(scope="module")
def dates():
    return minfer.load(DATES)


def reference_logprobs(model, source: str, target: str) -> np.ndarray:
    """log p(target token t | source, tokens < t) from one forward pass, in NumPy float64."""
    src = model.tokenizer.encode(source)
    tgt = model.tokenizer.encode(target)
    logits = model.forward([src], [[model.token_ids.start] + tgt[:-1]])[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    return logp[np.arange(len(tgt)), tgt]


def test_pair_scores_are_the_targets_log_softmax_under_forward(dates):
    source = "date: 4th of July 1976"
    targets = ["1976-07-04", "1977-07-04", "a longer target that is not a date at all"]
    got = dates.score_pairs(source, targets)
    assert [g.token_ids for g in got] == [dates.tokenizer.encode(t) for t in targets]
    for g, t in zip(got, targets):
        want = reference_logprobs(dates, source, t)
        assert np.allclose(g.token_logprobs, want, atol=1e-4)
        assert g.total == pytest.approx(want.sum(), abs=1e-3)
        assert g.mean == pytest.approx(want.mean(), abs=1e-4)
    # the model's own answer is the likeliest, the wrong year next, nonsense last
    assert got[0].total > got[1].total > got[2].total


def test_pairs_in_any_batch_size_and_order_score_the_same(dates):
    sources = ["date: 1 May 2001", "date: 12 March 1999", "date: 30 Dec 1850"]
    targets = ["2001-05-01", "1999-03-12", "1850-12-30"]
    one_by_one = [dates.score_pairs(s, t)[0].token_logprobs for s, t in zip(sources, targets)]
    together = dates.score_pairs(sources, targets, batch_size=2)
    for a, b in zip(one_by_one, together):
        assert np.allclose(a, b.token_logprobs, atol=1e-5)


def test_small_logit_budgets_cut_the_batches(dates, monkeypatch):
    monkeypatch.setattr(scoring, "LOGITS_BUDGET", 4 * dates.config.vocab_size * 12)
    lengths = [3, 9, 4, 11, 5]
    batches = scoring._batches(dates, lengths, 16)
    assert sorted(i for b in batches for i in b) == list(range(5))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 12


@pytest.mark.parametrize("sources,targets,said", [
    (["a", "b"], ["x", "y", "z"], "2 sources and 3 targets"),
    ([], ["x"], "must not be empty"),
    ("a", [1], "not a string"),
])
def test_bad_pairs_are_one_line(dates, sources, targets, said):
    with pytest.raises(InputError, match=said):
        dates.score_pairs(sources, targets)


def test_models_without_a_decoder_refuse_pair_scores():
    with pytest.raises(InputError, match="needs an encoder-decoder model with its decoder"):
        minfer.load(ST).score_pairs("a", "b")


def test_monot5_relevance_is_p_true_at_the_first_step(dates):
    """Words that are one token in the tiny vocabulary stand for "true" / "false"."""
    words = ("July", "date")
    ids = [dates.tokenizer.encode(w, add_eos=False) for w in words]
    assert all(len(i) == 1 for i in ids)
    docs = ["first document", "second one, a bit longer", "third"]
    got = dates.rerank("a query", docs, words=words, batch_size=2)
    assert sorted(i for i, _ in got) == [0, 1, 2]
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)
    for i, score in got:
        text = scoring.MONOT5_TEMPLATE.format(query="a query", document=docs[i])
        logits = dates.forward([dates.tokenizer.encode(text)], [[0]])[0, 0].astype(np.float64)
        two = logits[[ids[0][0], ids[1][0]]]
        assert score == pytest.approx(np.exp(two[0]) / np.exp(two).sum(), abs=1e-6)
    assert dates.rerank("a query", docs, words=words, top_n=2) == got[:2]


def test_rerank_equals_transformers_monot5_relevance(dates):
    """weights/make_rerank_fixtures.py: HF's T5ForConditionalGeneration and tokenizer on the same
    model give each document's P(words[0]); minfer's ids, scores (1e-4) and order are theirs."""
    ref = json.loads((ROOT / "weights" / "t5" / "rerank_reference.json").read_text())
    assert scoring.MONOT5_TEMPLATE == ref["template"]
    inputs = scoring.monot5_inputs(dates, ref["query"], ref["documents"])
    assert inputs == ref["input_ids"]
    got = dates.rerank(ref["query"], ref["documents"], words=tuple(ref["words"]), batch_size=4)
    assert [i for i, _ in got] == ref["order"]
    assert np.allclose([s for _, s in got], [ref["scores"][i] for i in ref["order"]], atol=1e-4)


def test_long_documents_are_cut_to_fit_max_input_tokens(dates):
    """The query and the template stay whole; a long document keeps its first tokens (as many
    as fit); one that fits is untouched; the scores are P(word 0) over the cut inputs."""
    words = ("July", "date")
    query, limit = "a query", 48
    docs = ["short one", "a long document " * 20, "another rather long text, " * 12]
    inputs = scoring.monot5_inputs(dates, query, docs, limit)
    tok = dates.tokenizer
    whole = [tok.encode(scoring.MONOT5_TEMPLATE.format(query=query, document=d)) for d in docs]
    assert inputs[0] == whole[0] and len(whole[1]) > limit and len(whole[2]) > limit
    for ids, d in zip(inputs[1:], docs[1:]):
        assert len(ids) <= limit
        text = tok.decode(ids, skip_special_tokens=True)
        assert text.startswith(f"Query: {query} Document:") and text.endswith("Relevant:")
        kept = text[len(f"Query: {query} Document: "):-len(" Relevant:")].strip()
        assert kept and d.startswith(kept)                      # the document's beginning
    got = dict(dates.rerank(query, docs, words=words, max_input_tokens=limit))
    pair = [tok.encode(w, add_eos=False)[0] for w in words]
    for i, ids in enumerate(inputs):
        two = dates.forward([ids], [[0]])[0, 0, pair].astype(np.float64)
        # (the batch is padded: its products round differently from one row's, ~1e-6 here)
        assert got[i] == pytest.approx(np.exp(two[0]) / np.exp(two).sum(), abs=3e-6)
    with pytest.raises(InputError, match="before any document"):
        scoring.monot5_inputs(dates, "a very long query " * 10, docs, limit)
    with pytest.raises(InputError, match="max_input_tokens must be a positive integer"):
        scoring.monot5_inputs(dates, query, docs, 0)


def test_an_embedding_reranker_refuses_max_input_tokens():
    with pytest.raises(InputError, match="cuts every text at its own max_seq_length"):
        minfer.load(ST).rerank("q", ["d"], max_input_tokens=8)


def test_monot5_words_must_be_single_tokens(dates):
    with pytest.raises(InputError, match="monoT5's rule needs one token per word"):
        dates.rerank("q", ["d"])      # "true" is several pieces in the tiny vocabulary


@pytest.mark.skipif(not T5_TOKENIZER.is_dir(), reason="the real T5 tokenizer is not here")
def test_a_monot5_shaped_model_reads_the_real_true_and_false(tmp_path):
    folder = write_t5(tmp_path / "mono", seed=5, vocab_size=32128, d_model=32, d_kv=8,
                      num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2)
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(T5_TOKENIZER / name, folder / name)
    m = minfer.load(folder)
    true, false = (m.tokenizer.encode(w, add_eos=False) for w in scoring.MONOT5_WORDS)
    assert len(true) == len(false) == 1
    docs = ["Cats are small furry animals.", "The stock market fell.", "Purring cats."]
    got = dict(m.rerank("what are cats?", docs))
    for i, d in enumerate(docs):
        text = scoring.MONOT5_TEMPLATE.format(query="what are cats?", document=d)
        logits = m.forward([m.tokenizer.encode(text)], [[0]])[0, 0].astype(np.float64)
        two = logits[[true[0], false[0]]]
        assert got[i] == pytest.approx(np.exp(two[0]) / np.exp(two).sum(), abs=1e-6)


def test_an_embedding_model_ranks_by_cosine_similarity():
    m = minfer.load(ST)
    docs = ["a cat sat", "the market fell", "cats sit"]
    got = m.rerank("a cat", docs, top_n=3)
    v = m.embed(["a cat", *docs]).astype(np.float64)
    cos = v[1:] @ v[0] / (np.linalg.norm(v[1:], axis=1) * np.linalg.norm(v[0]))
    assert [i for i, _ in got] == list(np.argsort(-cos))
    assert np.allclose([s for _, s in got], np.sort(cos)[::-1], atol=1e-6)


@pytest.mark.parametrize("kwargs,said", [
    (dict(query=5, documents=["d"]), "query must be a string"),
    (dict(query="q", documents=[]), "non-empty list of documents"),
    (dict(query="q", documents=["d"], top_n=0), "top_n must be a positive integer"),
])
def test_bad_rerank_calls_are_one_line(kwargs, said):
    with pytest.raises(InputError, match=said):
        minfer.load(ST).rerank(**kwargs)


def test_a_batch_the_arena_cannot_hold_runs_in_halves(tmp_path):
    """A small workspace: the 16-pair batch does not fit at once; halves do, with the same
    values as a roomy arena gives."""
    sources = [f"date: {d} May 2001" for d in range(1, 17)]
    targets = [f"2001-05-{d:02d}" for d in range(1, 17)]
    want = minfer.load(DATES).score_pairs(sources, targets)
    small = minfer.load(DATES, workspace="1MiB")
    rows, forward = [], small.forward

    def counted(input_ids, *args, **kwargs):
        rows.append(len(input_ids))
        return forward(input_ids, *args, **kwargs)
    small.forward = counted
    got = small.score_pairs(sources, targets)
    assert rows[0] == 16 and max(rows[1:]) < 16      # the whole batch ran out: halves ran
    for a, b in zip(want, got):
        assert np.allclose(a.token_logprobs, b.token_logprobs, atol=1e-5)


def test_a_cancel_stops_the_work_between_batches(dates, monkeypatch):
    import threading
    cancel = threading.Event()
    calls = []
    forward = dates.forward

    def counted(*args, **kwargs):
        calls.append(1)
        cancel.set()              # the client leaves during the first batch
        return forward(*args, **kwargs)
    monkeypatch.setattr(dates, "forward", counted)
    with pytest.raises(minfer.Cancelled):
        scoring.score_pairs(dates, "date: 1 May 2001", ["a"] * 8, batch_size=2, cancel=cancel)
    assert len(calls) == 1
    cancel.clear()
    calls.clear()
    with pytest.raises(minfer.Cancelled):
        scoring.rerank(dates, "q", ["d"] * 8, words=("July", "date"), batch_size=2,
                       cancel=cancel)
    assert len(calls) == 1
