"""minfer.integrations.ray's encode and embed actors: every batch kind, per-row errors,
settings checked up front; and, where Ray is installed, a local Ray Data pipeline (2 actors)
whose rows equal model.encode / model.embed called directly."""
import importlib.util

import numpy as np
import pytest
from conftest import make_text_model_folder

import minfer
from minfer.errors import ConfigError, InputError
from minfer.integrations.ray import MinferEmbedder, MinferEncoder

TEXTS = ["a cat sat on the mat", "hi", "one two three four five six", "a dog"]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'minfer[ray]')")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_text_model_folder(tmp_path_factory.mktemp("ray") / "m")


@pytest.fixture(scope="module")
def model(folder):
    return minfer.load(folder, num_threads=1)


def test_encoder_dict_batch_is_tensor_columns_in_the_preset_layout(model):
    actor = MinferEncoder(model, preset="chroma", max_length=12)
    out = actor({"text": np.array(TEXTS, dtype=object), "id": np.arange(4)})
    states, mask = model.encode(TEXTS, preset="chroma", max_length=12, return_mask=True)
    assert out["states"].shape == (4, 12, 32) and out["attention_mask"].shape == (4, 12)
    np.testing.assert_allclose(out["states"], states, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(out["attention_mask"], mask)
    assert out["error"].tolist() == [None] * 4 and out["id"].tolist() == [0, 1, 2, 3]


def test_encoder_rows_keep_their_own_tokens_and_bad_rows_fail_alone(model):
    actor = MinferEncoder(model)
    out = actor({"text": np.array([TEXTS[0], None, "\ud800", TEXTS[1]], dtype=object)})
    for k, text in ((0, TEXTS[0]), (3, TEXTS[1])):
        n = len(model.tokenizer.encode(text))
        assert out["states"][k].shape == (n, 32) and out["attention_mask"][k].tolist() == [1] * n
        np.testing.assert_allclose(out["states"][k], model.encode(text)[0], rtol=0, atol=1e-5)
    assert out["states"][1] is None and "got NoneType" in out["error"][1]
    assert out["states"][2] is None and "surrogate" in out["error"][2]
    assert "\n" not in out["error"][2] and out["error"][0] is None


def test_pandas_and_arrow_batches(model):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    actor = MinferEncoder(model, column="q", preset="flux", max_length=6)
    want = model.encode(TEXTS[:2], preset="flux", max_length=6)
    frame = actor(pd.DataFrame({"q": TEXTS[:2]}))
    np.testing.assert_allclose(np.stack(frame["states"]), want, rtol=0, atol=1e-5)
    table = actor(pa.table({"q": TEXTS[:2]}))
    np.testing.assert_allclose(np.array(table.column("states").to_pylist(), np.float32), want,
                               rtol=0, atol=1e-5)
    emb = MinferEmbedder(model, column="q")(pd.DataFrame({"q": TEXTS}))
    np.testing.assert_allclose(np.stack(emb["embedding"]), model.embed(TEXTS), rtol=0, atol=1e-6)


def test_embedder_dict_batch(model):
    out = MinferEmbedder(model, dimensions=8)({"text": np.array(TEXTS)})
    assert out["embedding"].shape == (4, 8)
    np.testing.assert_allclose(out["embedding"], model.embed(TEXTS, dimensions=8), atol=1e-6)


@pytest.mark.parametrize("cls, kwargs, exc, needle", [
    (MinferEncoder, {"preset": "dalle"}, InputError, "preset 'dalle'"),
    (MinferEncoder, {"states_column": "text"}, ConfigError, "columns must differ"),
    (MinferEncoder, {"load_options": {"dtype": "int8"}}, ConfigError, "load_options"),
    (MinferEmbedder, {"dimensions": 0}, InputError, "dimensions"),
])
def test_bad_settings_fail_the_actor_at_once(model, cls, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        cls(model, **kwargs)


# -- a real local Ray Data pipeline ---------------------------------------------------------------
@needs_ray
def test_ray_data_pipeline_encodes_and_embeds_as_the_model_does(ray_session, model, folder):
    ray = ray_session
    texts = [f"caption {i}: " + " ".join(TEXTS[: 1 + i % 4]) for i in range(40)]
    items = [{"id": i, "text": t} for i, t in enumerate(texts)]
    ds = ray.data.from_items(items).map_batches(
        MinferEncoder, batch_size=8, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        fn_constructor_kwargs={"model": str(folder), "preset": "wan", "max_length": 16})
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    states, mask = model.encode(texts, preset="wan", max_length=16, return_mask=True)
    assert [r["id"] for r in rows] == list(range(40))
    np.testing.assert_allclose(np.stack([r["states"] for r in rows]), states, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.stack([r["attention_mask"] for r in rows]), mask)
    ds = ray.data.from_items(items).map_batches(
        MinferEmbedder, batch_size=8, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        fn_constructor_kwargs={"model": model})
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    np.testing.assert_allclose(np.stack([r["embedding"] for r in rows]), model.embed(texts),
                               rtol=0, atol=1e-5)
