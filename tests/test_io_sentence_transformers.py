"""sentence-transformers folders (io/sentence_transformers.py) and the embedding math
(embedding.py): what is read, and the one-line errors for bad folders."""
import json
import pickle
import shutil

import numpy as np
import pytest
from conftest import ROOT
from safetensors.numpy import save_file

import minfer
from minfer import embedding
from minfer.errors import CheckpointError
from minfer.io.sentence_transformers import kind_of, read_sentence_modules

FIXTURE = ROOT / "weights" / "family" / "st_sentence_t5"


@pytest.fixture
def st_folder(tmp_path):
    """A copy of the sentence-t5-shaped fixture, to break."""
    return shutil.copytree(FIXTURE, tmp_path / "st")


def modules(folder):
    return json.loads((folder / "modules.json").read_text())


def write_modules(folder, entries):
    (folder / "modules.json").write_text(json.dumps(entries))


@pytest.mark.parametrize("name, kind", [
    ("sentence_transformers.models.Transformer", "Transformer"),
    ("sentence_transformers.models.Pooling.Pooling", "Pooling"),
    ("sentence_transformers.models.Dense", "Dense"),
    ("sentence_transformers.models.Normalize.Normalize", "Normalize")])
def test_type_names_in_both_forms(name, kind):
    assert kind_of(name, "x") == kind


@pytest.mark.parametrize("name", ["my_package.Pooling", "sentence_transformers.models.CNN",
                                  "Dense", None, "sentence_transformers.models.WordEmbeddings"])
def test_unknown_module_types_are_refused_by_name(name):
    with pytest.raises(CheckpointError, match="is not one minfer runs"):
        kind_of(name, "modules.json: module 2")


def test_a_folder_without_modules_json_has_no_head(tmp_path):
    assert read_sentence_modules(tmp_path) is None


@pytest.mark.parametrize("path", ["../elsewhere", "/etc", "1_Pooling/../../x"])
def test_module_paths_that_leave_the_folder_are_refused(st_folder, path):
    entries = modules(st_folder)
    entries[1]["path"] = path
    write_modules(st_folder, entries)
    with pytest.raises(CheckpointError, match=r"modules.json: module 1: 'path' .* leaves the model folder"):
        read_sentence_modules(st_folder)


def test_a_symlink_out_of_the_folder_is_refused(st_folder, tmp_path):
    (tmp_path / "outside").mkdir()
    (st_folder / "9_Link").symlink_to(tmp_path / "outside")
    entries = modules(st_folder)
    entries[1]["path"] = "9_Link"
    write_modules(st_folder, entries)
    with pytest.raises(CheckpointError, match="leaves the model folder"):
        read_sentence_modules(st_folder)


def one_line(error, limit=400):
    """The message of a raised error: one line, a few hundred characters at most."""
    text = str(error.value)
    assert "\n" not in text and len(text) <= limit, (len(text), text[:500])
    return text


def set_path(folder, module, path):
    entries = modules(folder)
    entries[module]["path"] = path
    write_modules(folder, entries)


def link_loop(folder):
    (folder / "loop_a").symlink_to("loop_b")
    (folder / "loop_b").symlink_to("loop_a")
    return "loop_a"


@pytest.mark.parametrize("module", [0, 1, 2])
@pytest.mark.parametrize("path, match", [
    (link_loop, r"'path' 'loop_a' cannot be followed: a loop of symbolic links"),
    ("1_Pooling\x00x", r"'path' '1_Pooling\\x00x' holds a NUL character"),
    ("x" * 5000, r"'path' 'x{120}\.\.\.' is 5000 characters long, more than the 255"),
    ("/".join(["y" * 250] * 20), r"'path' 'y{120}\.\.\.' is 5019 characters long")],
    ids=["link-loop", "nul", "long-name", "long-components"])
def test_module_paths_the_os_cannot_follow_are_one_line_errors(st_folder, module, path, match):
    """A link loop, a NUL or an overlong name in a module's path: the OS's raw RuntimeError,
    ValueError or OSError (with the whole path) before; one bounded CheckpointError now."""
    set_path(st_folder, module, path(st_folder) if callable(path) else path)
    with pytest.raises(CheckpointError, match=rf"modules.json: module {module}: {match}") as e:
        read_sentence_modules(st_folder)
    one_line(e)


def test_a_link_loop_inside_a_module_path(st_folder):
    (st_folder / "self").symlink_to("self")
    set_path(st_folder, 1, "self/1_Pooling")
    with pytest.raises(CheckpointError, match="cannot be followed") as e:
        read_sentence_modules(st_folder)
    one_line(e)


@pytest.mark.parametrize("count", [30_000, 65])
def test_the_number_of_modules_is_bounded(st_folder, count):
    """30,000 modules gave a 390,000-character error listing every one; now a short line, from
    the file's size or the module count, before any module is followed."""
    entries = modules(st_folder)
    write_modules(st_folder, entries[:2] + [{"type": "sentence_transformers.models.Pooling",
                                             "path": "1_Pooling"}] * (count - 2))
    with pytest.raises(CheckpointError, match="larger than the 1048576-byte limit|65 modules, "
                                              "more than the 64") as e:
        read_sentence_modules(st_folder)
    one_line(e)


def test_a_module_out_of_order_is_named(st_folder):
    entries = modules(st_folder)
    write_modules(st_folder, entries[:3] + [entries[3]] * 40 + [entries[1]])
    with pytest.raises(CheckpointError, match=r"module 43: a Pooling module here; modules must be "
                                              r"a Transformer, a Pooling") as e:
        read_sentence_modules(st_folder)
    one_line(e)
    write_modules(st_folder, entries[:1])
    with pytest.raises(CheckpointError, match="only a Transformer module"):
        read_sentence_modules(st_folder)


# (file, its JSON, what the error says): wrong JSON types and huge values in each file a folder
# gives minfer; each was a raw TypeError, a message as long as the value, or accepted
BAD_SETTINGS = [
    ("modules.json", [list(range(100_000))], r"module 0: expected an object .*, got a JSON list "
                                             r"of 100000 items"),
    ("modules.json", {"modules": []}, r"expected a non-empty JSON list of modules, got a JSON "
                                      r"object of 1 item$"),
    ("1_Pooling/config.json", {"word_embedding_dimension": 10 ** 4000,
                               "pooling_mode_mean_tokens": True},
     r"'word_embedding_dimension' must be a positive integer \(at most 2147483647\), got a "
     r"13288-bit integer"),
    ("1_Pooling/config.json", {"word_embedding_dimension": 16, "pooling_mode_mean_tokens": True,
                               "include_prompt": list(range(100_000))},
     r"'include_prompt' must be true or false, got a JSON list of 100000 items"),
    ("2_Dense/config.json", {"in_features": 16, "out_features": 20,
                             "activation_function": ["torch.nn.modules.activation.Tanh"]},
     r"'activation_function' a JSON list of 1 item is not one of the torch activations"),
    ("2_Dense/config.json", {"in_features": 16, "out_features": 10 ** 4000},
     r"'out_features' must be a positive integer .*, got a 13288-bit integer"),
    ("2_Dense/config.json", [16, 20], r"expected a JSON object, got a JSON list of 2 items"),
    ("sentence_bert_config.json", {"do_lower_case": list(range(100_000))},
     r"'do_lower_case' must be true or false, got a JSON list of 100000 items"),
    ("sentence_bert_config.json", {"max_seq_length": 10 ** 4000},
     r"'max_seq_length' must be an integer 1\.\.1048576, got a 13288-bit integer"),
    ("config_sentence_transformers.json", {"prompts": {"q": "q: "}, "default_prompt_name": ["q"]},
     r"'default_prompt_name' a JSON list of 1 item is not one of its prompts \('q'\)"),
    ("config_sentence_transformers.json", {"prompts": {f"p{i}": "x" for i in range(50_000)},
                                           "default_prompt_name": "doc"},
     r"'default_prompt_name' 'doc' is not one of its prompts \('p0', .*'p7', \.\.\. "
     r"\(49992 more\)\)"),
    ("config_sentence_transformers.json", {"prompts": 0},
     r"'prompts' must map names to prompt strings, got 0"),
    ("config_sentence_transformers.json", {"prompts": {"q": {"text": "q: "}}},
     r"'prompts' must map names to prompt strings: 'q' maps to a JSON object of 1 item"),
    ("config_sentence_transformers.json", {"prompts": {"q": "x" * 20_000}},
     r"prompt 'q' is 20000 characters long, more than the 16384"),
    ("config_sentence_transformers.json", {"prompts": {"q": "x" * 2_000_000}},
     r"bytes is larger than the 1048576-byte limit"),
    ("config_sentence_transformers.json", "[" * 500 + "]" * 500,
     r"JSON nested deeper than 100 levels"),
]


@pytest.mark.parametrize("name, content, match", BAD_SETTINGS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_SETTINGS)])
def test_bad_settings_are_one_bounded_line(st_folder, name, content, match):
    path = st_folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CheckpointError, match=match) as e:
        read_sentence_modules(st_folder)
    assert one_line(e).startswith(str(path))


@pytest.mark.parametrize("name", ["modules.json", "sentence_bert_config.json",
                                  "1_Pooling/config.json", "2_Dense/config.json"])
@pytest.mark.parametrize("make", ["folder", "loop"])
def test_a_settings_file_that_is_not_a_file_is_named(st_folder, name, make):
    """A settings file that is a folder or a looping link: not taken for absent (modules.json
    loaded a plain T5 without its head, sentence_bert_config.json was ignored) nor called
    missing."""
    path = st_folder / name
    path.unlink()
    if make == "folder":
        path.mkdir()
    else:
        path.symlink_to(path.name)
    with pytest.raises(CheckpointError, match=f"{name}: not a readable file") as e:
        read_sentence_modules(st_folder)
    one_line(e)


def test_unknown_module_type_in_a_folder_names_file_and_module(st_folder):
    entries = modules(st_folder)
    entries[2]["type"] = "custom_code.Projection"
    write_modules(st_folder, entries)
    with pytest.raises(CheckpointError, match=r"modules.json: module 2: module type 'custom_code"):
        minfer.load(st_folder)


def test_module_order_is_checked(st_folder):
    entries = modules(st_folder)
    write_modules(st_folder, [entries[1], entries[0]])
    with pytest.raises(CheckpointError, match="must be a Transformer, a Pooling"):
        read_sentence_modules(st_folder)


def test_dense_shape_mismatch(st_folder):
    dense = st_folder / "2_Dense"
    (dense / "pytorch_model.bin").unlink()
    save_file({"linear.weight": np.zeros((20, 15), np.float32)}, str(dense / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"2_Dense/model.safetensors: tensor 'linear.weight' "
                                              r"has shape \[20, 15\], config.json implies \[20, 16\]"):
        read_sentence_modules(st_folder)


def test_dense_in_features_must_fit_the_pooling(st_folder):
    cfg = json.loads((st_folder / "2_Dense" / "config.json").read_text())
    cfg["in_features"] = 32
    (st_folder / "2_Dense" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'in_features' 32 does not fit the 16 features"):
        read_sentence_modules(st_folder)


@pytest.mark.parametrize("field, value, match", [
    ("activation_function", "os.system", "'activation_function' 'os.system' is not one of"),
    ("bias", "yes", "'bias' must be true or false"),
    ("out_features", 0, "'out_features' must be a positive integer")])
def test_dense_config_fields_are_checked(st_folder, field, value, match):
    path = st_folder / "2_Dense" / "config.json"
    cfg = json.loads(path.read_text())
    cfg[field] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        read_sentence_modules(st_folder)


def test_dense_pickle_never_runs_code(st_folder, tmp_path):
    """A pytorch_model.bin that would run a command when unpickled is refused, and nothing runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (shutil.copy, (str(st_folder / "modules.json"), str(marker)))
    (st_folder / "2_Dense" / "pytorch_model.bin").write_bytes(pickle.dumps({"linear.weight": Evil()}))
    with pytest.raises(CheckpointError):
        read_sentence_modules(st_folder)
    assert not marker.exists()


@pytest.mark.parametrize("cfg, match", [
    ({"word_embedding_dimension": 16}, "no pooling mode is switched on"),
    ({"word_embedding_dimension": 16, "pooling_mode_mean_tokens": 1}, "must be true or false"),
    ({"word_embedding_dimension": "16", "pooling_mode_mean_tokens": True},
     "'word_embedding_dimension' must be a positive integer")])
def test_pooling_config_is_checked(st_folder, cfg, match):
    (st_folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        read_sentence_modules(st_folder)


def test_pooling_width_must_be_the_encoders(st_folder):
    path = st_folder / "1_Pooling" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["word_embedding_dimension"] = 8
    path.write_text(json.dumps(cfg))
    cfg2 = json.loads((st_folder / "2_Dense" / "config.json").read_text())
    cfg2["in_features"] = 8
    (st_folder / "2_Dense" / "config.json").write_text(json.dumps(cfg2))
    with pytest.raises(CheckpointError):   # the Dense weights are (20, 16): refused first
        minfer.load(st_folder)


def test_bad_prompts_and_max_seq_length(st_folder):
    (st_folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"q": "q: "}, "default_prompt_name": "doc"}))
    with pytest.raises(CheckpointError, match="'default_prompt_name' 'doc' is not one of its prompts"):
        read_sentence_modules(st_folder)
    (st_folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": ["q"]}))
    with pytest.raises(CheckpointError, match="'prompts' must map names"):
        read_sentence_modules(st_folder)
    (st_folder / "config_sentence_transformers.json").unlink()
    (st_folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": -1}))
    with pytest.raises(CheckpointError, match="'max_seq_length' must be an integer"):
        read_sentence_modules(st_folder)


# -- the math ------------------------------------------------------------------------------------
def test_poolings_over_the_real_tokens():
    rng = np.random.default_rng(0)
    states = rng.standard_normal((2, 4, 3)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    got = embedding.pool(states, mask, ("cls_token", "max_tokens", "mean_tokens",
                                        "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken"))
    assert got.shape == (2, 18)
    row = states[1, :2]
    want = np.concatenate([row[0], row.max(0), row.mean(0), row.sum(0) / np.sqrt(2),
                           (row * np.array([[1], [2]])).sum(0) / 3, row[1]])
    assert np.allclose(got[1], want, atol=1e-6)
    assert np.allclose(got[0, 6:9], states[0].mean(0), atol=1e-6)


def test_normalize_and_dense():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    assert np.allclose(embedding.normalize(x), [[0.6, 0.8], [0, 0]])
    from minfer.io.sentence_transformers import Dense
    layer = Dense(np.array([[1.0, 0.0], [0.0, -1.0]], np.float32), np.array([0.5, 0.0], np.float32),
                  "relu", ROOT)
    assert np.allclose(embedding.dense(x, layer), [[3.5, 0.0], [0.5, 0.0]])


def test_token_counts_are_the_tokens_embed_encodes(monkeypatch):
    """embedding.token_counts (a server's usage): the default prompt's tokens included, cut at
    max_seq_length as embed cuts them; equal to the ids embed hands the encoder."""
    model = minfer.load(ROOT / "weights" / "family" / "st_prompts")
    texts = ["short", "a much longer text " * 40]
    seen = []
    real = type(model).encode

    def encode(self, ids, mask, **options):
        seen.extend(int(n) for n in np.asarray(mask).sum(axis=1))
        return real(self, ids, mask, **options)
    monkeypatch.setattr(type(model), "encode", encode)
    for kwargs in ({}, {"prompt_name": "passage"}, {"prompt": "x y z "}):
        seen.clear()
        model.embed(texts, **kwargs)
        counts = embedding.token_counts(model, texts, **kwargs)
        assert sorted(counts) == sorted(seen)
    limit = model.sentence_modules.max_seq_length
    assert counts[1] == limit and counts[0] == len(model.tokenizer.encode("x y z short"))
