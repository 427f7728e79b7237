"""The search loops (generation/search.py): greedy rows leaving the batch, beam search against
Hugging Face transformers' (committed references), sampled beam search."""
import json

import numpy as np
import pytest
from conftest import T5_CASES, T5_FIXTURES, load_reference, trim_hf_ids

SEARCH = json.loads((T5_FIXTURES / "search_settings.json").read_text()) if T5_CASES else {}


@pytest.mark.parametrize("setting", sorted(SEARCH))
@pytest.mark.parametrize("case", T5_CASES)
def test_search_matches(case, setting, t5_models):
    ref = load_reference(case)
    options = dict(SEARCH[setting])
    use_min = options.pop("use_min", False)
    model = t5_models(case)
    results = model.generate(ref["input_ids"], attention_mask=ref["attention_mask"],
                             return_details=True,
                             max_new_tokens=int(ref["greedy_max_new_tokens"]),
                             min_new_tokens=int(ref["greedy_min_new_tokens"]) if use_min else 0,
                             **options)
    got = [r.token_ids for row in results for r in row]
    assert got == [trim_hf_ids(r) for r in ref[f"search_{setting}_ids"]]
    if options["num_beams"] > 1:
        scores = [r.score for row in results for r in row]
        np.testing.assert_allclose(scores, ref[f"search_{setting}_scores"], rtol=1e-4, atol=1e-5)


def test_finished_rows_leave_the_batch(text_model, monkeypatch):
    """Rows that end stop costing compute: the state's live batch shrinks."""
    from minfer.models.t5 import T5DecodeState
    sizes = []
    real_step = T5DecodeState.step
    monkeypatch.setattr(T5DecodeState, "step",
                        lambda self, tokens: (sizes.append(self.batch), real_step(self, tokens))[1])
    prompts = ["a b c", "date: 1999", "one two", "x"]
    results = text_model.generate(prompts, max_new_tokens=30, return_details=True,
                                  stop=[" "])
    lengths = sorted(r[0].new_tokens for r in results)
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True)
    assert len(sizes) == lengths[-1]
    if lengths[0] < lengths[-1]:
        assert sizes[-1] < 4


def test_sampled_beam_search_is_seeded_ranked_and_differs_from_plain_beams(text_model):
    """do_sample with num_beams: the 2*num_beams candidates are drawn (Gumbel top-k), not taken."""
    opts = dict(num_beams=3, num_return_sequences=3, max_new_tokens=8)

    def run(**extra):
        row = text_model.generate([[5, 6, 7, 1]], return_details=True, **opts, **extra)[0]
        return [(r.token_ids, r.score) for r in row]

    first = run(do_sample=True, seed=1)
    assert first == run(do_sample=True, seed=1)                    # the seed fixes the draws
    scores = [s for _, s in first]
    assert scores == sorted(scores, reverse=True)                   # best first
    assert all(ids[0] == 0 and len(ids) <= 9 for ids, _ in first)  # start token, length limit
    draws = [run(do_sample=True, seed=s) for s in range(2, 8)]
    assert any(d != first for d in draws)
    assert any(d != run() for d in draws)                            # plain beam search differs
