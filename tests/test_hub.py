"""hub.resolve_model against a fake cache built in huggingface_hub's own layout; never the network.

Network failures are raised by the hub's own HTTP client (requests below 1.0, httpx in 1.x, httpx2
from 2.0) under a fake of the hub's API. tests/hub_versions.sh runs this file against several hub
releases, each in a throwaway venv.

Layout (huggingface_hub's file_download.py and _snapshot_download.py;
https://huggingface.co/docs/hub/local-cache):
<cache>/models--ORG--NAME/blobs/<hash>             file contents
<cache>/models--ORG--NAME/snapshots/<commit>/<f>   symlinks into ../../blobs
<cache>/models--ORG--NAME/refs/<revision>          the commit hash, no newline; the revision
                                                   "refs/pr/2" is stored at refs/refs/pr/2
"""

import hashlib
import http.client
import importlib
import json
import os
import socket
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save

hf = pytest.importorskip("huggingface_hub")
from huggingface_hub import errors as hf_errors  # noqa: E402
from huggingface_hub.utils import are_progress_bars_disabled, filter_repo_objects  # noqa: E402

from minfer import hub  # noqa: E402
from minfer.errors import ConfigError, ModelNotFoundError  # noqa: E402

# The HTTP client the hub runs on, whose errors reach resolve_model: requests below 1.0, httpx in
# 1.x, httpx2 (a fork of httpx keeping its API and exception names) from 2.0.
HUB_MAJOR = int(hf.__version__.split(".")[0])
HTTP = importlib.import_module("requests" if HUB_MAJOR < 1 else "httpx" if HUB_MAJOR == 1
                               else "httpx2")
on_requests = pytest.mark.skipif(HUB_MAJOR >= 1, reason=f"huggingface_hub {hf.__version__} runs "
                                 "on httpx: the httpx tests cover it")
on_httpx = pytest.mark.skipif(HUB_MAJOR < 1, reason=f"huggingface_hub {hf.__version__} runs on "
                              "requests: the requests tests cover it")

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


def http_response(status: int):
    """A response of the hub's HTTP client, as its HTTP errors carry one (required from 1.0)."""
    url = "https://huggingface.co/api/models/org/name/revision/x"
    if HUB_MAJOR < 1:
        response = HTTP.Response()
        response.status_code, response.url = status, url
        return response
    return HTTP.Response(status, request=HTTP.Request("GET", url))


def http_error(cls, message: str, status: int):
    return lambda: cls(message, response=http_response(status))


@pytest.mark.parametrize("make_error, expected", [
    (http_error(hf_errors.RepositoryNotFoundError, "404 Client Error.\n\nRepository Not Found",
                404),
     "no hub repo 'org/name' (check the name, or set HF_TOKEN"),
    (http_error(hf_errors.GatedRepoError, "403 Client Error.\n\nCannot access gated repo", 403),
     "hub repo 'org/name' is gated"),
    (http_error(hf_errors.RevisionNotFoundError, "404 Client Error.\n\nRevision Not Found", 404),
     "revision 'x' not found in org/name"),
    (http_error(hf_errors.HfHubHTTPError, "401 Client Error: Unauthorized for url", 401),
     "the hub refused access to 'org/name' (HTTP 401): set HF_TOKEN"),
    (http_error(hf_errors.HfHubHTTPError, "Internal Server Error for url: https://hf.co/api", 500),
     "cannot fetch model 'org/name' at revision 'x' from the hub (HTTP 500)"),
    (lambda: hf_errors.LocalEntryNotFoundError("An error happened while trying to locate the "
                                               "files\nmore"),
     "the hub could not be reached"),
    (lambda: chained(hf_errors.LocalEntryNotFoundError("An error happened"),
                     http_error(hf_errors.HfHubHTTPError, "Service Unavailable", 503)()),
     "not in the local cache ({cache}) and the hub could not be reached (HTTP 503): connect once"),
    (lambda: OSError(28, "No space left on device"), "No space left on device"),
], ids=["not-found", "gated", "revision", "unauthorized", "server-error", "local-entry",
        "local-entry-hub-down", "disk"])
def test_hub_errors_become_one_line(cache, monkeypatch, make_error, expected):
    error = make_error()

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(hf, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError) as err:
        hub.resolve_model("org/name", revision="x", cache_dir=cache, offline=False)
    assert expected.format(cache=cache) in str(err.value)
    assert_one_line(err)


def chained(error, cause):
    error.__cause__ = cause  # as `raise error from cause` leaves them
    return error


@pytest.mark.skipif(not hasattr(hf_errors, "IncompleteSnapshotError"),
                    reason=f"huggingface_hub {hf.__version__} has no IncompleteSnapshotError")
def test_partly_cached_snapshot_says_so(cache, monkeypatch):
    def fail(*args, **kwargs):
        raise hf_errors.IncompleteSnapshotError("The cached snapshot for 'org/name' is incomplete",
                                                snapshot_path=str(cache))
    monkeypatch.setattr(hf, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError, match=r"model 'org/name' is only partly in the local "
                       r"cache \(.*\) and offline mode is on: connect once to finish the "
                       "download") as err:
        hub.resolve_model("org/name", cache_dir=cache, offline=True)
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
        "special_tokens_map.json", "vocab.pkl", "vocab.bin", "merges.txt", "added_tokens.json",
        "onnx/config.json", "onnx/merges.txt",
        "onnx/model.safetensors", "onnx/decoder_model.onnx", "onnx/tokenizer.json",
        "model-x/y-of-z.safetensors", "model-00001-of-00002.safetensors/extra",
    ]
    wanted = {"config.json", "generation_config.json", "model.safetensors",
              "model.safetensors.index.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "spiece.model", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "vocab.pkl", "vocab.bin",
              "merges.txt", "added_tokens.json"}
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


def drop_http_sessions():
    """Make the hub build its HTTP sessions afresh. Below 1.0 it caches one per thread, built with
    the offline flag of its time (reset_sessions); from 1.0 one shared client that reads the flag
    on each request (close_session; reset_sessions is gone)."""
    if HUB_MAJOR < 1:
        hf.utils.reset_sessions()
    else:
        hf.utils.close_session()


@pytest.fixture
def fresh_http_sessions():
    drop_http_sessions()
    yield
    drop_http_sessions()


def test_hub_offline_flag_wins_over_offline_false(cache, monkeypatch, fresh_http_sessions):
    # HF_HUB_OFFLINE read by the hub at import refuses every request, even when offline=False:
    # cached models still resolve, missing ones say offline mode is the reason.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hf.constants.HF_HUB_OFFLINE
    assert (hub.resolve_model("t5-small", cache_dir=cache, offline=False)
            == snapshot_of(cache, "google-t5/t5-small", T5_MAIN))
    with pytest.raises(ModelNotFoundError, match="offline mode is on") as err:
        hub.resolve_model("t5-large", cache_dir=cache, offline=False)
    assert_one_line(err)


# -- network failures, raised by the hub's own HTTP client -----------------------------------------
# The hub's HTTP layer is patched at the client library's transport (requests' HTTPAdapter.send,
# httpx's HTTPTransport.handle_request), below the hub's sessions, retries and error handling: a
# fake of enough of the hub's API for snapshot_download of every version, which fails one request
# the way the real client fails it.
FAKE_COMMIT = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
FAKE_FILES = {"config.json": json.dumps({"model_type": "t5"}).encode(),
              "model.safetensors": weights()}


def fake_hub(failure, stage: str, seen: list):
    """answer(method, url, request) -> (status, headers, body chunks); `failure(request)` replaces
    the answers to the API calls (stage "api") or to the file downloads (stage "download"): it
    raises, or returns body chunks that end in the exception a dropped stream raises."""
    def answer(method, url, request):
        seen.append((method, url))
        path = url.split("huggingface.co", 1)[-1].split("?")[0]
        if (stage == "api" and path.startswith("/api/")) or (
                stage == "download" and method == "GET" and "/resolve/" in path):
            chunks = failure(request)
            if "Range" not in request.headers:
                return 200, {"Content-Length": "12"}, chunks
            return 206, {"Content-Length": "6", "Content-Range": "bytes 6-11/12"}, chunks
        if "/resolve/" in path:
            data = FAKE_FILES[path.rsplit("/", 1)[-1]]
            headers = {"X-Repo-Commit": FAKE_COMMIT, "Content-Length": str(len(data)),
                       "ETag": '"' + hashlib.sha256(data).hexdigest() + '"'}
            return 200, headers, [] if method == "HEAD" else [data]
        if "/tree/" in path:  # list_repo_tree (hub >= 1.x lists the files with it)
            body = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for f, d in FAKE_FILES.items()]
        else:  # model info at a revision
            body = {"id": "org/name", "sha": FAKE_COMMIT,
                    "siblings": [{"rfilename": f} for f in FAKE_FILES]}
        return 200, {"Content-Type": "application/json"}, [json.dumps(body).encode()]
    return answer


@pytest.fixture
def online(monkeypatch, fresh_http_sessions):
    """Offline mode off (the sockets stay refused) and no waiting between the hub's retries."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)


def serve_with_requests(monkeypatch, answer):
    import requests
    from requests.structures import CaseInsensitiveDict

    class Raw:  # urllib3's HTTPResponse, as far as requests reads it
        def __init__(self, chunks):
            self.chunks = chunks

        def stream(self, chunk_size, decode_content=True):
            for chunk in self.chunks:
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk

    def send(adapter, request, **kwargs):
        status, headers, chunks = answer(request.method, request.url, request)
        response = requests.Response()
        response.status_code, response.url, response.request = status, request.url, request
        response.headers, response.raw = CaseInsensitiveDict(headers), Raw(chunks)
        return response
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", send)


def serve_with_httpx(monkeypatch, answer):
    class Stream(HTTP.SyncByteStream):
        def __init__(self, chunks):
            self.chunks = chunks

        def __iter__(self):
            for chunk in self.chunks:
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk

    def handle_request(transport, request):
        status, headers, chunks = answer(request.method, str(request.url), request)
        return HTTP.Response(status, headers=headers, stream=Stream(chunks), request=request)
    monkeypatch.setattr(HTTP.HTTPTransport, "handle_request", handle_request)


def resolve_failing(monkeypatch, serve, failure, stage, cache) -> str:
    """The one-line error of resolving an uncached model while the fake hub fails."""
    seen = []
    serve(monkeypatch, fake_hub(failure, stage, seen))
    with pytest.raises(ModelNotFoundError) as err:
        hub.resolve_model("org/name", cache_dir=cache, offline=False)
    assert seen, "the hub's HTTP layer was never called"
    assert_one_line(err)
    return str(err.value)


def raises(error):
    def fail(request):
        raise error(request)
    return fail


def drops_after(error):
    # A 12-byte body cut short: 6 bytes arrive, then the stream fails. The hub resumes (a Range
    # request) and, as data arrived, starts its retry count afresh: resumed requests get nothing.
    return lambda request: ([] if "Range" in request.headers else [b"{\"mod\""]) + [error(request)]


# httpx (hub >= 1.0). Messages are the ones httpcore gives these failures.
def httpx_refused(request):
    return HTTP.ConnectError("[Errno 111] Connection refused", request=request)


def httpx_timeout(request):
    return HTTP.ReadTimeout("The read operation timed out", request=request)


def httpx_disconnected(request):
    return HTTP.RemoteProtocolError("Server disconnected without sending a response.",
                                    request=request)


def httpx_body_cut(request):
    return HTTP.RemoteProtocolError("peer closed connection without sending complete message "
                                    "body (received 6 bytes, expected 12)", request=request)


def httpx_reset(request):
    return HTTP.ReadError("[Errno 104] Connection reset by peer", request=request)


@on_httpx
@pytest.mark.parametrize("failure, stage, expected", [
    # The hub turns refusals and timeouts of its API calls into LocalEntryNotFoundError ...
    (raises(httpx_refused), "api", "is not in the local cache ({cache}) and the hub could not be "
     "reached (could not connect ([Errno 111] Connection refused)): connect once"),
    (raises(httpx_timeout), "api", "is not in the local cache ({cache}) and the hub could not be "
     "reached (the connection timed out (The read operation timed out))"),
    # ... but lets a dropped connection through, and the failures of the downloads (after the
    # retries it makes).
    (raises(httpx_disconnected), "api", "cannot fetch model 'org/name' from the hub: the "
     "connection was dropped (Server disconnected without sending a response.); check the network"),
    (raises(httpx_timeout), "download", "cannot fetch model 'org/name' from the hub: the "
     "connection timed out (The read operation timed out); check the network and try again "
     "(HF_HUB_DOWNLOAD_TIMEOUT sets the limit in seconds), set HF_HUB_OFFLINE=1"),
    (raises(httpx_refused), "download", "the hub: could not connect ([Errno 111] Connection "
     "refused); check the network"),
    (drops_after(httpx_body_cut), "download", "the hub: the connection was dropped (peer closed "
     "connection without sending complete message body (received 6 bytes, expected 12))"),
    (drops_after(httpx_reset), "download", "the hub: the connection was dropped ([Errno 104] "
     "Connection reset by peer)"),
], ids=["refused", "timeout", "disconnected", "download-timeout", "download-refused",
        "download-cut", "download-reset"])
def test_httpx_failures_become_one_line(cache, monkeypatch, online, failure, stage, expected):
    message = resolve_failing(monkeypatch, serve_with_httpx, failure, stage, cache)
    assert expected.format(cache=cache) in message, message


# requests (hub < 1.0): its adapter wraps urllib3's errors, and iter_content those of the body.
def requests_pool():
    import urllib3
    return urllib3.HTTPSConnectionPool("huggingface.co", 443)


def requests_refused(request):
    import requests
    from urllib3.exceptions import MaxRetryError, NewConnectionError
    reason = NewConnectionError(None, "Failed to establish a new connection: [Errno 111] "
                                      "Connection refused")
    return requests.ConnectionError(MaxRetryError(requests_pool(), request.path_url, reason),
                                    request=request)


def requests_timeout(request):
    import requests
    from urllib3.exceptions import ReadTimeoutError
    return requests.ReadTimeout(ReadTimeoutError(requests_pool(), request.url,
                                                 "Read timed out. (read timeout=10)"),
                                request=request)


def requests_disconnected(request):
    import requests
    from urllib3.exceptions import ProtocolError
    cause = http.client.RemoteDisconnected("Remote end closed connection without response")
    return requests.ConnectionError(ProtocolError("Connection aborted.", cause), request=request)


def requests_body_cut(request):
    from urllib3.exceptions import ProtocolError
    cut = http.client.IncompleteRead(b"{\"mod\"", 6)
    return ProtocolError(f"Connection broken: {cut!r}", cut)  # iter_content: ChunkedEncodingError


def requests_body_timeout(request):
    from urllib3.exceptions import ReadTimeoutError  # iter_content: requests.ConnectionError
    return ReadTimeoutError(requests_pool(), request.url, "Read timed out.")


@on_requests
@pytest.mark.parametrize("failure, stage, expected", [
    # The hub turns connection errors and timeouts of its API calls into LocalEntryNotFoundError
    (raises(requests_refused), "api", "is not in the local cache ({cache}) and the hub could not "
     "be reached (the connection failed (HTTPSConnectionPool(host='huggingface.co', port=443): "
     "Max retries exceeded with url: /api/models/org/name/revision/main"),
    (raises(requests_timeout), "api", "is not in the local cache ({cache}) and the hub could not "
     "be reached (the connection timed out (HTTPSConnectionPool(host='huggingface.co', "
     "port=443): Read timed out. (read timeout=10)))"),
    (raises(requests_disconnected), "api", "the hub could not be reached (the connection failed "
     "(('Connection aborted.', RemoteDisconnected('Remote end closed connection without "
     "response'))))"),
    # ... and lets those of the downloads through, after retrying ConnectionError and ReadTimeout.
    (raises(requests_timeout), "download", "cannot fetch model 'org/name' from the hub: the "
     "connection timed out (HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. "
     "(read timeout=10)); check the network and try again (HF_HUB_DOWNLOAD_TIMEOUT sets the "
     "limit in seconds), set HF_HUB_OFFLINE=1"),
    (raises(requests_refused), "download", "the hub: the connection failed (HTTPSConnectionPool("
     "host='huggingface.co', port=443): Max retries exceeded with url: /org/name/resolve/"),
    (drops_after(requests_body_cut), "download", "the hub: the connection was dropped "
     "(('Connection broken: IncompleteRead(6 bytes read, 6 more expected)', "
     "IncompleteRead(6 bytes read, 6 more expected)))"),
    (drops_after(requests_body_timeout), "download", "the hub: the connection failed "
     "(HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out.)"),
], ids=["refused", "timeout", "disconnected", "download-timeout", "download-refused",
        "download-cut", "download-timeout-in-body"])
def test_requests_failures_become_one_line(cache, monkeypatch, online, failure, stage, expected):
    message = resolve_failing(monkeypatch, serve_with_requests, failure, stage, cache)
    assert expected.format(cache=cache) in message, message


@pytest.mark.parametrize("serve, refused", [
    pytest.param(serve_with_httpx, httpx_refused, marks=on_httpx, id="httpx"),
    pytest.param(serve_with_requests, requests_refused, marks=on_requests, id="requests"),
])
def test_unreachable_hub_falls_back_to_the_cache(cache, monkeypatch, online, serve, refused):
    seen = []
    serve(monkeypatch, fake_hub(raises(refused), "api", seen))
    assert (hub.resolve_model("t5-small", cache_dir=cache, offline=False)
            == snapshot_of(cache, "google-t5/t5-small", T5_MAIN))
    assert seen


@pytest.mark.parametrize("serve", [
    pytest.param(serve_with_httpx, marks=on_httpx, id="httpx"),
    pytest.param(serve_with_requests, marks=on_requests, id="requests"),
])
def test_fake_hub_downloads_when_nothing_fails(tmp_path, monkeypatch, online, serve):
    # The fake answers what every hub version asks: without a failure the download completes.
    seen = []
    serve(monkeypatch, fake_hub(None, "none", seen))
    folder = hub.resolve_model("org/name", cache_dir=tmp_path / "hub", offline=False)
    assert (folder / "model.safetensors").read_bytes() == FAKE_FILES["model.safetensors"]
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "t5"}


# -- subfolders (diffusers repos) and sentence-transformers module folders --------------------------
FLUX = "fedcba9876543210fedcba9876543210fedcba98"


def test_allow_patterns_for_subfolders_and_sentence_modules():
    repo_files = [
        "model_index.json", "text_encoder/config.json", "text_encoder/model.safetensors",
        "text_encoder_2/config.json", "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/model-00001-of-00002.safetensors", "tokenizer_2/spiece.model",
        "tokenizer_2/tokenizer_config.json", "tokenizer_2/special_tokens_map.json",
        "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
        "modules.json", "1_Pooling/config.json", "2_Dense/pytorch_model.bin", "README.md"]
    kept = set(filter_repo_objects(repo_files, allow_patterns=hub.allow_patterns(
        folders=("text_encoder_2", "tokenizer_2"))))
    assert kept == {"text_encoder_2/config.json", "text_encoder_2/model.safetensors.index.json",
                    "text_encoder_2/model-00001-of-00002.safetensors", "tokenizer_2/spiece.model",
                    "tokenizer_2/tokenizer_config.json", "tokenizer_2/special_tokens_map.json"}
    kept = set(filter_repo_objects(repo_files, allow_patterns=hub.allow_patterns()))
    assert kept == {"modules.json", "1_Pooling/config.json", "2_Dense/pytorch_model.bin"}


def diffusers_repo(cache):
    """A Flux-like repo: the T5 encoder in text_encoder_2/, its tokenizer in tokenizer_2/."""
    from conftest import ROOT
    fixture = ROOT / "weights" / "family" / "t5_encoder_sharded"
    files = {"model_index.json": {"_class_name": "FluxPipeline"}, "vae/config.json": {}}
    for path in fixture.iterdir():
        where = "tokenizer_2" if path.name.startswith(("tokenizer", "special", "spiece")) \
            else "text_encoder_2"
        if path.name != "reference.npz":
            files[f"{where}/{path.name}"] = path.read_bytes()
    return add_snapshot(cache, "org/flux-like", FLUX, files, refs=["main"])


def test_a_subfolder_resolves_inside_the_cached_snapshot(cache):
    snapshot = diffusers_repo(cache)
    got = hub.resolve_model("org/flux-like", offline=True, cache_dir=cache,
                            subfolder="text_encoder_2", also=("tokenizer_2",))
    assert got == snapshot / "text_encoder_2"
    with pytest.raises(ModelNotFoundError, match="no safetensors weights in vae/"):
        hub.resolve_model("org/flux-like", offline=True, cache_dir=cache, subfolder="vae")


def test_load_with_subfolder_and_tokenizer_subfolder_from_the_cache(cache):
    import minfer
    from conftest import ROOT, rel_err
    diffusers_repo(cache)
    m = minfer.load("org/flux-like", offline=True, cache_dir=str(cache),
                    subfolder="text_encoder_2", tokenizer_subfolder="tokenizer_2")
    assert m.parts == ("encoder",) and m.tokenizer is not None
    with np.load(ROOT / "weights" / "family" / "t5_encoder_sharded" / "reference.npz") as ref:
        got = m.encode([str(t) for t in ref["texts"]], padding="max_length",
                       max_length=int(ref["padded_length"]), truncation=True,
                       use_attention_mask=False)
        assert rel_err(got, ref["padded_states"]) < 1e-4
    assert m.load_recipe["subfolder"] == "text_encoder_2"
    assert m.load_recipe["tokenizer_subfolder"] == "tokenizer_2"


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/../b", "a b", ".", 5])
def test_subfolders_that_could_leave_the_repo_are_refused(cache, bad):
    with pytest.raises(ConfigError, match="expected a folder inside"):
        hub.resolve_model("t5-small", offline=True, cache_dir=cache, subfolder=bad)
    with pytest.raises(ConfigError, match="tokenizer_subfolder"):
        hub.resolve_model("t5-small", offline=True, cache_dir=cache, also=(bad,))


def test_local_subfolders(tmp_path):
    (tmp_path / "repo" / "text_encoder_2").mkdir(parents=True)
    assert hub.resolve_model(tmp_path / "repo", subfolder="text_encoder_2") == \
        tmp_path / "repo" / "text_encoder_2"
    with pytest.raises(ModelNotFoundError, match="no subfolder 'nope'"):
        hub.resolve_model(tmp_path / "repo", subfolder="nope")


def test_a_sentence_transformers_repo_with_its_encoder_in_a_module_folder(cache):
    snapshot = add_snapshot(cache, "org/st-like", FLUX, {
        "modules.json": [{"idx": 0, "name": "0", "path": "0_Transformer",
                          "type": "sentence_transformers.models.Transformer"}],
        "0_Transformer/config.json": {"model_type": "t5"},
        "0_Transformer/model.safetensors": weights()}, refs=["main"])
    assert hub.resolve_model("org/st-like", offline=True, cache_dir=cache) == snapshot


@pytest.mark.parametrize("name", ["a" * 300, "org/" + "b" * 300, "/tmp/" + "c" * 300 + "/x",
                                  "x/" * 3000])
def test_names_over_the_file_name_limit_are_one_line_errors(name):
    # a component over the limit raised a raw OSError (File name too long) from a stat
    import minfer
    with pytest.raises((minfer.ModelNotFoundError, minfer.ConfigError)) as caught:
        minfer.load(name, offline=True)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300


def test_convert_onto_a_symlink_loop_is_a_config_error(tmp_path):
    # Path.resolve raised a raw RuntimeError ("Symlink loop") before Python 3.13
    import os

    import minfer
    from minfer.convert import convert
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    from pathlib import Path
    dates = Path(__file__).resolve().parents[1] / "weights" / "tiny-t5-dates"
    with pytest.raises(minfer.ConfigError, match="symbolic link loop|Too many levels"):
        convert(dates, tmp_path / "loop1")
