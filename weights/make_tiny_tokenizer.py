"""Make weights/tokenizers/tiny-t5/: a small T5-style SentencePiece tokenizer, committed for tests.

What it makes (about 40 KB in all):

- `spiece.model`: a Unigram SentencePiece model (vocab 590) trained on a corpus this script
  generates: dates ("March 5, 2021", "2021-03-05"), numbers and their spellings ("one hundred
  twenty-three"), money and percentages, a few English sentences, accented words, all printable
  ASCII. T5 conventions: `<pad>`=0, `</s>`=1, `<unk>`=2, no `<s>`; digits always split
  (`split_digits`); byte fallback (256 `<0xNN>` pieces), so no text is ever `<unk>` and characters
  outside the corpus (CJK, emoji) become UTF-8 bytes; identity normalisation (no NFKC table, which
  would cost ~250 KB) with SentencePiece's usual whitespace handling (leading, trailing and repeated
  spaces dropped).
- `tokenizer.json`: the same model for the `tokenizers` library, written the way the Hugging Face
  T5 converter writes it: the 590 pieces with their scores plus 10 sentinels `<extra_id_9>` ..
  `<extra_id_0>` at the end (ids 590..599, `<extra_id_0>` = 599, the T5 rule
  `sp_vocab + extra_ids - 1 - N`), special added tokens, a normaliser that reproduces
  SentencePiece's whitespace handling, a Metaspace pre-tokenizer, a post-processor appending `</s>`
  and a ByteFallback + Metaspace decoder.
- `tokenizer_config.json`, `special_tokens_map.json`: T5-style (`extra_ids`: 10), loadable by
  `transformers.T5TokenizerFast` / `T5Tokenizer` as well as by `minfer.tokenizers`.

The script checks that both files encode its corpus (and a few harder strings) to the same ids.
It will be shared by the small trained T5 checkpoints, so the vocabulary must cover digits, month
names, number words, both cases of the alphabet and punctuation; the script prints which of those
words became a single piece.

Rerun (deterministic, no network, about 2 seconds on one CPU core):

    /work/devenv/bin/python weights/make_tiny_tokenizer.py

Needs `sentencepiece` and `tokenizers` (dev only; minfer itself needs just the one it reads).
"""

from __future__ import annotations

import io
import json
import random
import time
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

OUT = Path(__file__).resolve().parent / "tokenizers" / "tiny-t5"
SP_VOCAB = 590        # SentencePiece pieces, including the 3 specials and 256 byte pieces
EXTRA_IDS = 10        # sentinels <extra_id_0..9>, appended after the SentencePiece vocabulary
SEED = 20240601

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
           "nine": "ninth", "twelve": "twelfth"}

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow?",
    "How vexingly quick daft zebras jump; the five boxing wizards jump quickly.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "translate English to German: The house is wonderful.",
    "summarize: The meeting was moved to the next week because of the holiday.",
    "The weather is nice today, and the children are playing in the park.",
    "She said: \"I will be there at 10:30 in the morning.\"",
    "It's a small world; isn't it? Yes, it is (mostly).",
    "Please send the report to the team by Friday.",
    "We visited the museum, the old bridge and the market.",
    "Numbers, dates and words: a good test for a small model.",
    "Is the answer yes or no? Maybe - it depends.",
    "He bought 3 apples, 12 eggs and 2 loaves of bread for $7.25.",
    "A café in Zürich serves crème brûlée and a naïve résumé of the façade.",
    "São Paulo, Málaga, Kraków, Genève and Ångström: déjà vu in El Niño season.",
    "Über alles: schön, grün, Straße, Mädchen, Größe.",
    "Ça va? Très bien, merci! Où est la bibliothèque?",
    "¿Dónde está el baño? ¡Hola, señor!",
]
ASCII_LINE = "".join(chr(c) for c in range(33, 127))   # every printable ASCII character


def spell(n: int) -> str:
    """English words for 0 <= n < 10**9 ("one hundred twenty-three")."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    for size, name in ((10**6, "million"), (1000, "thousand"), (100, "hundred")):
        if n >= size:
            head, rest = divmod(n, size)
            return spell(head) + " " + name + ("" if rest == 0 else " " + spell(rest))
    raise AssertionError(n)


def ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def corpus(rng: random.Random) -> list[str]:
    lines = list(SENTENCES) + [ASCII_LINE] * 3
    for _ in range(400):
        y, m, d = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
        month, day = MONTHS[m - 1], DAYS[rng.randrange(7)]
        lines += [
            f"{month} {d}, {y}",
            f"{day}, {d} {month} {y}",
            f"{y}-{m:02d}-{d:02d}",
            f"{m}/{d}/{y}",
            f"the {ordinal(d)} of {month.lower()} {spell(y)}",
            f"date: {month} {d}, {y} -> {y}-{m:02d}-{d:02d}",
        ]
    for _ in range(500):
        n = rng.choice([rng.randint(0, 20), rng.randint(0, 100), rng.randint(0, 1000),
                        rng.randint(0, 10**6), rng.randint(0, 10**9)])
        words = spell(n)
        lines += [f"{n} is {words}.", f"spell: {n:,} -> {words.capitalize()}"]
    for _ in range(150):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines += [f"add: {a} + {b} = {a + b}", f"{rng.randint(0, 100)}% of {a} is {a * rng.random():.2f}",
                  f"The total was ${a},{b:03d}.{rng.randint(0, 99):02d}."]
    for word in ONES + TENS[2:] + ["hundred", "thousand", "million"] + list(ORDINAL.values()):
        lines += [word, word.capitalize()] * 5
    for word in MONTHS + DAYS:
        lines += [word, word.lower(), f"in {word}", f"on {word}"] * 10
    rng.shuffle(lines)
    return lines


def train_sentencepiece(lines: list[str]) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="unigram",
        vocab_size=SP_VOCAB, character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", num_threads=1,
        max_sentence_length=4096, minloglevel=2)
    return model.getvalue()


def to_tokenizers(sp: spm.SentencePieceProcessor) -> Tokenizer:
    """The SentencePiece model as a `tokenizers` pipeline that encodes to the same ids."""
    n = sp.get_piece_size()
    sentinels = [f"<extra_id_{k}>" for k in reversed(range(EXTRA_IDS))]   # <extra_id_0> last
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(n)] + [(s, 0.0) for s in sentinels]
    tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=True))
    # SentencePiece (identity rule, remove_extra_whitespaces): runs of spaces collapse to one,
    # leading and trailing spaces go. Only U+0020 counts; tabs and newlines are ordinary characters.
    tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(" {2,}"), " "),
                                           normalizers.Replace(Regex(r"\A | \z"), "")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always",
                                                        split=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", sp.eos_id())])
    specials = ["<pad>", "</s>", "<unk>"] + sentinels
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for s in specials:
        assert tok.token_to_id(s) == (vocab.index((s, 0.0)) if s in sentinels else sp.piece_to_id(s))
    return tok


def check_same_ids(sp: spm.SentencePieceProcessor, tok: Tokenizer, lines: list[str]) -> None:
    hard = ["  leading and  double  spaces  ", "tab\there\nnewline", "日本語 and emoji 😀!",
            "x" * 50, "", " ", "a  b", "MiXeD CaSe 0123456789"]
    for text in lines + hard:
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text, got, want)


def coverage_report(tok: Tokenizer) -> str:
    words = MONTHS + [m.lower() for m in MONTHS] + DAYS + ONES + TENS[2:] + ["hundred", "thousand",
                                                                             "million"]
    single = [w for w in words if len(tok.encode(w, add_special_tokens=False).ids) == 1]
    split = [w for w in words if w not in single]
    return f"{len(single)}/{len(words)} words are one piece; split: {' '.join(split) or '-'}"


def main() -> None:
    t0 = time.perf_counter()
    lines = corpus(random.Random(SEED))
    proto = train_sentencepiece(lines)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert sp.get_piece_size() == SP_VOCAB, sp.get_piece_size()
    tok = to_tokenizers(sp)
    check_same_ids(sp, tok, lines)

    special_map = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "additional_special_tokens": [f"<extra_id_{k}>" for k in range(EXTRA_IDS)]}
    config = {**special_map, "extra_ids": EXTRA_IDS, "model_max_length": 512,
              "tokenizer_class": "T5Tokenizer", "clean_up_tokenization_spaces": False}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "spiece.model").write_bytes(proto)
    (OUT / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (OUT / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{OUT}: vocab {tok.get_vocab_size()} ({SP_VOCAB} pieces + {EXTRA_IDS} sentinels), "
          f"{size / 1024:.1f} KB, corpus {len(lines)} lines, {time.perf_counter() - t0:.1f} s")
    print(coverage_report(tok))


if __name__ == "__main__":
    main()
