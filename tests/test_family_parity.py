"""The T5 checkpoints of issue 18 against transformers 4.57 and sentence-transformers 5.1: UMT5,
encoder-only saves, ByT5-, MADLAD-, UL2- and CodeT5+-shaped checkpoints and sentence-transformers
folders (references in weights/family, made by weights/make_family_fixtures.py; no torch here)."""
import json

import numpy as np
import pytest
from conftest import ROOT, rel_err

import minfer
from minfer.errors import InputError

FIXTURES = ROOT / "weights" / "family"
TOL = 1e-4
SEQ2SEQ = ["umt5_seq2seq", "byt5_shape", "madlad_shape", "ul2_shape", "codet5p_220m_shape",
           "codet5p_770m_shape", "deeper_decoder"]
ENCODERS = ["umt5_encoder", "t5_encoder_sharded"]
SENTENCE = ["st_sentence_t5", "st_prompts"]


def reference(case):
    with np.load(FIXTURES / case / "reference.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def config(case):
    return json.loads((FIXTURES / case / "config.json").read_text())


_models = {}


def model(case, **options):
    key = (case, tuple(sorted(options.items())))
    if key not in _models:
        _models[key] = minfer.load(FIXTURES / case, **options)
    return _models[key]


def trim(row, eos):
    """HF pads finished rows; minfer returns each row up to and including its eos."""
    row = [int(t) for t in row]
    return row[:row.index(eos, 1) + 1] if eos in row[1:] else row


def test_every_case_has_its_reference():
    for case in SEQ2SEQ + ENCODERS + SENTENCE:
        assert (FIXTURES / case / "reference.npz").is_file(), case


@pytest.mark.parametrize("case", SEQ2SEQ + ENCODERS)
def test_encoder_states_match(case):
    ref = reference(case)
    got = model(case).encode(ref["input_ids"], ref["attention_mask"])
    mask = ref["attention_mask"].astype(bool)   # padded positions are not compared
    assert got.shape == ref["encoder_states"].shape
    assert rel_err(got[mask], ref["encoder_states"][mask]) < TOL


@pytest.mark.parametrize("case", SEQ2SEQ)
def test_logits_match(case):
    ref = reference(case)
    got = model(case).forward(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
    assert rel_err(got, ref["logits"]) < TOL


@pytest.mark.parametrize("case", [c for c in SEQ2SEQ if c != "deeper_decoder"])
def test_greedy_ids_match(case):
    ref = reference(case)
    m = model(case)
    eos = config(case).get("eos_token_id", 1)
    got = m.generate(ref["input_ids"], attention_mask=ref["attention_mask"],
                     max_new_tokens=int(ref["greedy_max_new_tokens"]))
    assert got == [trim(r, eos) for r in ref["greedy_ids"]]


def test_the_shapes_are_the_real_checkpoints_shapes():
    """What each case stands for is in its config, as the real checkpoint's."""
    umt5 = model("umt5_seq2seq").config
    assert umt5.model_type == "umt5" and umt5.bias_per_layer and not umt5.tie_word_embeddings
    byt5 = model("byt5_shape").config
    assert (byt5.vocab_size, byt5.num_layers, byt5.num_decoder_layers) == (384, 3, 1)
    madlad = model("madlad_shape")
    assert (madlad.token_ids.pad, madlad.token_ids.eos, madlad.token_ids.start) == (1, (2,), 0)
    from minfer.io.checkpoint import Checkpoint
    names = Checkpoint(FIXTURES / "madlad_shape").names()
    assert "shared.weight" not in names and "encoder.embed_tokens.weight" in names
    assert madlad.config.inner != madlad.config.d_model
    ul2 = model("ul2_shape").config
    assert ul2.act == "silu" and ul2.gated and ul2.inner != ul2.d_model
    for case in ("codet5p_220m_shape", "codet5p_770m_shape"):
        cfg = model(case).config
        assert cfg.act == "relu" and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    deeper = model("deeper_decoder").config
    assert deeper.num_decoder_layers > deeper.num_layers


# -- encoder-only models -----------------------------------------------------------------------------
def test_encoder_only_saves_load_as_encoders():
    umt5 = model("umt5_encoder")
    assert "model_type" not in config("umt5_encoder")   # read from architectures
    assert umt5.config.model_type == "umt5" and umt5.config.bias_per_layer
    for case in ENCODERS:
        m = model(case)
        assert m.parts == ("encoder",) and not m.can_generate
        assert set(m.plan(2, 16)) == {"encoder_scratch", "peak"}   # no decoder state planned
        with pytest.raises(InputError, match="encoder only .* not generate"):
            m.generate([[5, 6, 1]])
        with pytest.raises(InputError, match="not generate"):
            m.forward([[5, 6, 1]], [[0, 3]])


def test_diffusers_text_encoder_call_matches():
    """Flux / SD3's `_get_t5_prompt_embeds`: padded to max_length, cut there, no mask."""
    ref = reference("t5_encoder_sharded")
    m = model("t5_encoder_sharded")
    texts = [str(t) for t in ref["texts"]]
    n = int(ref["padded_length"])
    ids, _ = m._encoder_batch(texts, None, "max_length", n, True)
    assert np.array_equal(ids, ref["padded_ids"])   # the first text is cut, keeping its </s>
    got = m.encode(texts, padding="max_length", max_length=n, truncation=True,
                   use_attention_mask=False)
    assert got.shape == ref["padded_states"].shape
    assert rel_err(got, ref["padded_states"]) < TOL
    masked = m.encode(texts, padding="max_length", max_length=n, truncation=True)
    assert rel_err(masked, got) > 1e-3   # the mask matters, so the test above says something


def test_full_checkpoint_loads_for_encoding_without_reading_its_decoder(monkeypatch):
    from minfer.io.checkpoint import Checkpoint
    read = []
    for method in ("read", "read_stored"):
        def spy(self, name, *args, _original=getattr(Checkpoint, method), **kwargs):
            read.append(name)
            return _original(self, name, *args, **kwargs)
        monkeypatch.setattr(Checkpoint, method, spy)
    ref = reference("umt5_seq2seq")
    m = minfer.load(FIXTURES / "umt5_seq2seq", parts="encoder")
    assert m.parts == ("encoder",)
    assert read and not [n for n in read if n.startswith("decoder.") or n == "lm_head.weight"]
    mask = ref["attention_mask"].astype(bool)
    got = m.encode(ref["input_ids"], ref["attention_mask"])
    assert rel_err(got[mask], ref["encoder_states"][mask]) < TOL
    full = model("umt5_seq2seq")
    assert m.parameter_count() < full.parameter_count()
    assert not [u for u in m.weight_plan.unit_bytes if not u.startswith("encoder.")]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float16", 1e-2), ("bfloat16", 5e-2),
                                        ("int8", 5e-2)])
def test_encoder_streams_under_a_memory_limit(folder, dtype, tol):
    """A full checkpoint loaded for encoding under the smallest limit that works (two streaming
    slots, no layer resident): the encoder layers stream, the decoder counts nowhere, and the
    states are those of the unlimited run (float32) or close to them (compressed formats)."""
    ids = [[5, 6, 7, 8, 1], [9, 10, 1]]
    ref = minfer.load(folder).encode(ids)
    probe = minfer.load(folder, dtype=dtype, workspace="1MiB", parts="encoder")
    plan = probe.weight_plan
    assert list(plan.unit_bytes) == ["encoder.0", "encoder.1", "encoder.2", "encoder.3"]
    limit = plan.fixed + 2 * max(plan.unit_bytes.values()) + plan.scratch_bytes + (1 << 20)
    m = minfer.load(folder, dtype=dtype, memory_limit=limit, workspace="1MiB", parts="encoder")
    assert m.weight_plan.streamed == list(plan.unit_bytes)
    assert rel_err(m.encode(ids), ref) < tol
    with pytest.raises(minfer.ConfigError, match="too small"):   # the whole model would not fit
        minfer.load(folder, dtype=dtype, memory_limit=limit, workspace="1MiB")


def test_encode_options_are_checked():
    m = model("t5_encoder_sharded")
    for kwargs, match in [(dict(padding="max"), "padding"), (dict(padding="max_length"), "needs max_length"),
                          (dict(truncation=True), "needs max_length"), (dict(max_length=0), "max_length")]:
        with pytest.raises(InputError, match=match):
            m.encode("hello", **kwargs)
    with pytest.raises(InputError, match="more than max_length 3"):
        m.encode([[5, 6, 7, 8, 1]], max_length=3)
    assert m.encode([[5, 6, 7, 8, 1]], max_length=3, truncation=True).shape == (1, 3, 16)
    with pytest.raises(InputError, match="attention_mask applies to token ids"):
        m.encode(["a"], attention_mask=[[1]])


def test_text_and_ids_encode_alike():
    m = model("t5_encoder_sharded")
    ids = m.tokenizer.encode("Hello world")
    assert np.array_equal(m.encode("Hello world"), m.encode([ids]))


# -- sentence embeddings -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", SENTENCE)
def test_embeddings_match_sentence_transformers(case):
    ref = reference(case)
    m = model(case)
    texts = [str(t) for t in ref["texts"]]
    assert "pooling" in m.parts
    got = m.embed(texts)
    assert got.dtype == np.float32 and got.shape == ref["embeddings"].shape
    assert np.abs(np.diff(ref["embeddings"], axis=0)).max() > 1e-2   # texts differ
    assert np.abs(got - ref["embeddings"]).max() <= 1e-5
    for key in ref:
        if key.startswith("embeddings_prompt_"):
            named = m.embed(texts, prompt_name=key[len("embeddings_prompt_"):], batch_size=2)
            assert np.abs(named - ref[key]).max() <= 1e-5, key


def test_embedding_settings_are_read():
    m = model("st_prompts")
    st = m.sentence_modules
    assert st.transformer.name == "0_Transformer" and st.do_lower_case and st.max_seq_length == 16
    assert st.default_prompt_name == "query" and not st.pooling.include_prompt
    assert st.pooling.modes == ("max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
                                "lasttoken")
    assert [s.activation for s in st.steps] == ["tanh", "identity"] and st.dimension == 8
    # the default prompt differs from none, and an explicit prompt equals the named one
    texts = ["Hello world", "x"]
    assert np.abs(m.embed(texts) - m.embed(texts, prompt="")).max() > 1e-3
    assert np.array_equal(m.embed(texts, prompt="passage: "), m.embed(texts, prompt_name="passage"))
    with pytest.raises(InputError, match="not one of the model's prompts"):
        m.embed(texts, prompt_name="nope")
    with pytest.raises(InputError, match="not both"):
        m.embed(texts, prompt="a", prompt_name="query")
    s5 = model("st_sentence_t5").sentence_modules
    assert s5.transformer == s5.folder and s5.steps[0].bias is None   # Dense from a .bin


def test_a_folder_without_modules_embeds_by_mean_pooling():
    m = model("t5_encoder_sharded")
    assert m.sentence_modules is None
    texts = ["Hello world", "A quick brown fox jumps over the lazy dog."]
    got = m.embed(texts)
    for i, text in enumerate(texts):
        states = m.encode(text)[0]
        assert np.allclose(got[i], states.mean(axis=0), atol=1e-6)


def test_encode_runs_a_batch_the_arena_cannot_hold_in_passes():
    ref = reference("umt5_encoder")
    full = model("umt5_encoder")
    one = full.plan(1, ref["input_ids"].shape[1])["encoder_scratch"]
    assert full.plan(3, ref["input_ids"].shape[1])["encoder_scratch"] > one + 4096
    small = minfer.load(FIXTURES / "umt5_encoder", workspace=one + 4096)
    assert small._rows_per_pass(3, ref["input_ids"].shape[1]) == 1
    got = small.encode(ref["input_ids"], ref["attention_mask"])
    assert rel_err(got, full.encode(ref["input_ids"], ref["attention_mask"])) < 1e-6


def test_encoder_only_int8_conversion_and_pickling(tmp_path):
    import pickle

    from minfer.convert import convert
    ref = reference("umt5_encoder")
    convert(FIXTURES / "umt5_encoder", tmp_path / "int8", "int8")
    m = minfer.load(tmp_path / "int8")
    assert m.backend.weight_format == "int8" and m.parts == ("encoder",)
    mask = ref["attention_mask"].astype(bool)
    got = m.encode(ref["input_ids"], ref["attention_mask"])
    # int8 rounds each weight by up to 1/254 of its row's largest: through three random
    # 16-wide layers the states move by a few percent (5.6% measured), not more
    assert rel_err(got[mask], ref["encoder_states"][mask]) < 0.1
    again = pickle.loads(pickle.dumps(minfer.load(FIXTURES / "umt5_seq2seq", parts="encoder")))
    assert again.parts == ("encoder",) and again.load_recipe["parts"] == "encoder"


def test_byt5_text_generation_is_its_token_id_generation_decoded(tmp_path):
    # the ByT5-shaped fixture (greedy ids equal transformers') with ByT5's byte tokenizer: text
    # in and out goes through the same ids; streamed pieces join to the same text
    import shutil
    folder = tmp_path / "byt5"
    shutil.copytree(ROOT / "weights" / "family" / "byt5_shape", folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        shutil.copy(ROOT / "weights" / "tokenizers" / "byt5" / name, folder / name)
    m = minfer.load(folder)
    for prompt in ("Grüße, Zürich!", "naïve 😀 café", "<extra_id_0> fill"):
        ids = m.tokenizer.encode(prompt)
        out = m.generate([ids], max_new_tokens=12)[0]
        text = m.generate(prompt, max_new_tokens=12)
        assert text == m.tokenizer.decode(out)
        assert "".join(m.generate(prompt, stream=True, max_new_tokens=12)) == text
