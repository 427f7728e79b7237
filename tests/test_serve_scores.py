"""POST /v1/score and /v1/rerank, /rerank (issue 29): what model.score_pairs / model.rerank give
(tests/test_scoring.py checks those against forward's logits), in vLLM's and Cohere's shapes, for
a seq2seq model and a sentence-embedding model; limits and errors as the other endpoints. Real
server processes on 127.0.0.1 (a free port), stopped by the module."""
import shutil
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

import minfer
from factories import write_t5
from serve_process import serving

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "weights" / "tiny-t5-dates"
ST = ROOT / "weights" / "family" / "st_sentence_t5"
T5_TOKENIZER = Path("/work/shared/t5-tokenizer")


@pytest.fixture(scope="module")
def dates_server():
    with serving(DATES, "--max-input-tokens", "40", "--max-inputs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def st_server():
    with serving(ST) as s:
        yield s


def test_score_gives_each_targets_log_likelihood(dates_server):
    model = minfer.load(DATES)
    source, targets = "date: 4th of July 1976", ["1976-07-04", "1977-07-04"]
    with dates_server.client() as http:
        got = http.post("/v1/score", json={"text_1": source, "text_2": targets}).json()
        mean = http.post("/v1/score", json={"text_1": [source, source], "text_2": targets,
                                            "normalize": True}).json()
    want = model.score_pairs(source, targets)
    assert [d["index"] for d in got["data"]] == [0, 1]
    assert np.allclose([d["score"] for d in got["data"]], [w.total for w in want], atol=1e-4)
    assert np.allclose([d["score"] for d in mean["data"]], [w.mean for w in want], atol=1e-5)
    tokens = sum(len(model.tokenizer.encode(t)) for t in [source, source, *targets])
    assert got["usage"]["prompt_tokens"] == tokens and got["object"] == "list"


def test_rerank_refuses_words_the_vocabulary_spells_in_pieces(dates_server):
    with dates_server.client() as http:
        r = http.post("/v1/rerank", json={"query": "July", "documents": ["a", "b"]})
    assert r.status_code == 400 and "'true' is 4 tokens" in r.json()["error"]["message"]


@pytest.mark.skipif(not T5_TOKENIZER.is_dir(), reason="the real T5 tokenizer is not here")
def test_rerank_orders_documents_by_monot5_relevance(tmp_path_factory):
    folder = write_t5(tmp_path_factory.mktemp("mono") / "m", seed=5, vocab_size=32128,
                      d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                      num_decoder_layers=2)
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(T5_TOKENIZER / name, folder / name)
    docs = ["Cats are small furry animals.", {"text": "The stock market fell."}, "Purring cats."]
    texts = [d if isinstance(d, str) else d["text"] for d in docs]
    want = minfer.load(folder).rerank("what are cats?", texts)   # (checked against forward in
    with serving(folder) as server, server.client() as http:     # tests/test_scoring.py)
        got = http.post("/v1/rerank", json={"query": "what are cats?", "documents": docs,
                                            "top_n": 2}).json()
    assert [r["index"] for r in got["results"]] == [i for i, _ in want[:2]]
    assert np.allclose([r["relevance_score"] for r in got["results"]],
                       [s for _, s in want[:2]], atol=1e-6)
    assert [r["document"]["text"] for r in got["results"]] == [texts[i] for i, _ in want[:2]]
    long = ["Cats are small furry animals that purr. " * 100, "The stock market fell. " * 150]
    want = minfer.load(folder).rerank("what are cats?", long, max_input_tokens=64)
    with serving(folder, "--max-input-tokens", "256") as server, server.client() as http:
        refused = http.post("/v1/rerank", json={"query": "what are cats?", "documents": long})
        cut = http.post("/v1/rerank", json={"query": "what are cats?", "documents": long,
                                            "truncate_prompt_tokens": 64}).json()
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
    assert [r["index"] for r in cut["results"]] == [i for i, _ in want]
    assert np.allclose([r["relevance_score"] for r in cut["results"]], [s for _, s in want],
                       atol=1e-6)
    assert cut["results"][0]["document"]["text"] == long[want[0][0]]   # the document as sent


def test_an_embedding_model_scores_and_reranks_by_cosine(st_server):
    model = minfer.load(ST)
    docs = ["a cat sat", "the market fell", "cats sit"]
    with st_server.client() as http:
        score = http.post("/v1/score", json={"text_1": "a cat", "text_2": docs}).json()
        ranked = http.post("/rerank", json={"query": "a cat", "documents": docs}).json()
        bare = http.post("/v1/rerank", json={"query": "a cat", "documents": docs, "top_n": 1,
                                             "return_documents": False}).json()
    v = model.embed(["a cat", *docs]).astype(np.float64)
    cos = v[1:] @ v[0] / (np.linalg.norm(v[1:], axis=1) * np.linalg.norm(v[0]))
    assert np.allclose([d["score"] for d in score["data"]], cos, atol=1e-5)
    order = list(np.argsort(-cos))
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], cos[order], atol=1e-5)
    assert bare["results"] == [{"index": int(order[0]),
                                "relevance_score": ranked["results"][0]["relevance_score"]}]
    with st_server.client() as http:
        r = http.post("/v1/score", json={"text_1": "a", "text_2": "b", "normalize": True})
        cut = http.post("/v1/rerank", json={"query": "a", "documents": ["b"],
                                            "truncate_prompt_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "normalize"
    assert cut.status_code == 400 and "max_seq_length" in cut.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_2": ["x"]}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["x"] * 9}, "text_2"),          # --max-inputs 8
    ("/v1/score", {"text_1": "a " * 60, "text_2": "x"}, "text_1"),          # --max-input-tokens 40
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "d"}]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["d " * 60]}, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 41},
     "truncate_prompt_tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(dates_server, path, body, param):
    with dates_server.client() as http:
        r = http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "\n" not in error["message"]


def test_metrics_count_them(dates_server):
    before = dates_server.settle()
    with dates_server.client() as http:
        assert http.post("/v1/score", json={"text_1": "a", "text_2": "b"}).status_code == 200
    after = dates_server.settle()
    key = 'minfer_requests_total{endpoint="score",status="200"}'
    assert after[key] == before.get(key, 0) + 1
