"""Structured output: the tokens a grammar forbids are masked before each choice, so the text
always parses (JSON) or is one of the given choices.

What can be asked (`response_format`, OpenAI's shapes plus a choice list, as vLLM's
structured-outputs extra offers): {"type": "text"} (nothing), {"type": "json_object"} (any JSON
object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}} (a value valid
against the schema: `enum`, `const`, `required`, `additionalProperties`, `minLength` /
`maxLength`, `minimum` / `maximum`, nested objects and arrays) and {"type": "choice", "choice":
[...]} (exactly one of the strings). Between JSON tokens at most one space is allowed (no
newlines, no runs of blanks), so a weak model has no room to wander before it closes a value.

The grammar engine is llguidance (pyproject's [structured] extra says why): its matcher keeps
one sequence's parse state, writes the mask of allowed next tokens as a bitmask (one bit per
token) and consumes the chosen token. The engine sees the model's own vocabulary through
minfer's tokenizer interface (tokenizer.json, spiece.model, ByT5 bytes or BPE alike): each id's
bytes are what `decode` adds for it after another token (SentencePiece's "▁" is a space),
byte-fallback pieces their byte, special tokens (pad, unk, sentinels) never allowed. A
SentencePiece decoder drops the first token's "▁", so a choice may begin with one space that
the text will not show; JSON allows one anyway.

T5's SentencePiece vocabulary has no "{" or "}" (nor "\\"): a JSON object cannot be written by
it, and asking for one is refused before decoding starts, naming the character. When a
grammar reaches a point that the vocabulary cannot continue (llguidance's mask can offer a
token that then fails, for bytes no token writes), the request fails naming it, rather than
emit an invalid text. Near `max_new_tokens` the choice is steered towards closing (eos where the
grammar may end, else tokens that close a string, object or array); a text cut by the length
limit is reported with finish_reason "length", as any other.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from ..io.limits import short_repr

FIELD = "response_format"
MAX_CHOICES = 1024            # choice strings per request, and characters per choice: the
MAX_CHOICE_CHARS = 1024       # grammar is built per request, so its size stays bounded
MAX_SCHEMA_CHARS = 64 << 10   # a schema's JSON text at most (a request body is bounded too)
# Steps before max_new_tokens from which the choice is steered towards closing the value: enough
# for a few nested closers and a required key or two, few enough to leave the model its say.
CLOSING_STEPS = 12
CLOSERS = b'"}]'   # what closes a string, an object, an array
# JSON's separators: at most one space between tokens (llguidance's whitespace lexeme)
_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}


# -- what was asked -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseFormat:
    """A checked response format: kind "json_object", "json_schema" or "choice"."""
    kind: str
    schema: str | None = None           # the JSON schema as canonical JSON text (json_schema)
    choices: tuple[str, ...] = ()       # (choice)
    name: str | None = None             # the schema's name, as OpenAI's json_schema carries it


def _bad(what: str) -> InputError:
    return InputError(f"{FIELD}: {what}")


def check_format(value: Any) -> ResponseFormat | None:
    """A request's response_format (a dict in OpenAI's shape, or a ResponseFormat) -> the checked
    ResponseFormat, or None for {"type": "text"}; anything else is an InputError naming it."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, dict):
        raise _bad(f"must be an object such as {{\"type\": \"json_object\"}}, got {short_repr(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("json_schema must be an object {\"name\", \"schema\", \"strict\"?}")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"json_schema.name must be a string, got {short_repr(name)}")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise _bad(f"json_schema.strict must be true or false, got {short_repr(spec['strict'])}")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise _bad(f"json_schema.schema must be a JSON schema object, got {short_repr(schema)}")
        text = json.dumps(schema)   # (key order kept: properties are written in it)
        if len(text) > MAX_SCHEMA_CHARS:
            raise _bad(f"json_schema.schema is {len(text)} characters of JSON, more than "
                       f"{MAX_SCHEMA_CHARS}")
        return ResponseFormat("json_schema", text, name=name)
    if kind == "choice":
        return ResponseFormat("choice", choices=check_choices(value.get("choice"), f"{FIELD}.choice"))
    raise _bad(f"type must be \"text\", \"json_object\", \"json_schema\" or \"choice\", got "
               f"{short_repr(kind)}")


def check_choices(choices: Any, field: str) -> tuple[str, ...]:
    """A non-empty list of distinct non-empty strings (label classification)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InputError(f"{field} must be a non-empty list of non-empty strings, got "
                         f"{short_repr(choices)}")
    if len(choices) > MAX_CHOICES or max(map(len, choices)) > MAX_CHOICE_CHARS:
        raise InputError(f"{field}: at most {MAX_CHOICES} choices of at most "
                         f"{MAX_CHOICE_CHARS} characters")
    return tuple(dict.fromkeys(choices))


# -- the engine's view of a vocabulary ------------------------------------------------------------
def _engine() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise InputError(f"{FIELD} needs the 'llguidance' package (pip install "
                         "'minfer[structured]')") from None
    return llguidance


class Vocabulary:
    """A tokenizer as the grammar engine sees it: each id's bytes, eos, which ids close a value,
    and whether decoding drops the first token's leading space (SentencePiece)."""

    def __init__(self, tok: Any):
        llg = _engine()
        self.eos = tok.eos_id
        # an anchor token before each id: decode() of [anchor, id] minus decode([anchor]) is the
        # text the id adds in the middle of a sequence ("▁" a space, as SentencePiece decodes it)
        anchor = tok.encode("a", add_eos=False)[:1]
        base = tok.decode(anchor)
        texts: list[bytes | None] = []
        for i in range(tok.vocab_size):
            if i in tok.special_ids or i == tok.eos_id:
                texts.append(None)
            elif i in tok.byte_ids:
                texts.append(bytes([int(tok.id_to_token(i)[3:5], 16)]))
            else:
                texts.append(tok.decode(anchor + [i])[len(base):].encode())
        self.texts = texts
        self.size = len(texts)
        self.strips_first_space = tok.decode(tok.encode(" a", add_eos=False)) == "a"
        self.singles = {t for t in texts if t is not None and len(t) <= 4}
        self.has_bytes = {t[0] for i, t in enumerate(texts) if i in tok.byte_ids and t}
        # per closer, the ids that begin with it (after at most one space): the steering's picks
        self.starts = {c: np.array([t is not None and t[t.startswith(b" "):][:1] == bytes([c])
                                    for t in texts]) for c in CLOSERS}
        # ids whose leading space shows even as the first token (a byte piece for " ", BPE's
        # "Ġ"): the first step forbids them, so the text begins where the grammar's value does
        # (a SentencePiece "▁" there is dropped by the decoder: the grammar's optional space)
        self.shows_space_first = np.array([t is not None and t.startswith(b" ")
                                           and tok.decode([i]).startswith(" ")
                                           for i, t in enumerate(texts)])

        def exact_ids(text: Any) -> list[int]:
            # llguidance asks for ids whose bytes are exactly `text` (it forces them); the
            # tokenizer's own encoding may add a word-start space, so fall back to greedy
            s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
            ids = tok.encode(s, add_eos=False)
            if all(texts[i] is not None for i in ids) and b"".join(texts[i] for i in ids) == s.encode():
                return ids
            return holder[0].greedy_tokenize(s)

        class _Source:   # what llguidance's TokenizerWrapper reads
            eos_token_id = tok.eos_id
            bos_token_id = None
            tokens = [t if t is not None else b"" for t in texts]
            special_token_ids = [i for i, t in enumerate(texts) if t is None]
            __call__ = staticmethod(exact_ids)

        holder: list[Any] = []
        self.engine = llg.LLTokenizer(llg.TokenizerWrapper(_Source()), n_vocab=self.size)
        holder.append(self.engine)

    def writes(self, char: str) -> bool:
        """Whether some id writes exactly this character (or byte pieces write its bytes)."""
        b = char.encode()
        return b in self.singles or all(x in self.has_bytes for x in b)


_vocabularies: "weakref.WeakKeyDictionary[Any, Vocabulary]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def vocabulary_of(tok: Any) -> Vocabulary:
    """The tokenizer's Vocabulary, built once (a 32k vocabulary: ~0.2 s)."""
    with _lock:
        v = _vocabularies.get(tok)
        if v is None:
            v = _vocabularies[tok] = Vocabulary(tok)
        return v


# -- a compiled grammar ---------------------------------------------------------------------------
def _needed_chars(schema: Any, out: set[str], depth: int = 0) -> None:
    """Characters any value valid against `schema` must contain (an object's braces, quotes and
    required keys, recursively; an array's brackets; a string's quotes): the vocabulary has to
    write each, else the format is refused before decoding."""
    if not isinstance(schema, dict) or depth > 32:
        return
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types == {"object"} or (types == {None} and "properties" in schema):
        out.update("{}")
        properties = schema.get("properties") or {}
        for key in schema.get("required") or ():
            if isinstance(key, str):
                out.update('"' + key)
                _needed_chars(properties.get(key), out, depth + 1)
    elif types == {"array"}:
        out.update("[]")
    elif types == {"string"}:
        out.add('"')


@dataclass
class Grammar:
    """A response format compiled for one vocabulary: new matchers start from `template`."""
    vocabulary: Vocabulary
    template: Any                        # a matcher at the start, deep-copied per sequence
    fmt: ResponseFormat

    def start(self) -> Any:
        return self.template.deep_copy()


_grammars: "collections.OrderedDict[tuple, Grammar]" = collections.OrderedDict()
_GRAMMARS_KEPT = 64   # compiled grammars kept (a server sees the same schemas again and again)


def grammar_for(tok: Any, fmt: ResponseFormat) -> Grammar:
    """`fmt` compiled for the tokenizer's vocabulary (cached); a schema the engine refuses, one
    that admits no value, or one that needs a character the vocabulary cannot write is an
    InputError naming response_format."""
    key = (id(tok), fmt)
    with _lock:
        g = _grammars.get(key)
        if g is not None and g.vocabulary is _vocabularies.get(tok):
            _grammars.move_to_end(key)
            return g
    vocab = vocabulary_of(tok)
    llg = _engine()
    source = _grammar_text(llg, vocab, fmt)
    problem = llg.LLMatcher.validate_grammar(source, vocab.engine)
    if problem and not problem.startswith("WARNING"):
        raise _bad(f"not a usable schema: {problem.strip().splitlines()[0][:200]}")
    matcher = llg.LLMatcher(vocab.engine, source, log_level=0)
    if matcher.is_error():
        raise _bad(f"not a usable schema: {matcher.get_error().splitlines()[0][:200]}")
    _check_writable(vocab, fmt)
    mask = np.zeros((1, (vocab.size + 31) // 32), np.int32)
    llg.numpy.fill_next_token_bitmask(matcher, mask)
    if not mask.any():
        raise _bad("the schema admits no value (are its bounds contradictory?)" if fmt.kind != "choice"
                   else "no choice can be written with this model's vocabulary")
    g = Grammar(vocab, matcher, fmt)
    with _lock:
        _grammars[key] = g
        while len(_grammars) > _GRAMMARS_KEPT:
            _grammars.popitem(last=False)
    return g


def _grammar_text(llg: Any, vocab: Vocabulary, fmt: ResponseFormat) -> str:
    if fmt.kind == "choice":
        # Lark string literals take JSON's escapes; one optional leading space where the decoder
        # drops the first token's (the text then shows none)
        options = " | ".join(json.dumps(c) for c in fmt.choices)
        lead = '" "? ' if vocab.strips_first_space else ""
        return llg.LLMatcher.grammar_from_lark(f"start: {lead}({options})")
    schema = json.loads(fmt.schema)
    return llg.LLMatcher.grammar_from_json_schema(schema, overrides=_WHITESPACE)


def _check_writable(vocab: Vocabulary, fmt: ResponseFormat) -> None:
    if fmt.kind == "choice":
        for c in fmt.choices:
            missing = [ch for ch in dict.fromkeys(c) if not vocab.writes(ch)]
            if missing:
                raise _bad(f"choice {c!r:.60} cannot be written with this model's vocabulary "
                           f"(no token for {missing[0]!r})")
        return
    needed: set[str] = set()
    _needed_chars(json.loads(fmt.schema), needed)
    for ch in sorted(needed):
        if not vocab.writes(ch):
            raise _bad(f"{fmt.kind} needs {ch!r}, which this model's vocabulary cannot write "
                       "(T5's SentencePiece vocabulary has no '{' or '}': use a choice list or "
                       "a model whose tokenizer adds them)")


# -- the sequences of one decoding ------------------------------------------------------------------
_executor: list[Any] = []


def _fill(grammar: Grammar, matchers: Sequence[Any]) -> np.ndarray:
    """The (b, W) int32 bitmask of each matcher's allowed next tokens; zeros for None (a beam
    that can no longer win: nothing is allowed)."""
    llg = _engine()
    mask = np.zeros((len(matchers), (grammar.vocabulary.size + 31) // 32), np.int32)
    live = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if len(live) == 1:
        m, i = live[0]
        llg.numpy.fill_next_token_bitmask(m, mask, i)
    elif live:
        with _lock:
            if not _executor:
                _executor.append(llg.LLExecutor())
        llg.numpy.fill_next_token_bitmask_par(_executor[0], live, mask)
    return mask


def allowed(mask: np.ndarray, size: int, width: int, eos_ids: Sequence[int],
            tok_eos: int | None) -> np.ndarray:
    """A (b, W) bitmask -> (b, width) bools over the model's ids: ids past the vocabulary never,
    every eos id of the model where the tokenizer's eos is allowed."""
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")   # (b, 32W)
    out = np.zeros((mask.shape[0], width), bool)
    n = min(size, width)
    out[:, :n] = bits[:, :n]
    if tok_eos is not None and tok_eos < n:
        ok = out[:, tok_eos].copy()
        for e in eos_ids:
            if e < width:
                out[:, e] = ok
    return out


class RowGrammars:
    """One matcher per row of a decoding (greedy, sampled or a beam), kept in the rows' order."""

    def __init__(self, grammar: Grammar, rows: int, eos_ids: Sequence[int]):
        self.grammar = grammar
        self.matchers: list[Any] = [grammar.start() for _ in range(rows)]
        self.nesting = [Nesting() for _ in range(rows)]
        self.eos_ids = tuple(eos_ids)

    def allowed(self, width: int, remaining: int | None = None, first: bool = False) -> np.ndarray:
        """(b, width) bools: what each row may choose next (`first`: at the first step). With
        `remaining` steps left at most
        CLOSING_STEPS, rows keep only eos (where allowed) or else their closing tokens (where any
        is allowed): a value that would be cut by the length limit is closed instead."""
        v = self.grammar.vocabulary
        ok = allowed(_fill(self.grammar, self.matchers), v.size, width, self.eos_ids, v.eos)
        if first:
            n = min(width, v.size)
            ok[:, :n] &= ~v.shows_space_first[:n]
        if remaining is not None and remaining <= CLOSING_STEPS:
            eos = [e for e in self.eos_ids if e < width]
            n = min(width, v.size)
            for r, nesting in enumerate(self.nesting):
                if eos and ok[r, eos].any():
                    ok[r] = False
                    ok[r, eos] = True
                    continue
                closer = nesting.closer()
                if closer is not None:
                    closes = np.zeros(width, bool)
                    closes[:n] = v.starts[closer][:n]
                    if (ok[r] & closes).any():   # (else a required key or value comes first)
                        ok[r] &= closes
        return ok

    def mask(self, scores: np.ndarray, rows: slice, ok: np.ndarray) -> np.ndarray:
        """Scores (r, V) with what the grammar forbids at -inf (`ok` the rows' allowed)."""
        return np.where(ok[rows], scores, np.float32(-np.inf)).astype(scores.dtype, copy=False)

    def advance(self, tokens: np.ndarray, step: int) -> None:
        """Each row's chosen token consumed (eos ends the row: nothing to consume)."""
        texts = self.grammar.vocabulary.texts
        for r, (m, t) in enumerate(zip(self.matchers, tokens)):
            if m is None or int(t) in self.eos_ids:
                continue
            if not m.consume_token(int(t)):
                raise _stuck(m, step)
            self.nesting[r] = self.nesting[r].after(texts[int(t)])

    def drop(self, rows: Sequence[int]) -> None:
        """These rows keep no state: nothing is allowed to them from now on."""
        for r in rows:
            self.matchers[int(r)] = None

    def keep(self, rows: Sequence[int]) -> None:
        """Rows kept (finished ones leave) or repeated: a row taken twice is forked."""
        taken: set[int] = set()
        out = []
        for r in rows:
            m = self.matchers[int(r)]
            out.append(m.deep_copy() if (int(r) in taken and m is not None) else m)
            taken.add(int(r))
        self.matchers = out
        self.nesting = [self.nesting[int(r)] for r in rows]


@dataclass(frozen=True)
class Nesting:
    """Where a JSON text stands: inside a string (after a backslash), and the brackets open."""
    in_string: bool = False
    escaped: bool = False
    open: bytes = b""

    def after(self, text: bytes) -> "Nesting":
        in_string, escaped, stack = self.in_string, self.escaped, bytearray(self.open)
        for c in text:
            if in_string:
                in_string, escaped = (escaped or c != 0x22), (not escaped and c == 0x5C)
            elif c == 0x22:
                in_string = True
            elif c in b"{[":
                stack.append(c)
            elif c in b"}]" and stack:
                stack.pop()
        return Nesting(in_string, escaped, bytes(stack))

    def closer(self) -> int | None:
        """The byte that closes the innermost open value, or None."""
        if self.in_string:
            return None if self.escaped else 0x22
        return {0x7B: 0x7D, 0x5B: 0x5D}[self.open[-1]] if self.open else None


def _stuck(matcher: Any, step: int) -> InputError:
    why = matcher.get_error().strip().splitlines()
    return _bad(f"step {step}: this model's vocabulary cannot continue the format "
                f"({why[0][:160] if why else 'no token fits'})")
