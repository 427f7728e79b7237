"""minfer.integrations.ray: MinferPredictor on every batch format, per-row errors (a bad row
never fails the batch), options checked up front; and, where Ray is installed, a local
Ray Data pipeline (2 actors) whose every row equals a plain loop over the shipped tiny T5."""
import importlib.util
import json

import numpy as np
import pytest
from conftest import ROOT

import minfer
from minfer.errors import ConfigError, InputError
from minfer.integrations.ray import MinferPredictor, actor_cpus

T5 = ROOT / "weights" / "tiny-t5-dates"
HELDOUT = [json.loads(line) for line in (T5 / "heldout.jsonl").read_text().splitlines()]
BAD = {"": "empty prompt", "date: \ud800 1976": "lone surrogate"}
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'minfer[ray]')")


@pytest.fixture(scope="module")
def model():
    return minfer.load(T5, num_threads=1)


@pytest.fixture(scope="module")
def predictor(model):
    return MinferPredictor(model, column="prompt", max_new_tokens=24)


def rows_with_bad_ones(n: int) -> tuple[list, list]:
    """n held-out prompts with the bad ones (and a None) mixed in, and their targets (None:
    the row must fail)."""
    prompts = [r["prompt"] for r in HELDOUT[:n]]
    targets = [r["target"] for r in HELDOUT[:n]]
    for at, bad in zip((1, n // 2, n - 3), (*BAD, None)):  # (inside batches: a batch whose
        prompts.insert(at, bad)                            # only row is null reads as floats)
        targets.insert(at, None)
    return prompts, targets


def check(out: dict, prompts: list, targets: list, want: dict) -> None:
    """Every good row carries the plain loop's text; every bad one an error and no text."""
    for p, t, text, finish, err in zip(prompts, targets, out["generated"], out["finish_reason"],
                                       out["error"]):
        if t is None:
            assert text is None and finish is None and isinstance(err, str), p
            assert err and "\n" not in err and not err.startswith("inputs: prompt"), err
        else:
            assert err is None and text == want[p] == t and finish == "eos", p


def test_dict_batch_isolates_bad_rows_and_matches_a_plain_loop(model, predictor):
    prompts, targets = rows_with_bad_ones(40)
    batch = {"prompt": np.array(prompts, dtype=object), "id": np.arange(len(prompts))}
    out = predictor(batch)
    assert set(out) == {"prompt", "id", "generated", "finish_reason", "error"}
    assert out["id"] is batch["id"] and len(out["generated"]) == len(prompts)
    want = {p: model.generate(p, max_new_tokens=24) for p in prompts if isinstance(p, str) and p in
            {r["prompt"] for r in HELDOUT}}
    check(out, prompts, targets, want)
    assert "empty prompt" in out["error"][1] and "surrogate" in out["error"][20]
    assert "expected a string, got NoneType" in out["error"][37]


def test_fixed_width_string_arrays_and_empty_batches(predictor):
    out = predictor({"prompt": np.array(["date: 4th of July 1976", "spell: 12"])})
    assert out["generated"].tolist() == ["1976-07-04", "twelve"]
    assert predictor({"prompt": np.array([], dtype=object)})["generated"].tolist() == []


def test_pandas_and_pyarrow_batches_come_back_as_they_came():
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    p = MinferPredictor(str(T5), column="q", output_column="a", error_column="why",
                        load_options={"workspace": "64MiB"}, num_threads=1)
    df = pd.DataFrame({"q": ["date: 4th of July 1976", ""]})
    out = p(df)
    assert isinstance(out, pd.DataFrame) and list(df.columns) == ["q"]  # the input untouched
    assert out["a"][0] == "1976-07-04" and out["finish_reason"][0] == "eos"
    assert "empty prompt" in out["why"][1] and pd.isna(out["a"][1])
    table = p(pa.table({"q": ["spell: 12", None]}))  # (Arrow strings cannot hold a surrogate)
    assert isinstance(table, pa.Table)
    assert table.column("a").to_pylist() == ["twelve", None]
    assert "got NoneType" in table.column("why").to_pylist()[1]


def test_several_sequences_per_row_are_lists(model):
    p = MinferPredictor(model, column="prompt", num_beams=2, num_return_sequences=2)
    out = p({"prompt": np.array(["date: 4th of July 1976", ""], dtype=object)})
    assert len(out["generated"][0]) == 2 and out["generated"][0][0] == "1976-07-04"
    assert out["finish_reason"][0] == ["eos", "eos"] and out["generated"][1] is None


@pytest.mark.parametrize("kwargs, exc, needle", [
    ({"max_new_tokens": 0}, InputError, "max_new_tokens"),
    ({"no_such_option": 1}, InputError, "no_such_option"),
    ({"stream": True}, ConfigError, "'stream'"),
    ({"column": "x", "output_column": "x"}, ConfigError, "columns must differ"),
    ({"load_options": {"dtype": "int8"}}, ConfigError, "load_options"),
    ({"num_threads": None, "load_options": {"num_threads": 2}}, ConfigError, "num_threads"),
])
def test_bad_settings_fail_the_actor_at_once(model, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        MinferPredictor(model, **kwargs)


def test_missing_column_and_unknown_batch_kind_fail_with_one_line(predictor):
    with pytest.raises(ConfigError, match="no column 'prompt' \\(columns: text\\)"):
        predictor({"text": np.array(["x"])})
    with pytest.raises(ConfigError, match="got list"):
        predictor([["x"]])


def test_threads_default_to_one_outside_ray(model):
    assert actor_cpus() is None
    assert MinferPredictor(model, num_threads=2).num_threads == 2
    assert MinferPredictor(model).num_threads == 1  # (and the shared model is back at 1)
    assert model.backend.num_threads == 1


# -- a real local Ray Data pipeline ---------------------------------------------------------------
@needs_ray
def test_ray_data_pipeline_two_actors_matches_the_plain_loop(ray_session, model):
    # from_items: a lone surrogate survives only as a Python object (a JSON reader drops it or
    # refuses the file, and Arrow strings cannot hold it)
    ray = ray_session
    prompts, targets = rows_with_bad_ones(200)
    items = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    ds = ray.data.from_items(items).map_batches(
        MinferPredictor, batch_size=32, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        fn_constructor_kwargs={"model": model, "column": "prompt", "max_new_tokens": 24})
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(len(prompts)))
    out = {k: [r[k] for r in rows] for k in ("generated", "finish_reason", "error")}
    want = {p: model.generate(p, max_new_tokens=24) for p, t in zip(prompts, targets) if t}
    check(out, prompts, targets, want)


@needs_ray
def test_an_actor_with_one_cpu_uses_one_thread(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=1)
    class Probe:
        def threads(self, folder):
            return actor_cpus(), MinferPredictor(folder).num_threads

    assert ray.get(Probe.remote().threads.remote(str(T5))) == (1, 1)
