"""Write the fixtures of the two tokenizer sources that have no tokenizer.json, for
tests/test_tokenizer_byt5.py and tests/test_tokenizer_bpe.py to compare minfer.tokenizers with
transformers without transformers installed:

- weights/tokenizers/byt5/: a ByT5 tokenizer folder as transformers 4.57 saves
  `ByT5Tokenizer()` (tokenizer_config.json, special_tokens_map.json, added_tokens.json: ByT5 has
  no vocabulary file);
- weights/tokenizers/roberta-bpe/: a byte-level BPE vocabulary trained here with `tokenizers` on
  a small corpus of code and text (vocab.json, merges.txt), with the configs of a CodeT5 / CodeT5+
  checkpoint: RobertaTokenizer, legacy `{"__type": "AddedToken"}` special tokens,
  special_tokens_map.json, 100 `<extra_id_N>` sentinels after the vocabulary in added_tokens.json
  (`<extra_id_0>` last, the T5 rule) and a config.json of model_type t5;
- weights/tokenizers/byt5-bpe-expected.json: variants of both folders (`BYT5_VARIANTS`,
  `BPE_VARIANTS`: files rewritten or removed by `build_variant`, which the tests import), and per
  variant and text what transformers gives (a row): `AutoTokenizer.from_pretrained(folder)(text)
  .input_ids` with and without special tokens, the decoded texts (skip_special_tokens true and
  false), for BPE also the slow RobertaTokenizer's ids; for ByT5 also the decoding of id lists
  that are not valid UTF-8 (`BYT5_DECODE`). Variants share their equal rows: each section keeps
  its distinct rows once ("rows") and each variant the index of each text's row.

The oracle is transformers 4.57.6 (the pinned dev version). transformers 5 reads some of these
folders differently (`V5_DIFFERENCES` says where, why, and which version minfer follows): a second
run under transformers 5 adds its results where they differ from 4.57's (section "transformers5",
rows in the same tables), so that the tests hold minfer, and the installed transformers, to the
results of the version each field follows. Rerun both (deterministic, a few seconds each; the
first run drops the second's section):

    pip install -e .[dev]
    python weights/make_byt5_bpe_fixtures.py
    pip install "transformers==5.24.*"
    python weights/make_byt5_bpe_fixtures.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BYT5 = HERE / "tokenizers" / "byt5"
BPE = HERE / "tokenizers" / "roberta-bpe"
OUT = HERE / "tokenizers" / "byt5-bpe-expected.json"


def sentinels(n: int) -> list[str]:
    return [f"<extra_id_{i}>" for i in range(n)]


def _legacy(content: str, lstrip: bool = False) -> dict[str, Any]:
    """A special token as tokenizer_config.json files of 2021-2023 wrote it."""
    return {"__type": "AddedToken", "content": content, "lstrip": lstrip, "normalized": True,
            "rstrip": False, "single_word": False}


def _added(content: str, special: bool, **flags: bool) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": not special, "rstrip": False,
            "single_word": False, "special": special, **flags}


# Each variant: "write" replaces whole files ({name: JSON content}); "config" sets keys of the
# base folder's tokenizer_config.json (None deletes); "drop" removes files.
BYT5_VARIANTS: dict[str, dict[str, Any]] = {
    "saved-4.57": {},
    # what google/byt5-* repositories hold: plain-string specials and the sentinel list
    "legacy-hub": {"drop": ["added_tokens.json"], "write": {
        "tokenizer_config.json": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                                  "extra_ids": 125, "additional_special_tokens": sentinels(125),
                                  "tokenizer_class": "ByT5Tokenizer"},
        "special_tokens_map.json": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                                    "additional_special_tokens": sentinels(125)}}},
    "class-only": {"drop": ["special_tokens_map.json", "added_tokens.json"],
                   "write": {"tokenizer_config.json": {"tokenizer_class": "ByT5Tokenizer"}}},
    "config-json-only": {"drop": ["tokenizer_config.json", "special_tokens_map.json",
                                  "added_tokens.json"],
                         "write": {"config.json": {"model_type": "t5", "vocab_size": 384,
                                                   "tokenizer_class": "ByT5Tokenizer"}}},
    "extra-ids-10": {"drop": ["special_tokens_map.json", "added_tokens.json"],
                     "write": {"tokenizer_config.json": {"tokenizer_class": "ByT5Tokenizer",
                                                         "extra_ids": 10}}},
    "extra-ids-0": {"drop": ["special_tokens_map.json", "added_tokens.json"],
                    "write": {"tokenizer_config.json": {"tokenizer_class": "ByT5Tokenizer",
                                                        "extra_ids": 0}}},
    "split-special-tokens": {"config": {"split_special_tokens": True}},
    # specials saved as objects that do not strip, a non-special and a special added token
    "added-tokens": {"drop": ["special_tokens_map.json"], "write": {
        "tokenizer_config.json": {
            "tokenizer_class": "ByT5Tokenizer", "extra_ids": 3,
            "eos_token": _legacy("</s>"), "pad_token": _legacy("<pad>"), "unk_token": "<unk>",
            "additional_special_tokens": sentinels(3) + ["<lang>"]},
        "added_tokens.json": {"<code>": 259, "<lang>": 260}}},
    # saved with ids: a rstrip, a lstrip and a single_word token, and one of one byte's character
    # (chr(0xC3) "Ã", which then also stands for the byte 0xC3 in the text's UTF-8)
    "added-tokens-decoder": {"config": {"added_tokens_decoder+": {
        "384": _added("<code>", False), "385": _added("<R>", True, rstrip=True),
        "386": _added("<L>", True, lstrip=True), "387": _added("<w>", False, single_word=True),
        "388": _added("\u00c3", False)}, "additional_special_tokens+": ["<R>", "<L>"]}},
}

BYT5_TEXTS = [
    "Hello world",
    "translate English to German: The house is wonderful.",
    "Grüße aus Zürich, ça va? ¿Dónde está?",
    "日本語のテキスト 中文 한국어",
    "नमस्ते दुनिया مرحبا بالعالم Привет мир",
    "e\u0301 a\u0308 combining o\u0302\u0323",
    "emoji 😀👍🏽 👨‍👩‍👧 🇩🇪 ✓",
    "a <extra_id_0> b<extra_id_1>c <extra_id_124>",
    "<extra_id_125> <extra_id_10>x",
    "a </s> b  <pad>c<unk>  d",
    "ends with eos</s>",
    "tabs\tand\nnewlines\r\n",
    "x <code> y<lang>z <R>  w  <L> v",
    "<w> a<w> <w>b <w> <code><w><R><L> ü Ã",
    "",
    " ",
    "\x00\x7f\u0080\uffff\U0010ffff",
]

# id lists to decode: bytes that are not valid UTF-8 (a lone lead byte, a continuation byte, an
# overlong form, a surrogate's encoding, 0xff), cut characters, specials and sentinels among them
BYT5_DECODE = [
    [75, 108, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 33],
    [3 + 0xE2, 3 + 0x82, 100],
    [100, 3 + 0x82, 101, 3 + 0xFF, 102],
    [3 + 0xC0, 3 + 0xAF, 68, 3 + 0xED, 3 + 0xA0, 3 + 0x80, 69],
    [3 + 0xF0, 3 + 0x9F, 3 + 0x98],
    [100, 259, 101, 1, 0, 2, 102, 260, 261],
    [259, 3 + 0xE2, 3 + 0x82],
    [259, 260, 383, 100],
    [1, 1, 0, 100, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80, 1],
    # byte 0xC3 with a continuation: "ü", except where an added token's text is chr(0xC3)
    [100, 3 + 0xC3, 3 + 0xBC, 101],
]

BPE_CONFIG = {"add_prefix_space": False, "bos_token": _legacy("<s>"), "cls_token": _legacy("<s>"),
              "eos_token": _legacy("</s>"), "errors": "replace",
              "mask_token": _legacy("<mask>", lstrip=True), "model_max_length": 512,
              "pad_token": _legacy("<pad>"), "sep_token": _legacy("</s>"),
              "tokenizer_class": "RobertaTokenizer", "trim_offsets": True,
              "unk_token": _legacy("<unk>")}
BPE_MAP = {"additional_special_tokens": sentinels(100), "bos_token": "<s>", "cls_token": "<s>",
           "eos_token": "</s>", "mask_token": "<mask>", "pad_token": "<pad>", "sep_token": "</s>",
           "unk_token": "<unk>"}

BPE_VARIANTS: dict[str, dict[str, Any]] = {
    "codet5": {},
    "class-only": {"drop": ["special_tokens_map.json", "added_tokens.json"],
                   "write": {"tokenizer_config.json": {"tokenizer_class": "RobertaTokenizer"}}},
    "class-in-config-json": {"drop": ["tokenizer_config.json", "special_tokens_map.json",
                                      "added_tokens.json"],
                             "write": {"config.json": {"model_type": "t5",
                                                       "tokenizer_class": "RobertaTokenizer"}}},
    "add-prefix-space": {"config": {"add_prefix_space": True}},
    "split-special-tokens": {"config": {"split_special_tokens": True}},
    # transformers 4.57's save_pretrained of the codet5 folder, less its tokenizer.json
    "saved-4.57": {"resave": True, "drop": ["tokenizer.json"]},
    # the same with its tokenizer.json: read by hf_json.py, whose post-processor puts <s> first
    "saved-4.57-tokenizer-json": {"resave": True},
    "added-tokens": {"drop": ["special_tokens_map.json"], "write": {
        "added_tokens.json": {"<code>": 0, "<py>": 0, "<R>": 0}},
        "config": {"additional_special_tokens": ["<py>", "<R>"]}},
}

BPE_TEXTS = [
    "def add(a, b):\n    return a + b",
    "def add(a, b):\n    return a + b\n",
    "class Grüße:\n    def __init__(self, 名前):\n        self.名前 = 名前  # naïve 😀",
    "for i in range(10):\n\tprint(f'{i:>3}')",
    "x = a <mask> b<s>c</s><pad><unk>d",
    "<extra_id_0> return <extra_id_99>x<extra_id_5> ",
    "summarize: Python code  with   spaces  ",
    "<code> y<py>z <R>  w",
    "\n\n  leading and trailing  \n",
    "",
    " ",
]

# What transformers 5 (5.24) gives differently from 4.57 for these folders, per source and field
# of a row ("decode": BYT5_DECODE's decodings): the version whose results minfer follows (the
# behaviour the checkpoints were trained with, or the faithful one where training does not
# decide), and why. A field not listed is the same in both; the second run checks all of it.
V5_DIFFERENCES: dict[tuple[str, str], tuple[int, str]] = {
    # 5.x's ByT5Tokenizer joins every token's bytes; 4.57's PreTrainedTokenizer._decode put the
    # sentinels and other added tokens apart between spaces (`spaces_between_special_tokens`, a
    # legacy rule v5 dropped). The ids are bytes: decoding them adds none (decode(encode(text)) is
    # the text again, as for the original ByT5 vocabulary and minfer's other sources). Ids and
    # which ids are special are the same in both.
    ("byt5", "decoded"): (5, "no spaces put around added tokens when decoding"),
    ("byt5", "decode"): (5, "no spaces put around added tokens when decoding"),
    # 5.x's RobertaTokenizer, reading a folder without tokenizer.json (CodeT5's), no longer makes
    # `<mask>` swallow the whitespace before it (4.x's RobertaTokenizer(Fast).__init__ did, for a
    # plain-string mask_token, and CodeT5's own config saves lstrip true), and marks the
    # added_tokens.json sentinels that special_tokens_map.json lists as additional special tokens
    # not special (its legacy reader looks for `extra_special_tokens` only), so
    # `skip_special_tokens` keeps them and `split_special_tokens` does not split them. CodeT5 was
    # trained with 4.x's reading (RoBERTa's mask rule, the sentinels special): minfer keeps it.
    ("bpe", "ids"): (4, "<mask> keeps the space before it; sentinels not special"),
    ("bpe", "plain"): (4, "<mask> keeps the space before it; sentinels not special"),
    ("bpe", "decoded"): (4, "<mask> keeps the space before it; sentinels not special"),
    # the same, and 5.x's RobertaTokenizer is the fast one (RobertaTokenizerFast is an alias):
    # the slow tokenizer's own add_prefix_space rule (EXPECTED_SLOW_DIFFERENCES) is gone
    ("bpe", "slow"): (4, "as ids; and RobertaTokenizer is the fast tokenizer"),
}
V5_SECTION = "transformers5"


def follows(source: str, field: str) -> int:
    """The transformers major version whose results minfer gives for `field` of `source`."""
    return V5_DIFFERENCES.get((source, field), (4, ""))[0]


def rows_for(data: dict[str, Any], source: str, variant: str, major: int) -> list[dict[str, Any]]:
    """The committed results of transformers `major` (4: 4.57, 5: the "transformers5" run) for
    each text of `variant`: the 4.57 row, with 5.x's where it differs."""
    expected = data[source]["expected"]
    index = list(expected["variants"][variant]["rows"])
    if major == 5:
        for k, row in data[V5_SECTION][source].get(variant, {}).get("rows", {}).items():
            index[int(k)] = row
    return [expected["rows"][i] for i in index]


def decodes_for(data: dict[str, Any], variant: str, major: int) -> list[Any]:
    """BYT5_DECODE's committed decodings for `variant` under transformers `major`."""
    decoded = list(data["byt5"]["expected"]["variants"][variant]["decode"])
    if major == 5:
        for k, value in data[V5_SECTION]["byt5"].get(variant, {}).get("decode", {}).items():
            decoded[int(k)] = value
    return decoded


EXPECTED_SLOW_DIFFERENCES = {
    # the fast tokenizer's ByteLevel puts a space before every stretch of text after an added
    # token; the slow RobertaTokenizer only before the whole text (minfer follows the fast one)
    "add-prefix-space": "prefix space after added tokens",
}

CORPUS = """def add(a, b):
    return a + b

def sub(a, b):
    return a - b

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

import os
import sys

def main(argv):
    # parse the arguments and print them
    for arg in argv:
        print(arg)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))

Summarize the function: it returns the sum of two numbers.
The quick brown fox jumps over the lazy dog.
def grüße(name): return "Hallo " + name  # naïve café 日本
"""


def _edit(data: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if key.endswith("+"):
            key = key[:-1]
            old = data.get(key)
            data[key] = {**old, **value} if isinstance(value, dict) else list(old or []) + value
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = value


def build_variant(src: Path, dst: Path, spec: dict[str, Any], resaved: Path | None = None) -> Path:
    """Write the tokenizer folder `dst`: `src`'s files (or, for "resave", the folder transformers
    saved from src: `resaved`) with `spec`'s changes (see BYT5_VARIANTS)."""
    base = resaved if spec.get("resave") else src
    if base is None:
        raise ValueError("this variant needs the folder transformers saves (resaved)")
    shutil.copytree(base, dst)
    for name in spec.get("drop", []):
        (dst / name).unlink(missing_ok=True)
    for name, content in spec.get("write", {}).items():
        (dst / name).write_text(json.dumps(content, ensure_ascii=False, indent=1), encoding="utf-8")
    if "config" in spec:
        path = dst / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        _edit(config, spec["config"])
        path.write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    added = dst / "added_tokens.json"
    if added.is_file() and "added_tokens.json" in spec.get("write", {}):
        # ids 0 in a spec mean "the next after the vocabulary", in order
        data = json.loads(added.read_text(encoding="utf-8"))
        if 0 in data.values():
            size = len(json.loads((dst / "vocab.json").read_text(encoding="utf-8")))
            data = {token: size + k for k, token in enumerate(data)}
            added.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return dst


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def make_byt5(transformers: Any) -> None:
    if BYT5.exists():
        shutil.rmtree(BYT5)
    transformers.ByT5Tokenizer().save_pretrained(str(BYT5))


def make_bpe() -> None:
    """The BPE folder: a vocabulary of 600 trained on CORPUS (every byte in the alphabet, CodeT5's
    specials first), the CodeT5 configs, config.json."""
    from tokenizers import ByteLevelBPETokenizer
    if BPE.exists():
        shutil.rmtree(BPE)
    BPE.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([CORPUS] * 4, vocab_size=600, min_frequency=2, show_progress=False,
                            special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(BPE))
    size = bpe.get_vocab_size()
    _write_json(BPE / "tokenizer_config.json", BPE_CONFIG)
    _write_json(BPE / "special_tokens_map.json", BPE_MAP)
    # T5's order: <extra_id_99> first after the vocabulary, <extra_id_0> last
    _write_json(BPE / "added_tokens.json", {f"<extra_id_{99 - k}>": size + k for k in range(100)})
    _write_json(BPE / "config.json", {"model_type": "t5", "vocab_size": size + 100})


class _Rows:
    """Distinct rows, each kept once; `index(row)` is where it is."""

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self._at: dict[str, int] = {}
        for row in rows or []:
            self.index(row)

    def index(self, row: dict[str, Any]) -> int:
        key = json.dumps(row, sort_keys=True)
        if key not in self._at:
            self._at[key] = len(self.rows)
            self.rows.append(row)
        return self._at[key]


def byt5_results(transformers: Any, work: Path) -> dict[str, dict[str, Any]]:
    """Per variant what the installed transformers gives: "end", a row per text, "decode"."""
    out = {}
    for name, spec in BYT5_VARIANTS.items():
        hf = transformers.AutoTokenizer.from_pretrained(str(build_variant(BYT5, work / name, spec)))
        assert type(hf).__name__ == "ByT5Tokenizer", (name, type(hf))
        decoded = [[hf.decode(ids, skip_special_tokens=skip) for skip in (True, False)]
                   if max(ids) < len(hf) else None for ids in BYT5_DECODE]   # else HF raises
        # ids 0..end-1 (len(hf) counts texts, one fewer where an added token's text is a byte's)
        end = max(hf.get_vocab().values()) + 1
        out[name] = {"end": end, "rows": [results_row(hf, t) for t in BYT5_TEXTS],
                     "decode": decoded}
    return out


def bpe_results(transformers: Any, work: Path, resave: bool) -> dict[str, dict[str, Any]]:
    """Per variant what the installed transformers gives: "len", a row per text (with the slow
    RobertaTokenizer's ids). resave: also the variants of the folder it saves (4.57's)."""
    resaved = work / "resaved"
    if resave:
        transformers.AutoTokenizer.from_pretrained(str(BPE)).save_pretrained(str(resaved))
    out = {}
    for name, spec in BPE_VARIANTS.items():
        if spec.get("resave") and not resave:
            continue
        folder = build_variant(BPE, work / name, spec, resaved)
        fast = transformers.AutoTokenizer.from_pretrained(str(folder))
        slow = transformers.RobertaTokenizer.from_pretrained(str(folder))
        # 5.x: RobertaTokenizer is the fast tokenizer (RobertaTokenizerFast an alias of it)
        assert type(fast).__name__ in ("RobertaTokenizerFast", "RobertaTokenizer"), name
        rows = [{**results_row(fast, text), "slow": slow(text).input_ids} for text in BPE_TEXTS]
        out[name] = {"len": len(fast), "rows": rows}
    return out


def tabled(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Results with each variant's rows as indices into one table of distinct rows."""
    table = _Rows()
    variants = {name: {**got, "rows": [table.index(r) for r in got["rows"]]}
                for name, got in results.items()}
    return {"rows": table.rows, "variants": variants}


def v5_section(data: dict[str, Any], byt5: dict[str, Any], bpe: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's results where they differ from the committed 4.57 ones: per source and
    variant, {text index: row index} (rows added to the source's table) and, for ByT5,
    {BYT5_DECODE index: decodings}. Every field that differs must be one V5_DIFFERENCES lists,
    and each listed one must differ somewhere."""
    out: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    for source, results, size in (("byt5", byt5, "end"), ("bpe", bpe, "len")):
        # 4.57's rows come first (a rerun drops what an earlier one appended)
        expected = data[source]["expected"]
        table = _Rows(expected["rows"][:1 + max(i for v in expected["variants"].values()
                                                for i in v["rows"])])
        out[source] = {}
        for name, got in results.items():
            base = data[source]["expected"]["variants"][name]
            assert got[size] == base[size], (source, name, size)
            entry: dict[str, Any] = {}
            for k, (new, old) in enumerate(zip(got["rows"], rows_for(data, source, name, 4))):
                if new != old:
                    seen |= {(source, f) for f in new if new[f] != old[f]}
                    entry.setdefault("rows", {})[str(k)] = table.index(new)
            for k, (new, old) in enumerate(zip(got.get("decode", []), base.get("decode", []))):
                if new != old:
                    seen.add((source, "decode"))
                    entry.setdefault("decode", {})[str(k)] = new
            if entry:
                out[source][name] = entry
        data[source]["expected"]["rows"] = table.rows
    assert seen == set(V5_DIFFERENCES), ("not as V5_DIFFERENCES says", seen ^ set(V5_DIFFERENCES))
    return out


def results_row(hf: Any, text: str) -> dict[str, Any]:
    """A text's row: ids with and without special tokens, the ids decoded skipping special
    tokens and keeping them (the tests build minfer's the same way, `minfer_row`)."""
    ids = hf(text).input_ids
    return {"ids": ids, "plain": hf(text, add_special_tokens=False).input_ids,
            "decoded": [hf.decode(ids, skip_special_tokens=skip,
                                  clean_up_tokenization_spaces=False) for skip in (True, False)]}


def minfer_row(tok: Any, text: str) -> dict[str, Any]:
    """results_row's fields as a minfer tokenizer gives them."""
    ids = tok.encode(text)
    return {"ids": ids, "plain": tok.encode(text, add_eos=False),
            "decoded": [tok.decode(ids, skip) for skip in (True, False)]}


def main() -> None:
    import tokenizers
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")            # ByT5's "already has </s>"
    version = transformers.__version__
    head = {"transformers": version, "tokenizers": tokenizers.__version__}
    if version.startswith("5."):
        data = json.loads(OUT.read_text(encoding="utf-8"))
        if data["transformers"] != "4.57.6" or data["byt5"]["decode"] != BYT5_DECODE:
            sys.exit(f"{OUT}: run this under transformers 4.57.6 first")
        with tempfile.TemporaryDirectory() as tmp:
            byt5 = byt5_results(transformers, Path(tmp) / "byt5")
            bpe = bpe_results(transformers, Path(tmp) / "bpe", resave=False)
        data[V5_SECTION] = {**head, **v5_section(data, byt5, bpe)}
    elif version == "4.57.6":
        make_byt5(transformers)
        make_bpe()
        with tempfile.TemporaryDirectory() as tmp:
            byt5 = byt5_results(transformers, Path(tmp) / "byt5")
            bpe = bpe_results(transformers, Path(tmp) / "bpe", resave=True)
        for name, got in bpe.items():
            differs = [r for r in got["rows"] if r["slow"] != r["ids"]]
            assert bool(differs) == (name in EXPECTED_SLOW_DIFFERENCES), (name, differs)
        data = {**head,
                "byt5": {"variants": BYT5_VARIANTS, "texts": BYT5_TEXTS, "decode": BYT5_DECODE,
                         "expected": tabled(byt5)},
                "bpe": {"variants": BPE_VARIANTS, "texts": BPE_TEXTS, "expected": tabled(bpe)}}
        print(f"now run this under transformers 5 for the {V5_SECTION!r} section")
    else:
        sys.exit(f"transformers {version}: the committed results come from 4.57.6 and 5.x "
                 "(pip install -e .[dev]; then transformers==5.24.*)")
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=None) + "\n", encoding="utf-8")
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in (BYT5, BPE)}
    print(f"{OUT}: {OUT.stat().st_size / 1024:.1f} KB; folders {sizes}")


if __name__ == "__main__":
    main()
