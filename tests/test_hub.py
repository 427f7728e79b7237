"""hub.resolve_model against a fake cache built in huggingface_hub's own layout; never the network.

Layout (huggingface_hub's file_download.py and _snapshot_download.py;
https://huggingface.co/docs/hub/local-cache):
<cache>/models--ORG--NAME/blobs/<hash>             file contents
<cache>/models--ORG--NAME/snapshots/<commit>/<f>   symlinks into ../../blobs
<cache>/models--ORG--NAME/refs/<revision>          the commit hash, no newline; the revision
                                                   "refs/pr/2" is stored at refs/refs/pr/2
"""

import hashlib
import json
import os
import socket
import sys

import numpy as np
import pytest
from safetensors.numpy import save

hf = pytest.importorskip("huggingface_hub")
from huggingface_hub import errors as hf_errors  # noqa: E402
from huggingface_hub.utils import are_progress_bars_disabled, filter_repo_objects  # noqa: E402

from minfer import hub  # noqa: E402
from minfer.errors import ConfigError, ModelNotFoundError  # noqa: E402

T5_MAIN = "df1b051c49625cf57a3d0d8d3863ed4d13564fe4"
T5_OLD = "0123456789abcdef0123456789abcdef01234567"
XL_MAIN = "40a186da79458c9f9de846edfaea79c412137f97"
XL_PR2 = "6b3f8a6c7e4a3e5bd1b0f4e9a8d8c2b1a0f9e8d7"


def weights() -> bytes:
    return save({"shared.weight": np.arange(12, dtype=np.float32).reshape(3, 4)})


def add_snapshot(cache, repo_id: str, commit: str, files: dict, refs=()) -> os.PathLike:
    """One commit of `repo_id` in the cache: blobs + relative symlinks, as the hub writes them."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        data = data if isinstance(data, bytes) else json.dumps(data).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        ref_file = repo / "refs" / ref  # "refs/pr/2" -> refs/refs/pr/2, as the hub joins them
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    return snapshot


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """Offline everywhere, sockets refused, no real cache or token, a scratch working directory."""
    def refuse(*args, **kwargs):
        raise OSError("network access in a test")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf.constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "hub"
    t5 = {"config.json": {"model_type": "t5", "d_model": 4}, "model.safetensors": weights(),
          "tokenizer_config.json": {"model_max_length": 512}}
    add_snapshot(root, "google-t5/t5-small", T5_MAIN, t5, refs=["main"])
    add_snapshot(root, "google-t5/t5-small", T5_OLD, t5)  # detached: reachable by hash only
    xl_config = {"model_type": "transfo-xl", "d_model": 4}
    add_snapshot(root, "transfo-xl/transfo-xl-wt103", XL_MAIN,
                 {"config.json": xl_config, "pytorch_model.bin": b"not really a pickle"},
                 refs=["main"])
    add_snapshot(root, "transfo-xl/transfo-xl-wt103", XL_PR2,
                 {"config.json": xl_config, "model.safetensors": weights(), "vocab.pkl": b"x"},
                 refs=["refs/pr/2"])
    return root


def snapshot_of(cache, repo_id, commit):
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit


def assert_one_line(err):
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text and "Error:" not in text, text
    # no chained hub exception would print under it
    assert err.value.__cause__ is None
    assert err.value.__context__ is None or err.value.__suppress_context__


# -- local folders ---------------------------------------------------------------------------------
def test_existing_folder_is_returned_as_is(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert hub.resolve_model(folder) == folder
    assert hub.resolve_model(str(folder)) == folder
    assert hub.resolve_model("my-model") == folder.relative_to(tmp_path)  # relative, as given


@pytest.mark.parametrize("name", ["./missing", "~/definitely-not-here-minfer", "/no/such/model",
                                  "weights/missing"])
def test_missing_path_like_folder_is_an_error(tmp_path, name):
    (tmp_path / "weights").mkdir()  # "weights/missing" reads as a path because weights/ exists
    with pytest.raises(ModelNotFoundError, match="no such folder") as err:
        hub.resolve_model(name, offline=True)
    assert_one_line(err)


def test_path_object_is_never_a_repo_id(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        hub.resolve_model(tmp_path / "google-t5" / "t5-small")


def test_file_is_not_a_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(weights())
    with pytest.raises(ModelNotFoundError, match="is a file, not a model folder"):
        hub.resolve_model("./model.safetensors")


# -- the cache -------------------------------------------------------------------------------------
def test_alias_resolves_offline_to_the_cached_snapshot(cache):
    folder = hub.resolve_model("t5-small", cache_dir=str(cache), offline=True)
    assert folder == snapshot_of(cache, "google-t5/t5-small", T5_MAIN)
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert (folder / name).is_file()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "t5"


def test_full_name_and_commit_hash(cache):
    assert (hub.resolve_model("google-t5/t5-small", cache_dir=cache, offline=True)
            == snapshot_of(cache, "google-t5/t5-small", T5_MAIN))
    assert (hub.resolve_model("t5-small", revision=T5_OLD, cache_dir=cache, offline=True)
            == snapshot_of(cache, "google-t5/t5-small", T5_OLD))


def test_transfo_xl_defaults_to_its_safetensors_pr(cache):
    expected = snapshot_of(cache, "transfo-xl/transfo-xl-wt103", XL_PR2)
    assert hub.resolve_model("transfo-xl-wt103", cache_dir=cache, offline=True) == expected
    assert hub.resolve_model("transfo-xl/transfo-xl-wt103", cache_dir=cache,
                             offline=True) == expected


def test_revision_without_safetensors_is_a_clear_error(cache):
    with pytest.raises(ModelNotFoundError, match="no safetensors weights at revision 'main'") as e:
        hub.resolve_model("transfo-xl-wt103", revision="main", cache_dir=cache, offline=True)
    assert "refs/pr/2" in str(e.value)
    assert_one_line(e)
    # ... unless the legacy .bin is explicitly allowed
    assert (hub.resolve_model("transfo-xl-wt103", revision="main", cache_dir=cache, offline=True,
                              include_bin=True)
            == snapshot_of(cache, "transfo-xl/transfo-xl-wt103", XL_MAIN))


def test_cached_repo_lacking_weights(cache):
    add_snapshot(cache, "org/no-weights", T5_MAIN, {"config.json": {}}, refs=["main"])
    with pytest.raises(ModelNotFoundError, match="'org/no-weights' has no safetensors") as err:
        hub.resolve_model("org/no-weights", cache_dir=cache, offline=True)
    assert_one_line(err)


def test_default_cache_comes_from_huggingface_hub(cache, monkeypatch):
    monkeypatch.setattr(hf.constants, "HF_HUB_CACHE", str(cache))  # what HF_HOME/HF_HUB_CACHE set
    assert hub.resolve_model("t5-small", offline=True) == snapshot_of(cache, "google-t5/t5-small",
                                                                      T5_MAIN)


# -- errors ----------------------------------------------------------------------------------------
def test_not_cached_offline_says_what_to_do(cache):
    with pytest.raises(ModelNotFoundError) as err:
        hub.resolve_model("t5-base", cache_dir=cache, offline=True)
    message = str(err.value)
    assert message.startswith("model 't5-base' (google-t5/t5-base) is not in the local cache")
    assert "offline mode is on" in message and "connect once" in message
    assert "local folder" in message and str(cache) in message
    assert_one_line(err)


def test_uncached_revision_offline_names_it(cache):
    with pytest.raises(ModelNotFoundError, match="at revision 'v9' is not in the local cache"):
        hub.resolve_model("t5-small", revision="v9", cache_dir=cache, offline=True)


@pytest.mark.parametrize("name", ["a/b/c", "-bad", "bad-", "a--b", "x..y", "name.git", "has space",
                                  "t5-small/", "ünï/cödé", "", "   "])
def test_bad_repo_id_is_a_config_error(cache, name):
    with pytest.raises(ConfigError) as err:
        hub.resolve_model(name, cache_dir=cache, offline=True)
    assert_one_line(err)


def test_bad_revision_and_name_types(cache):
    with pytest.raises(ConfigError):
        hub.resolve_model("t5-small", revision="", cache_dir=cache, offline=True)
    with pytest.raises(ConfigError):
        hub.resolve_model(42)


def test_hf_hub_offline_env_is_respected(cache, monkeypatch):
    # The hub read HF_HUB_OFFLINE at import (constants); a value set later must still count.
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = {}
    real = hf.snapshot_download

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(hf, "snapshot_download", spy)
    expected = snapshot_of(cache, "google-t5/t5-small", T5_MAIN)
    assert hub.resolve_model("t5-small", cache_dir=cache) == expected
    assert seen["local_files_only"] is True
    with pytest.raises(ModelNotFoundError, match="offline mode is on"):
        hub.resolve_model("t5-large", cache_dir=cache)


@pytest.mark.parametrize("error, expected", [
    (hf_errors.RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found"),
     "no hub repo 'org/name' (check the name, or set HF_TOKEN"),
    (hf_errors.GatedRepoError("403 Client Error.\n\nCannot access gated repo"),
     "hub repo 'org/name' is gated"),
    (hf_errors.RevisionNotFoundError("404 Client Error.\n\nRevision Not Found"),
     "revision 'x' not found in org/name"),
    (hf_errors.LocalEntryNotFoundError("An error happened while trying to locate the files\nmore"),
     "the hub could not be reached"),
    (OSError(28, "No space left on device"), "No space left on device"),
])
def test_hub_errors_become_one_line(cache, monkeypatch, error, expected):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(hf, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError) as err:
        hub.resolve_model("org/name", revision="x", cache_dir=cache, offline=False)
    assert expected in str(err.value)
    assert_one_line(err)


def test_missing_huggingface_hub_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(ModelNotFoundError, match="pip install huggingface_hub"):
        hub.resolve_model("t5-small", offline=True)


# -- what is fetched, and how ----------------------------------------------------------------------
def test_allow_patterns_fetch_only_what_minfer_reads():
    repo_files = [
        "README.md", ".gitattributes", "config.json", "generation_config.json", "model.safetensors",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "pytorch_model.bin", "tf_model.h5",
        "flax_model.msgpack",
        "rust_model.ot", "spiece.model", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "vocab.pkl", "vocab.bin", "onnx/config.json",
        "onnx/model.safetensors", "onnx/decoder_model.onnx", "onnx/tokenizer.json",
        "model-x/y-of-z.safetensors", "model-00001-of-00002.safetensors/extra",
    ]
    wanted = {"config.json", "generation_config.json", "model.safetensors",
              "model.safetensors.index.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "spiece.model", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "vocab.pkl", "vocab.bin"}
    kept = set(filter_repo_objects(repo_files, allow_patterns=hub.allow_patterns()))
    assert kept == wanted
    kept = set(filter_repo_objects(repo_files, allow_patterns=hub.allow_patterns(include_bin=True)))
    assert kept == wanted | {"pytorch_model.bin"}


@pytest.mark.skipif(hf.constants.HF_HUB_DISABLE_PROGRESS_BARS is not None,
                    reason="HF_HUB_DISABLE_PROGRESS_BARS is set and overrides minfer")
@pytest.mark.parametrize("tty, progress, hidden", [
    (False, None, True), (True, None, False), (True, False, True), (False, True, False)])
def test_progress_bars_only_on_a_terminal(cache, monkeypatch, tty, progress, hidden):
    class Stderr:
        def isatty(self):
            return tty

        def write(self, text):
            return len(text)

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Stderr())
    seen = []
    real = hf.snapshot_download

    def spy(*args, **kwargs):
        seen.append(are_progress_bars_disabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(hf, "snapshot_download", spy)
    assert not are_progress_bars_disabled()
    hub.resolve_model("t5-small", cache_dir=cache, offline=True, progress=progress)
    assert seen == [hidden]
    assert not are_progress_bars_disabled()  # the previous state is back


def test_hub_offline_flag_wins_over_offline_false(cache, monkeypatch, request):
    # HF_HUB_OFFLINE read by the hub at import refuses every request, even when offline=False:
    # cached models still resolve, missing ones say offline mode is the reason.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hf.constants.HF_HUB_OFFLINE
    # The hub caches one HTTP session per thread, built with the offline flag of its time.
    hf.utils.reset_sessions()
    request.addfinalizer(hf.utils.reset_sessions)
    assert (hub.resolve_model("t5-small", cache_dir=cache, offline=False)
            == snapshot_of(cache, "google-t5/t5-small", T5_MAIN))
    with pytest.raises(ModelNotFoundError, match="offline mode is on") as err:
        hub.resolve_model("t5-large", cache_dir=cache, offline=False)
    assert_one_line(err)
