"""sentence-transformers 5.4+ folders: the compact Pooling layout (`embedding_dimension`,
`pooling_mode` as a string, `include_prompt`) and the module type paths it writes load as the
old layout does, with the same embeddings; mixed or half-read layouts are refused by name."""
import json
import shutil

import numpy as np
import pytest
from conftest import ROOT

import minfer
from minfer.errors import CheckpointError
from minfer.io.sentence_transformers import POOLING_MODES, kind_of, read_sentence_modules

FIXTURE = ROOT / "weights" / "family" / "st_sentence_t5"
TEXTS = ["A sentence to embed.", "Another, longer sentence that has more tokens in it.", "x"]
# the type paths sentence-transformers 5.4+ writes (as vLLM's fix for them lists them)
NEW_TYPES = {1: "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
             2: "sentence_transformers.base.modules.dense.Dense",
             3: "sentence_transformers.sentence_transformer.modules.normalize.Normalize"}


def compact(folder, mode, include_prompt=True, dimension=16, **extra):
    """Rewrite the folder's Pooling config as sentence-transformers 5.4+ saves it."""
    cfg = {"embedding_dimension": dimension, "pooling_mode": mode,
           "include_prompt": include_prompt, **extra}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def verbose(folder, modes, include_prompt=True):
    cfg = {"word_embedding_dimension": 16, "include_prompt": include_prompt,
           **{f"pooling_mode_{m}": m in modes for m in POOLING_MODES}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def pair(tmp_path):
    """Two copies of the sentence-t5-shaped fixture: one to keep in the old layout, one to
    rewrite in the new."""
    return (shutil.copytree(FIXTURE, tmp_path / "old"), shutil.copytree(FIXTURE, tmp_path / "new"))


def test_the_compact_layout_gives_the_fixtures_reference_embeddings(pair):
    _, new = pair
    compact(new, "mean")
    entries = json.loads((new / "modules.json").read_text())
    for i, name in NEW_TYPES.items():
        entries[i]["type"] = name
    (new / "modules.json").write_text(json.dumps(entries))
    ref = np.load(FIXTURE / "reference.npz")
    m = minfer.load(new)
    assert m.sentence_modules.pooling.modes == ("mean_tokens",)
    assert m.sentence_modules.pooling.dimension_key == "embedding_dimension"
    got = m.embed([str(t) for t in ref["texts"]])
    np.testing.assert_allclose(got, ref["embeddings"], rtol=0, atol=2e-6)


@pytest.mark.parametrize("string, modes", [
    ("cls", ["cls_token"]), ("max", ["max_tokens"]), ("mean", ["mean_tokens"]),
    ("mean_sqrt_len_tokens", ["mean_sqrt_len_tokens"]), ("weightedmean", ["weightedmean_tokens"]),
    ("lasttoken", ["lasttoken"]),
    # several modes concatenate in sentence-transformers' order, whatever order names them
    ("mean+cls", ["cls_token", "mean_tokens"]), ("MEAN", ["mean_tokens"])])
def test_each_mode_string_reads_as_its_flags(pair, string, modes):
    old, new = pair
    for folder in pair:   # two modes double the width: no Dense of 16 inputs after them
        entries = json.loads((folder / "modules.json").read_text())
        (folder / "modules.json").write_text(json.dumps([entries[0], entries[1], entries[3]]))
    compact(new, string)
    verbose(old, modes)
    a, b = read_sentence_modules(old), read_sentence_modules(new)
    assert a.pooling.modes == b.pooling.modes == tuple(modes)


@pytest.mark.parametrize("string, modes, include_prompt", [
    ("max", ["max_tokens"], True), ("cls", ["cls_token"], False),
    ("weightedmean", ["weightedmean_tokens"], False), ("lasttoken", ["lasttoken"], True)])
def test_both_layouts_embed_the_same(pair, string, modes, include_prompt):
    """The same weights and settings in either layout: the same embeddings, bit for bit (a
    Dense layer follows the pooling, so a changed width is refused instead: keep one mode)."""
    old, new = pair
    compact(new, string, include_prompt)
    verbose(old, modes, include_prompt)
    a = minfer.load(old).embed(TEXTS, prompt="query: ")
    b = minfer.load(new).embed(TEXTS, prompt="query: ")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cfg, match", [
    ({"embedding_dimension": 16, "pooling_mode": "median"}, "'pooling_mode' must name"),
    ({"embedding_dimension": 16, "pooling_mode": ["mean"]}, "'pooling_mode' must name"),
    ({"embedding_dimension": 16, "pooling_mode": "mean+mean"}, "'pooling_mode' must name"),
    ({"embedding_dimension": 16, "pooling_mode": ""}, "'pooling_mode' must name"),
    ({"embedding_dimension": "16", "pooling_mode": "mean"},
     "'embedding_dimension' must be a positive integer"),
    ({"pooling_mode": "mean"}, "'embedding_dimension' must be a positive integer"),
    ({"embedding_dimension": 16, "word_embedding_dimension": 16, "pooling_mode": "mean"},
     "states both 'word_embedding_dimension' and 'embedding_dimension'"),
    ({"embedding_dimension": 16, "pooling_mode": "mean", "pooling_mode_cls_token": True},
     "states both 'pooling_mode' and 'pooling_mode_cls_token'"),
    ({"embedding_dimension": 16, "pooling_mode": "mean", "include_prompt": "no"},
     "'include_prompt' must be true or false")])
def test_bad_compact_configs_are_one_line_errors(pair, cfg, match):
    _, new = pair
    (new / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as e:
        read_sentence_modules(new)
    assert "\n" not in str(e.value) and "1_Pooling/config.json" in str(e.value)


def test_a_compact_width_that_misfits_the_encoder_names_its_key(pair):
    _, new = pair
    compact(new, "mean", dimension=8)
    dense = new / "2_Dense" / "config.json"
    (dense).write_text(json.dumps({**json.loads(dense.read_text()), "in_features": 8}))
    with pytest.raises(CheckpointError):   # the Dense weights are (20, 16): refused first
        minfer.load(new)
    shutil.rmtree(new / "2_Dense")
    entries = json.loads((new / "modules.json").read_text())
    (new / "modules.json").write_text(json.dumps([entries[0], entries[1], entries[3]]))
    with pytest.raises(minfer.ConfigError, match="'embedding_dimension' 8 of the Pooling module "
                                                 "does not fit the encoder's d_model 16"):
        minfer.load(new)


@pytest.mark.parametrize("name, kind", [(n, n.rsplit(".", 1)[1]) for n in NEW_TYPES.values()]
                         + [("sentence_transformers.base.modules.normalize.Normalize", "Normalize")])
def test_new_type_paths_name_their_class_last(name, kind):
    assert kind_of(name, "x") == kind
