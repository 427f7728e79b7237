"""Scores of given texts (issue 29): how likely a seq2seq model finds each target given its
source (`score_pairs`), and documents ranked for a query (`rerank`): monoT5's rule for a seq2seq
model, cosine similarity of the embeddings for a sentence-embedding model.

Both run the model's teacher-forced `forward` (encoder, then the decoder over the given ids at
once) in batches whose logits stay within LOGITS_BUDGET bytes, so a 250k-word vocabulary does not
make a batch of long targets a gigabyte; a batch the arena cannot hold runs as two halves (down to
one row), and `cancel` (a threading.Event: a server's client gone) stops the work between
batches with `Cancelled`. A target's ids are those transformers' tokenizer gives
as labels (`</s>` closing them), fed after the decoder start token: its score is the sum (or,
`normalize`, the mean) of each token's log-probability, the log-softmax of the logits before
any sampling setting, as transformers' `-loss * len` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .embedding import text_list
from .errors import ArenaExhausted, Cancelled, InputError
from .padding import right_padded
from .tokenizers.select import need_tokenizer

LOGITS_BUDGET = 256 << 20       # bytes of float32 logits one forward pass may return
SCORE_CHUNK_ROWS = 16           # rows of logits turned into log-probabilities at a time
EMBED_WINDOW = 256              # texts per embed call of `similarities` (cancel between them)
MONOT5_TEMPLATE = "Query: {query} Document: {document} Relevant:"
MONOT5_WORDS = ("true", "false")   # monoT5's labels: P(first) of the two at the first step


@dataclass(frozen=True)
class PairScore:
    """One (source, target) pair: the target's token ids (`</s>` last), each one's
    log-probability given the source and the tokens before it, and their sum."""
    token_ids: list[int]
    token_logprobs: list[float]

    @property
    def total(self) -> float:
        return float(np.sum(self.token_logprobs, dtype=np.float64))

    @property
    def mean(self) -> float:
        return self.total / len(self.token_logprobs)


def score_pairs(model: Any, sources: str | Sequence[str], targets: str | Sequence[str],
                batch_size: int = 16, cancel: Any = None) -> list[PairScore]:
    """Each target's log-likelihood given its source; one source scores every target, or the
    two lists pair up (equal lengths)."""
    _check_seq2seq(model, "score_pairs()")
    sources, targets = _paired(sources, targets, "score_pairs()", "sources", "targets")
    tok = need_tokenizer(model, "score_pairs()")
    src = [tok.encode(s, add_eos=model.add_eos_to_prompt) for s in sources]
    tgt = [tok.encode(t, add_eos=True) for t in targets]
    start = model.token_ids.start
    out: list[PairScore | None] = [None] * len(src)

    def run(rows: list[int]) -> None:
        ids, mask = right_padded([src[i] for i in rows], model.token_ids.pad)
        dec, _ = right_padded([[start] + tgt[i][:-1] for i in rows], model.token_ids.pad)
        logits = model.forward(ids, dec, mask)                         # (b, T, V)
        for r, i in enumerate(rows):
            picked = picked_logprobs(logits[r, :len(tgt[i])], tgt[i])
            out[i] = PairScore(tgt[i], [float(v) for v in picked])
    for rows in _batches(model, [len(t) for t in tgt], batch_size):
        _in_halves(run, rows, cancel)
    return out   # type: ignore[return-value]


def rerank(model: Any, query: str, documents: str | Sequence[str], *, top_n: int | None = None,
           words: tuple[str, str] = MONOT5_WORDS, batch_size: int = 16,
           max_input_tokens: int | None = None, cancel: Any = None) -> list[tuple[int, float]]:
    """(document index, relevance) best first, at most `top_n`. A model with a decoder: monoT5's
    P(words[0]) from the softmax over the two words' logits at the first decoder step of
    MONOT5_TEMPLATE, whose documents are cut to fit `max_input_tokens` when given (see
    monot5_inputs); an encoder alone (a sentence-embedding model): the cosine similarity of the
    query's and each document's embeddings (each text cut at the model's max_seq_length, as
    embed cuts it; max_input_tokens is for monoT5's inputs and refused here)."""
    if not isinstance(query, str):
        raise InputError(f"rerank(): query must be a string, got {type(query).__name__}")
    documents = text_list(documents, "rerank()")
    if not documents:
        raise InputError("rerank(): expected a document or a non-empty list of documents")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise InputError(f"rerank(): top_n must be a positive integer, got {top_n!r:.40}")
    if has_decoder(model):
        scores = _monot5(model, monot5_inputs(model, query, documents, max_input_tokens), words,
                         batch_size, cancel)
    elif max_input_tokens is not None:
        raise InputError("rerank(): max_input_tokens cuts a seq2seq reranker's inputs; an "
                         "embedding model cuts every text at its own max_seq_length")
    else:
        scores = similarities(model, query, documents, batch_size, cancel)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    return [(i, float(scores[i])) for i in order[:top_n]]


def similarities(model: Any, texts_1: str | Sequence[str], texts_2: str | Sequence[str],
                 batch_size: int = 16, cancel: Any = None) -> np.ndarray:
    """Cosine similarity of each pair's embeddings (one text against a list, or two lists of one
    length): what a sentence-embedding model scores pairs by. Each distinct text is embedded
    once, EMBED_WINDOW texts a call (cancel is checked between calls)."""
    a, b = _paired(texts_1, texts_2, "similarities()", "texts_1", "texts_2")
    unique = list(dict.fromkeys(a + b))
    where = {t: i for i, t in enumerate(unique)}
    parts = []
    for start in range(0, len(unique), EMBED_WINDOW):
        _check(cancel)
        parts.append(model.embed(unique[start:start + EMBED_WINDOW], batch_size=batch_size))
    vectors = np.concatenate(parts).astype(np.float64)
    va, vb = vectors[[where[t] for t in a]], vectors[[where[t] for t in b]]
    norms = np.maximum(np.linalg.norm(va, axis=1) * np.linalg.norm(vb, axis=1), 1e-24)
    return np.einsum("ij,ij->i", va, vb) / norms


def has_decoder(model: Any) -> bool:
    """Whether the model scores texts by its decoder (seq2seq) rather than by embeddings."""
    return bool(getattr(model, "is_encoder_decoder", False)) and "decoder" in model.parts


def monot5_inputs(model: Any, query: str, documents: Sequence[str],
                  max_input_tokens: int | None = None) -> list[list[int]]:
    """Each document's monoT5 input ids (MONOT5_TEMPLATE, `</s>` as the model adds it). With
    max_input_tokens, a longer input keeps the query and the template whole and cuts the
    document's tokens until it fits (re-tokenized: a cut can change how its neighbours join);
    a query that leaves no room is an InputError."""
    tok = need_tokenizer(model, "rerank()")
    if max_input_tokens is not None and (not isinstance(max_input_tokens, int) or
                                         isinstance(max_input_tokens, bool) or
                                         max_input_tokens < 1):
        raise InputError("rerank(): max_input_tokens must be a positive integer, got "
                         f"{max_input_tokens!r:.40}")

    def encoded(document: str) -> list[int]:
        return tok.encode(MONOT5_TEMPLATE.format(query=query, document=document),
                          add_eos=model.add_eos_to_prompt)
    inputs = []
    for d in documents:
        ids = encoded(d)
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            ids = _cut_to_fit(tok, encoded, d, len(ids) - max_input_tokens, max_input_tokens)
        inputs.append(ids)
    return inputs


def _cut_to_fit(tok: Any, encoded: Callable[[str], list[int]], document: str, over: int,
                limit: int) -> list[int]:
    """The template's ids with the document's tokens cut by `over` (and more while it is still
    longer than `limit`)."""
    kept = tok.encode(document, add_eos=False)
    keep = len(kept) - over
    while keep > 0:
        ids = encoded(tok.decode(kept[:keep], skip_special_tokens=True))
        if len(ids) <= limit:
            return ids
        keep -= max(1, len(ids) - limit)
    ids = encoded("")
    if len(ids) > limit:
        raise InputError(f"query: monoT5's template with this query is {len(ids)} tokens before "
                         f"any document, more than max_input_tokens {limit}")
    return ids


def _monot5(model: Any, inputs: list[list[int]], words: tuple[str, str], batch_size: int,
            cancel: Any) -> np.ndarray:
    tok = need_tokenizer(model, "rerank()")
    pair = []
    for word in words:
        ids = tok.encode(word, add_eos=False)
        if len(ids) != 1:
            raise InputError(f"rerank(): the word {word!r:.40} is {len(ids)} tokens in this "
                             "model's vocabulary; monoT5's rule needs one token per word")
        pair.append(ids[0])
    scores = np.empty(len(inputs), np.float64)

    def run(rows: list[int]) -> None:
        ids, mask = right_padded([inputs[i] for i in rows], model.token_ids.pad)
        first = np.full((len(rows), 1), model.token_ids.start, np.int64)
        two = model.forward(ids, first, mask)[:, 0, pair].astype(np.float64)   # (b, 2)
        two -= two.max(axis=1, keepdims=True)
        p = np.exp(two)
        scores[rows] = p[:, 0] / p.sum(axis=1)
    for rows in _batches(model, [1] * len(inputs), batch_size):
        _in_halves(run, rows, cancel)
    return scores


def _in_halves(run: Callable[[list[int]], None], rows: list[int], cancel: Any) -> None:
    """run(rows), or, when the arena cannot hold that batch now, its two halves (down to one
    row, whose ArenaExhausted is the caller's); `cancel` checked before each."""
    _check(cancel)
    try:
        run(rows)
    except ArenaExhausted:
        if len(rows) == 1:
            raise
        half = len(rows) // 2
        _in_halves(run, rows[:half], cancel)
        _in_halves(run, rows[half:], cancel)


def _check(cancel: Any) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled")


def _batches(model: Any, lengths: list[int], batch_size: int) -> list[list[int]]:
    """Row indices in batches of at most batch_size whose (rows, longest, vocabulary) float32
    logits stay within LOGITS_BUDGET; rows of similar length together (shortest first)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r:.40}")
    per_token = 4 * model.config.vocab_size
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, rows = [], []
    for i in order:
        longest = max([lengths[j] for j in rows] + [lengths[i]])
        if rows and (len(rows) == batch_size or (len(rows) + 1) * longest * per_token > LOGITS_BUDGET):
            batches.append(rows)
            rows = []
        rows.append(i)
    if rows:
        batches.append(rows)
    return batches


def picked_logprobs(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """Rows of logits (n, V) and one token per row -> that token's log-probability (n,) float64,
    a few rows at a time (float32 copies of SCORE_CHUNK_ROWS rows, sums in float64): no (n, V)
    float64 array."""
    n = len(tokens)
    out = np.empty(n, np.float64)
    for a in range(0, n, SCORE_CHUNK_ROWS):
        x = logits[a:a + SCORE_CHUNK_ROWS]
        top = x.max(axis=1, keepdims=True)
        lse = np.log(np.exp(x - top).sum(axis=1, dtype=np.float64)) + top[:, 0]
        out[a:a + len(x)] = x[np.arange(len(x)), tokens[a:a + len(x)]] - lse
    return out


def _paired(a: Any, b: Any, what: str, a_name: str, b_name: str) -> tuple[list[str], list[str]]:
    """One text against a list, or two lists of one length -> two lists of one length."""
    one_a, one_b = isinstance(a, str), isinstance(b, str)
    a, b = text_list(a, what), text_list(b, what)
    if not a or not b:
        raise InputError(f"{what}: {a_name} and {b_name} must not be empty")
    if one_a or len(a) == 1:
        a = a * len(b)
    elif one_b or len(b) == 1:
        b = b * len(a)
    if len(a) != len(b):
        raise InputError(f"{what}: {len(a)} {a_name} and {len(b)} {b_name}: give one of them, "
                         "or as many of each")
    return a, b


def _check_seq2seq(model: Any, what: str) -> None:
    if not has_decoder(model):
        raise InputError(f"{what} needs an encoder-decoder model with its decoder; "
                         f"{model.folder} is {getattr(model.family, 'name', 'another kind')}"
                         f"{' (encoder only)' if getattr(model, 'is_encoder_decoder', False) else ''}")
