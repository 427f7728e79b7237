"""The rerank oracle: monoT5's relevance as Hugging Face transformers computes it (issue 29).

    pip install torch==2.13.0 transformers==4.57.6     # dev only
    python weights/make_rerank_fixtures.py             # -> weights/t5/rerank_reference.json

monoT5 (Nogueira et al., 2020) reads "Query: {q} Document: {d} Relevant:" and scores a document
by the softmax over the logits of its two label tokens ("true", "false") at the first decoder
step, the decoder fed only its start token; the relevance is the probability of the first.
This writes, for the trained weights/tiny-t5-dates model (whose tiny vocabulary spells "true" in
pieces, so two single-token words stand in for the labels, as `words=` allows), each document's
P(words[0]) from T5ForConditionalGeneration in float32, the ids the HF tokenizer gives each input,
and the order best first. tests/test_scoring.py holds minfer's rerank to it (1e-4), without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import T5ForConditionalGeneration, T5TokenizerFast

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny-t5-dates"
OUT = HERE / "t5" / "rerank_reference.json"
TEMPLATE = "Query: {query} Document: {document} Relevant:"
WORDS = ("July", "date")
QUERY = "when was the 4th of July 1976?"
DOCUMENTS = ["date: 4th of July 1976", "a list of groceries: milk, eggs",
             "date: 12 March 1999", "July", "the weather in 1976 was warm",
             "date: 1 January 2000 and some more words after it"]


def main() -> None:
    tok = T5TokenizerFast.from_pretrained(MODEL)
    model = T5ForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    pair = []
    for word in WORDS:
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, (word, ids)
        pair.append(ids[0])
    inputs = [tok(TEMPLATE.format(query=QUERY, document=d)).input_ids for d in DOCUMENTS]
    scores = []
    with torch.no_grad():
        for ids in inputs:                      # one at a time: no padding in the oracle
            logits = model(input_ids=torch.tensor([ids]),
                           decoder_input_ids=torch.tensor([[model.config.decoder_start_token_id]])
                           ).logits[0, 0, pair].double()
            scores.append(float(torch.softmax(logits, dim=0)[0]))
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    OUT.write_text(json.dumps({"model": "tiny-t5-dates", "template": TEMPLATE,
                               "words": list(WORDS), "query": QUERY, "documents": DOCUMENTS,
                               "input_ids": inputs, "scores": scores, "order": order,
                               "made_with": {"torch": torch.__version__,
                                             "transformers": __import__("transformers").__version__}},
                              indent=1) + "\n")
    print(f"wrote {OUT}: scores {[round(s, 4) for s in scores]}, order {order}")


if __name__ == "__main__":
    main()
