"""Write weights/tokenizers/hf-variants.json: the token ids `transformers` gives for tokenizer folders
saved the ways hub repositories save them, for tests/test_tokenizer.py to compare with
`minfer.tokenizers` without transformers installed.

Each variant is the committed tiny tokenizer (weights/tokenizers/tiny-t5) or the real T5 one
(../shared/t5-tokenizer, not in the repository) with a few settings changed (`VARIANTS`, applied by
`build_variant`, which the tests import from this file):

- tokenizer.json saved with padding (fixed length; to a multiple, on the left) or truncation (short
  `max_length`, both directions), as fine-tuning scripts often leave them: transformers' plain
  `tok(text)` neither pads nor truncates;
- tokenizer_config.json's `model_max_length` shorter than the text (transformers only warns);
- added tokens, special and not, with `lstrip` / `rstrip` / `single_word` / `normalized` flags,
  saved the way `save_pretrained` saves them (in tokenizer.json's `added_tokens` and in
  tokenizer_config.json's `added_tokens_decoder`), also with `split_special_tokens`;
- tokens that tokenizer_config.json / special_tokens_map.json declare but tokenizer.json lacks, the
  sentinels T5Tokenizer fills in when the config names none, special tokens that are vocabulary
  pieces but not added tokens, the model type taken from config.json;
- `tokenizer_class: PreTrainedTokenizerFast` (the file run as written, in every transformers) and
  `legacy: false`;
- an added_tokens.json (read only where tokenizer_config.json has no `added_tokens_decoder`).

The oracle is `transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]` under the
pinned dev version, transformers 4.57.6, which runs a tokenizer.json as written (as the `tokenizers`
library and, for spiece.model, `sentencepiece` do). transformers 5 rebuilds T5-class tokenizers from
the file's vocabulary with a fixed pipeline; tests/test_tokenizer.py explains what that changes and
compares with whatever transformers is installed.

Rerun (deterministic; needs ../shared/t5-tokenizer; a few seconds):

    pip install -e .[dev]
    python weights/make_tokenizer_fixtures.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizers" / "hf-variants.json"
SOURCES = {"tiny": HERE / "tokenizers" / "tiny-t5",
           "real": HERE.parent.parent / "shared" / "t5-tokenizer"}
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _token(content: str, special: bool, **flags: bool) -> dict[str, Any]:
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special, **flags}


def _padding(strategy: Any, direction: str = "Right", multiple: int | None = None) -> dict[str, Any]:
    return {"strategy": strategy, "direction": direction, "pad_to_multiple_of": multiple,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}


def _truncation(max_length: int, direction: str = "Right", stride: int = 0) -> dict[str, Any]:
    return {"direction": direction, "max_length": max_length, "strategy": "LongestFirst",
            "stride": stride}


ADDED = [
    _token("<sep>", True),
    _token("<L>", True, lstrip=True),
    _token("<R>", True, rstrip=True),
    _token("ish", False, single_word=True),
    _token("Foo", False),
    _token("bar", False, normalized=False),
    _token(" gap", False),                                     # content with a leading space
    _token("<B>", False, lstrip=True, rstrip=True, normalized=False),
    _token("\ufb01ne", False),                                 # "ﬁne": NFKC-normalized to "fine" (real T5)
    _token("Friday", False),                                   # a word the vocabulary has
]
NO_SENTINEL_LIST = {"additional_special_tokens": None, "extra_ids": None}

# Each variant: "json" sets top-level keys of tokenizer.json; "add" appends added tokens to
# tokenizer.json (next free ids) and, as save_pretrained does, to tokenizer_config.json's
# added_tokens_decoder; "config_add" adds them to the config only; "drop_added" removes the added
# tokens whose content contains that string (from both files); "config" / "map" set keys of
# tokenizer_config.json / special_tokens_map.json (None deletes); "config_json" writes config.json;
# "added_json" writes added_tokens.json.
VARIANTS: dict[str, dict[str, Any]] = {
    "as-shipped": {},
    "padding-fixed": {"json": {"padding": _padding({"Fixed": 24})}},
    "padding-multiple-left": {"json": {"padding": _padding("BatchLongest", "Left", 8)}},
    "truncation": {"json": {"truncation": _truncation(6)}},
    "truncation-left-and-padding": {"json": {"truncation": _truncation(5, "Left", 2),
                                             "padding": _padding({"Fixed": 16})}},
    "model-max-length": {"config": {"model_max_length": 4}},
    "added-tokens": {"add": ADDED},
    "added-tokens-split-special": {"add": ADDED, "config": {"split_special_tokens": True}},
    "added-tokens-truncation": {"add": ADDED, "json": {"truncation": _truncation(4),
                                                       "padding": _padding({"Fixed": 32})}},
    "config-only-tokens": {
        "config_add": [_token("<cfg>", True), _token("<cfg2>", False, normalized=False)],
        "config": {"additional_special_tokens+": ["<mapx>"]},
        "map": {"additional_special_tokens+": ["<mapx>"]}},
    "t5-default-sentinels": {"config": NO_SENTINEL_LIST, "map": {"additional_special_tokens": None}},
    "sentinels-not-added": {"drop_added": "<extra_id_"},
    "model-type-from-config-json": {
        "config": {**NO_SENTINEL_LIST, "tokenizer_class": None},
        "map": {"additional_special_tokens": None}, "config_json": {"model_type": "t5"}},
    "generic-class": {"config": {"tokenizer_class": "PreTrainedTokenizerFast"},
                      "json": {"truncation": _truncation(3)}},
    "legacy-false": {"config": {"legacy": False}},
    # added_tokens.json, which transformers reads only where the config has no added_tokens_decoder
    # (the tiny config has none, the real one has): a new token, a vocabulary word, a sentinel
    "added-tokens-json": {"added_json": ["<aj>", "Friday", "<extra_id_0>"],
                          "config": {"additional_special_tokens+": ["<aj>"]}},
}

TEXTS = [
    "translate English to German: The house is wonderful.",
    " ".join(["March 5, 2021 is a Friday and the weather is nice today."] * 3),
    "",
    " ",
    "  a  b  ",
    "tabs\tand\nnewlines\r\n",
    "Café naïve 日本 😀 \ufb01ne fine",
    "Hello <extra_id_0> world <extra_id_10></s>x<pad><unk>",
    "<extra_id_99><extra_id_50> <extra_id_9>",
    "English<sep>German <sep> <cfg>x<cfg2> <mapx>",
    "a <L> b <R>  c <L><R>",
    "xishy ish fish ish. ISH",
    "Foo foo FOO barbar bar",
    "a gap  gap",
    "x <B> y<B>z",
    "Friday日本 Fridays",
    "a<aj>b <aj> Friday",
]


def _edit(data: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if key.endswith("+"):
            key = key[:-1]
            data[key] = list(data.get(key) or []) + value
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = value


def build_variant(src: Path, dst: Path, spec: dict[str, Any]) -> Path:
    """Write the tokenizer folder `dst`: `src`'s files with `spec`'s changes (see VARIANTS)."""
    dst.mkdir(parents=True, exist_ok=False)
    tok, config, smap = (json.loads((src / name).read_text(encoding="utf-8")) for name in FILES)
    decoder = config.setdefault("added_tokens_decoder", {})
    if "drop_added" in spec:
        tok["added_tokens"] = [t for t in tok["added_tokens"] if spec["drop_added"] not in t["content"]]
        for key in [k for k, t in decoder.items() if spec["drop_added"] in t["content"]]:
            del decoder[key]
    next_id = max([len(tok["model"]["vocab"]) - 1] + [t["id"] for t in tok["added_tokens"]]) + 1
    for token in spec.get("add", []):
        tok["added_tokens"].append({"id": next_id, **token})
        next_id += 1
    if "add" in spec:     # save_pretrained writes every added token into both files
        decoder.update({str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                        for t in tok["added_tokens"]})
    for token in spec.get("config_add", []):
        decoder[str(next_id)] = dict(token)
        next_id += 1
    if not decoder:
        del config["added_tokens_decoder"]
    _edit(tok, spec.get("json", {}))
    _edit(config, spec.get("config", {}))
    _edit(smap, spec.get("map", {}))
    for name, data in zip(FILES, (tok, config, smap)):
        (dst / name).write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    if "config_json" in spec:
        (dst / "config.json").write_text(json.dumps(spec["config_json"]), encoding="utf-8")
    if "added_json" in spec:      # {token: id}, new ids after the file's last
        added = {token: next_id + k for k, token in enumerate(spec["added_json"])}
        (dst / "added_tokens.json").write_text(json.dumps(added), encoding="utf-8")
    return dst


def reference_ids(transformers: Any, src: Path, work: Path) -> dict[str, list[list[int]]]:
    out = {}
    for name, spec in VARIANTS.items():
        hf = transformers.AutoTokenizer.from_pretrained(str(build_variant(src, work / name, spec)))
        out[name] = [hf(text)["input_ids"] for text in TEXTS]
    return out


def main() -> None:
    import tokenizers
    import transformers
    transformers.logging.set_verbosity_error()   # "sequence longer than model_max_length"
    if transformers.__version__ != "4.57.6":
        sys.exit(f"transformers {transformers.__version__}: the committed ids come from 4.57.6 "
                 "(pip install -e .[dev])")
    for kind, src in SOURCES.items():
        if not (src / "tokenizer.json").is_file():
            sys.exit(f"{src}: no tokenizer.json ({kind})")
    with tempfile.TemporaryDirectory() as tmp:
        ids = {kind: reference_ids(transformers, src, Path(tmp) / kind) for kind, src in SOURCES.items()}
    head = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines += [' "texts": [', ",\n".join(f"  {json.dumps(t, ensure_ascii=False)}" for t in TEXTS), " ],"]
    lines += [' "variants": {', ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                           for k, v in VARIANTS.items()), " },"]
    lines += [' "ids": {', ",\n".join(
        f"  {json.dumps(kind)}: {{\n" + ",\n".join(
            f"   {json.dumps(name)}: [\n" + ",\n".join(f"    {json.dumps(row)}" for row in rows) + "]"
            for name, rows in by_variant.items()) + "}"
        for kind, by_variant in ids.items()), " }", "}"]
    text = "\n".join(lines)
    assert json.loads(text) == {**head, "texts": TEXTS, "variants": VARIANTS, "ids": ids}
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"{OUT}: {len(VARIANTS)} variants x {len(TEXTS)} texts x {len(SOURCES)} tokenizers, "
          f"{OUT.stat().st_size / 1024:.1f} KB")


if __name__ == "__main__":
    main()
