"""A loaded model pickles as its load recipe (models/base.py: __reduce__; minfer.load records
the arguments): a few hundred bytes that load it again on the other side, never its weights or
arena; no token; a clear error for models that were not made by minfer.load."""
import importlib.util
import pickle

import pytest
from conftest import ROOT

import minfer
from minfer.io.checkpoint import Checkpoint
from minfer.models.t5 import T5Model
from minfer.params.runtime import Recorder

T5 = ROOT / "weights" / "tiny-t5-dates"
XL = ROOT / "weights" / "tiny-xl-recall"
PROMPT = "date: 4th of July 1976"


@pytest.fixture(scope="module")
def t5():
    return minfer.load(T5, workspace="64MiB")


def test_model_pickles_as_its_recipe_and_loads_again(t5):
    data = pickle.dumps(t5)
    assert len(data) < 600  # the recipe, not the weights (or the 64 MiB arena)
    back = pickle.loads(data)
    assert back is not t5 and type(back) is type(t5)
    assert back.load_recipe == t5.load_recipe
    assert back.backend.arena.capacity == t5.backend.arena.capacity
    assert back.generate(PROMPT) == t5.generate(PROMPT) == "1976-07-04"


def test_cloudpickle_writes_the_same_small_payload(t5):
    cloudpickle = pytest.importorskip("cloudpickle")
    data = cloudpickle.dumps(t5)
    assert len(data) < 600
    assert cloudpickle.loads(data).generate(PROMPT) == "1976-07-04"


def test_recipe_holds_the_load_arguments_and_never_the_token(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    model = minfer.load("weights/tiny-t5-dates", dtype="float16", workspace="8MiB",
                        num_threads=1, offline=True, token="hf_not_a_real_secret")
    recipe = model.load_recipe
    assert recipe == {"model": str(T5), "device": "cpu", "dtype": "float16", "workspace": "8MiB",
                      "compute": None, "memory_limit": None, "num_threads": 1, "revision": None, "offline": True,
                      "cache_dir": None, "parts": None, "subfolder": None,
                      "tokenizer_subfolder": None}
    data = pickle.dumps(model)
    assert b"hf_not_a_real_secret" not in data
    monkeypatch.chdir(tmp_path)  # a relative folder was recorded absolute: another cwd loads it
    back = pickle.loads(data)
    assert back.backend.weight_format == model.backend.weight_format
    assert back.backend.arena.capacity == model.backend.arena.capacity
    assert back.generate(PROMPT) == model.generate(PROMPT)


def test_hub_names_stay_names():
    assert minfer._recipe("t5-small", revision="main")["model"] == "t5-small"


def test_memory_limited_transformer_xl_pickles_too():
    model = minfer.load(XL, memory_limit="16MiB")
    back = pickle.loads(pickle.dumps(model))
    assert back.backend.memory_limit == model.backend.memory_limit
    assert back.generate([[5, 6, 7]], max_new_tokens=4) == model.generate([[5, 6, 7]],
                                                                          max_new_tokens=4)


@pytest.mark.parametrize("how", ["recorder", "in-memory"])
def test_models_without_a_recipe_refuse_with_one_line(how):
    if how == "recorder":
        model, needle = minfer.load(T5, _recorder=Recorder()), "_recorder"
    else:
        model, needle = T5Model.load(Checkpoint(T5), minfer.load(T5).backend), "not made by minfer.load"
    assert model.load_recipe is None
    with pytest.raises(pickle.PicklingError, match=needle) as err:
        pickle.dumps(model)
    assert "\n" not in str(err.value) and "T5Model" in str(err.value)
    if importlib.util.find_spec("cloudpickle") is not None:
        import cloudpickle
        with pytest.raises(pickle.PicklingError, match=needle):
            cloudpickle.dumps(model)
