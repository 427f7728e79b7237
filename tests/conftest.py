from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
T5_FIXTURES = ROOT / "weights" / "t5"
T5_CASES = sorted(p.name for p in T5_FIXTURES.glob("*") if (p / "reference.npz").is_file())
XL_FIXTURES = ROOT / "weights" / "transfo_xl"
XL_CASES = sorted(p.name for p in XL_FIXTURES.glob("*") if (p / "reference.npz").is_file())
needs_xl_fixtures = pytest.mark.skipif(not XL_CASES, reason="no Transformer-XL fixtures")


def _transformers_has(name: str) -> bool:
    """torch and transformers are installed, and transformers has `name` (its Transformer-XL
    classes were removed in transformers 5)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return False
    import transformers
    try:
        return getattr(transformers, name, None) is not None
    except Exception:  # transformers' lazy module raises when the class's module is gone
        return False


needs_xl_oracle = pytest.mark.skipif(
    not _transformers_has("TransfoXLLMHeadModel"),
    reason="needs torch and a transformers with Transformer-XL (< 5; the [dev] extra pins 4.57)")


def fixture_script(name: str):
    """weights/<name>.py (a fixture writer: its reference_outputs is the live oracle), imported
    from its file (weights/ is no package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "weights" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def load_reference(case: str, fixtures: Path = T5_FIXTURES) -> dict[str, np.ndarray]:
    with np.load(fixtures / case / "reference.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_xl_reference(case: str) -> dict[str, np.ndarray]:
    return load_reference(case, XL_FIXTURES)


def rel_err(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def trim_hf_ids(row, pad: int = 0, eos: int = 1) -> list[int]:
    """HF pads finished rows; minfer returns each row up to and including its eos."""
    row = [int(t) for t in row]
    out = row[:1]
    for t in row[1:]:
        out.append(t)
        if t == eos:
            break
    return out


@pytest.fixture(scope="session")
def _loaded_models():
    return {}


def compiled_then_array_path(monkeypatch):
    """For a test of one ops function on both of its paths: yields True with the compiled
    kernels (where they run), then False with them off for ops (`ops.compiled`) and the
    scratch planned as without them (`kernels.max_threads` 0)."""
    from minfer import kernels, ops
    if kernels.active() is not None:
        yield True
    monkeypatch.setattr(ops, "compiled", lambda xp, x: None)
    monkeypatch.setattr(kernels, "max_threads", lambda: 0)
    yield False


@pytest.fixture(params=["numba", "numpy"])
def kernel_mode(request, monkeypatch):
    """Run the test with the compiled CPU kernels and again with the pure NumPy path
    (MINFER_KERNELS=numpy): both are held to the same references. The fixtures' matrices are
    narrower than the kernels' shortest rows in production (KERNEL_MIN_INNER): here every
    small product goes to them."""
    from minfer import kernels
    from minfer import products
    monkeypatch.setattr(kernels, "_mode", request.param)
    monkeypatch.setattr(products, "KERNEL_MIN_INNER", 1)
    return request.param


def _models(folder, cache, mode):
    import minfer

    def get(case: str):
        key = (str(folder), case, mode)  # weights are wrapped for the kernel mode at load
        if key not in cache:
            cache[key] = minfer.load(folder / case)
        return cache[key]
    return get


@pytest.fixture
def t5_models(kernel_mode, _loaded_models):
    """case -> the loaded weights/t5 fixture model, in both kernel modes."""
    return _models(T5_FIXTURES, _loaded_models, kernel_mode)


@pytest.fixture
def xl_models(kernel_mode, _loaded_models):
    """case -> the loaded weights/transfo_xl fixture model, in both kernel modes."""
    return _models(XL_FIXTURES, _loaded_models, kernel_mode)


TINY_TOKENIZER = ROOT / "weights" / "tokenizers" / "tiny-t5"
REAL_T5_TOKENIZER = ROOT.parent / "shared" / "t5-tokenizer"


def make_text_model_folder(folder, seed=5, **overrides):
    """A random T5 over the committed tiny vocabulary (600 ids) with its tokenizer files, plus
    task_specific_params like t5-small's."""
    import shutil

    from factories import write_t5
    params = {"translation_en_to_de": {"prefix": "translate English to German: ", "num_beams": 2,
                                       "max_length": 9, "early_stopping": True},
              "summarization": {"prefix": "summarize: ", "min_length": 4, "max_length": 7,
                                "no_repeat_ngram_size": 3}}
    write_t5(folder, seed=seed, vocab_size=600, d_model=32, d_kv=8, num_heads=4, d_ff=64,
             task_specific_params=params, **overrides)
    for name in ("tokenizer.json", "spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def text_model_folder(tmp_path_factory):
    return make_text_model_folder(tmp_path_factory.mktemp("text") / "m")


@pytest.fixture(scope="module")
def offline():
    """weights/tiny-t5-dates loaded in the test's process: what the servers of it (tests/
    serve_process.py) must answer."""
    import minfer
    return minfer.load(ROOT / "weights" / "tiny-t5-dates")


@pytest.fixture(scope="session")
def beam_model_folder(tmp_path_factory):
    """A random text model whose generation_config.json decodes with 4 beams by default (the
    server's per-request sequence cap must count beams the request did not ask for)."""
    import json
    folder = make_text_model_folder(tmp_path_factory.mktemp("beams") / "m", seed=7)
    (folder / "generation_config.json").write_text(json.dumps(
        {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "num_beams": 4,
         "max_new_tokens": 4}))
    return folder


@pytest.fixture(scope="session")
def text_model(text_model_folder):
    import minfer
    return minfer.load(text_model_folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """factories.SHAPE's random T5 (module scope: tests that stream or convert it)."""
    from factories import SHAPE, write_t5
    return write_t5(tmp_path_factory.mktemp("t5") / "m", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def reference(folder):
    """That model's unlimited float32 forward logits and 12-token greedy ids."""
    import minfer
    from factories import DEC, IDS
    m = minfer.load(folder)
    return m.forward(IDS, DEC), m.generate(IDS, max_new_tokens=12, min_new_tokens=12)


@pytest.fixture
def strict_cuda(monkeypatch):
    """minfer.cuda imported over tests/strict_cupy.py (a strict CuPy stand-in over NumPy, two
    devices): `minfer.load(..., device="cuda")` then runs the CUDA path's code on the CPU. Yields
    the stand-in module (its STATE counts syncs, launches, allocations outside the arena)."""
    import importlib
    import sys

    import strict_cupy

    import minfer
    strict_cupy.reset()
    monkeypatch.setitem(sys.modules, "cupy", strict_cupy)
    monkeypatch.delitem(sys.modules, "minfer.cuda", raising=False)
    monkeypatch.delattr(minfer, "cuda", raising=False)
    importlib.import_module("minfer.cuda")
    yield strict_cupy


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray cluster for a module's pipeline tests (skipped without ray). Two CPUs for two
    actors and one for the read tasks: an actor pool holds its CPUs for the whole run, and with
    none left read_json's tasks never start (the pipeline waits forever)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _node_ip_address="127.0.0.1")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
