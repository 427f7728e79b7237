"""Model name -> local folder: a folder as given, or a Hugging Face Hub repo fetched into its cache.

`resolve_model("t5-small")` returns a folder in the Hugging Face layout (config.json, safetensors
weights, tokenizer files) that `io.checkpoint.Checkpoint` and `tokenizer` read. Downloading and caching
are left to `huggingface_hub.snapshot_download`, so the cache is the one every HF library shares
(https://huggingface.co/docs/hub/local-cache: `<cache>/models--ORG--NAME/{blobs,refs,snapshots}`)
and HF's own settings stay in force: HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE,
HF_HUB_DISABLE_PROGRESS_BARS. This module adds what minfer needs on top: legacy short names, a
default revision where a repo keeps its safetensors weights off `main`, fetching only the files we
read, and one-line errors instead of the hub's multi-line tracebacks.

No math and no parsing happens here: the folder's contents are validated by io/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from .errors import ConfigError, ModelNotFoundError
from .io.limits import shown
from .tokenizers.select import PICKLED_VOCABULARIES, TOKENIZER_FILES

# Pre-organisation ids the hub now redirects. Resolving them here keeps one cache folder per model
# (models--google-t5--t5-small) whichever spelling was typed, and offline look-ups cannot follow
# the hub's redirect anyway.
ALIASES = {
    "t5-small": "google-t5/t5-small",
    "t5-base": "google-t5/t5-base",
    "t5-large": "google-t5/t5-large",
    "t5-3b": "google-t5/t5-3b",
    "t5-11b": "google-t5/t5-11b",
    "transfo-xl-wt103": "transfo-xl/transfo-xl-wt103",
}

# Repos whose `main` has only pytorch_model.bin: the safetensors conversion lives on a PR ref.
DEFAULT_REVISIONS = {
    "transfo-xl/transfo-xl-wt103": "refs/pr/2",
}

# The files minfer reads. Exact names (or a digits-only shard pattern) because the hub matches
# with fnmatch, whose `*` also crosses `/`: a loose "*.json" would pull in onnx/ and other folders.
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
SHARD_PATTERN = "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors"
OTHER_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES, *PICKLED_VOCABULARIES)
BIN_FILE = "pytorch_model.bin"
# A sentence-transformers folder: its module list and settings at the top, each module's files
# in a folder named "<index>_<Module>" (1_Pooling/config.json, 2_Dense/model.safetensors, ...;
# io/sentence_transformers.py reads them). Module folders named otherwise are not fetched.
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
MODULE_FOLDER = "[0-9]_[A-Za-z]*/"
# A folder inside a repo (`subfolder=`): plain names joined by "/", never ".." or absolute.
_SUBFOLDER = re.compile(r"[\w.-]+(?:/[\w.-]+)*", re.ASCII)

# The HTTP client under the hub: requests below huggingface_hub 1.0, httpx in 1.x, httpx2 (a fork
# that keeps httpx's exception names) from 2.0. requests' errors are OSErrors; httpx's are not, so
# a timeout or a dropped connection that the hub lets through would escape `except OSError`.
# Per client: (exception class, what it means), most specific first (requests' ConnectTimeout is
# also a ConnectionError; its ProxyError and SSLError are ConnectionErrors too). The base class
# comes last, caught but not explained: it also covers the hub's own HTTP errors below 1.0.
_TIMED_OUT = "the connection timed out"
_HTTPX_FAILURES = (
    ("TimeoutException", _TIMED_OUT),                  # connect, read, write or pool timeout
    ("ProxyError", "the proxy failed"),
    ("ConnectError", "could not connect"),             # refused, name lookup, TLS handshake
    ("RemoteProtocolError", "the connection was dropped"),  # closed before/while answering
    ("NetworkError", "the connection was dropped"),    # ReadError (reset by peer), WriteError...
    ("TransportError", "a network error"),             # e.g. an unsupported protocol in HF_ENDPOINT
    ("HTTPError", None),
)
_HTTP_CLIENT_FAILURES = {
    "requests.exceptions": (
        ("Timeout", _TIMED_OUT),
        ("ProxyError", "the proxy failed"),
        ("SSLError", "the TLS handshake failed"),
        ("ChunkedEncodingError", "the connection was dropped"),  # mid-download
        ("ConnectionError", "the connection failed"),  # refused, unreachable, dropped, read timeout
        ("RequestException", None),
    ),
    "httpx": _HTTPX_FAILURES,
    "httpx2": _HTTPX_FAILURES,
}

# The hub's repo-id rule (huggingface_hub.utils.validate_repo_id), ASCII only: an optional
# namespace and a name, each starting and ending with a letter, digit or "_".
_PART = r"\w(?:[\w.-]{0,94}\w)?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}", re.ASCII)


def allow_patterns(include_bin: bool = False, folders: tuple[str, ...] = ("",)) -> list[str]:
    """The snapshot_download patterns naming every file minfer may read from a repo: in each of
    `folders` ("" the repo's top; "text_encoder_2" ...) the model, tokenizer and
    sentence-transformers files, and those of its sentence-transformers module folders."""
    names = [*SAFETENSORS_FILES, SHARD_PATTERN, *OTHER_FILES, *([BIN_FILE] if include_bin else [])]
    patterns = []
    for folder in dict.fromkeys(folders):
        top = f"{folder}/" if folder else ""
        patterns += [top + n for n in (*names, *SENTENCE_FILES)]
        # module folders: their config and weights (a Dense layer is often a small .bin)
        patterns += [top + MODULE_FOLDER + n
                     for n in dict.fromkeys((*names, BIN_FILE, *SENTENCE_FILES))]
    return patterns


def check_subfolder(subfolder: str | None, what: str = "subfolder") -> str:
    """A folder inside a model folder or repo, as given ("" for None); one that could leave it
    (absolute, "..", odd characters) is a one-line ConfigError."""
    if subfolder is None:
        return ""
    if (not isinstance(subfolder, str) or not _SUBFOLDER.fullmatch(subfolder.rstrip("/"))
            or any(part in (".", "..") for part in subfolder.split("/"))):
        raise ConfigError(f"{what}={shown(subfolder)}: expected a folder inside the model folder "
                          "or repo, such as 'text_encoder_2' (names joined by '/', no '..')")
    return subfolder.rstrip("/")


def resolve_model(name_or_path: str | os.PathLike, revision: str | None = None, *,
                  offline: bool | None = None, token: str | None = None,
                  cache_dir: str | os.PathLike | None = None, progress: bool | None = None,
                  include_bin: bool = False, subfolder: str | None = None,
                  also: tuple[str, ...] = ()) -> Path:
    """The local folder holding model `name_or_path` (its `subfolder`, when given), downloading
    it from the hub when needed; `also` names other folders of the same repo to fetch with it
    (a tokenizer kept apart, as diffusers repos keep tokenizer_2/ beside text_encoder_2/).

    An existing folder is returned as is. Anything else is a hub repo id ("name" or "org/name",
    legacy names such as "t5-small" accepted) fetched at `revision` (default: "main", or the repo's
    entry in DEFAULT_REVISIONS). `offline=None` follows HF_HUB_OFFLINE; True never touches the
    network. `progress=None` shows the download bars only when stderr is a terminal.
    `include_bin` also fetches pytorch_model.bin, for revisions without safetensors weights.
    """
    sub = check_subfolder(subfolder)
    folders = (sub, *(check_subfolder(f, "tokenizer_subfolder") for f in also))
    folder = _local_folder(name_or_path)
    if folder is not None:
        return _inside(folder, sub)
    name = str(name_or_path)
    repo_id = ALIASES.get(name, name)
    if (not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id
            or repo_id.endswith(".git")):
        raise ConfigError(f"'{_shortened(name)}' is neither an existing folder nor a hub repo id "
                          "(expected 'name' or 'org/name' using letters, digits, '-', '_', '.')")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ConfigError(f"revision {shown(revision)} for '{name}' is not a branch, tag, commit "
                          "hash or 'refs/pr/N'")
    rev = revision or DEFAULT_REVISIONS.get(repo_id, "main")

    try:  # imported lazily: loading a local folder should not pay for (or need) the hub client
        import huggingface_hub as hf
        import huggingface_hub.constants  # noqa: F401  (submodules are lazy attributes of the
        import huggingface_hub.utils      # noqa: F401   package: import them explicitly)
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise ModelNotFoundError(f"cannot fetch '{name}' from the hub: huggingface_hub is not "
                                 "installed (pip install huggingface_hub, or pass a local folder)"
                                 ) from None

    if offline is None:
        offline = _offline_from_env(hf.constants.HF_HUB_OFFLINE)
    what = (f"model '{name}'" + (f" ({repo_id})" if repo_id != name else "")
            + (f" at revision '{_shortened(rev)}'" if rev != "main" else ""))
    try:
        with _progress_bars(hf, progress):
            path = hf.snapshot_download(repo_id, revision=rev, cache_dir=cache_dir, token=token,
                                        allow_patterns=allow_patterns(include_bin, folders),
                                        local_files_only=offline)
    except (OSError, ValueError, hf_errors.HfHubHTTPError, *_http_client_errors()) as e:
        cache = cache_dir or hf.constants.HF_HUB_CACHE
        raise _explain(e, hf_errors, what, repo_id, rev, offline, cache) from None

    folder = Path(path) / sub
    # snapshot_download returns the snapshot path even when no file matched our patterns (online)
    # or when only some files were ever cached (offline): check for weights before claiming success
    # (in a sentence-transformers folder they may lie in its Transformer module's folder).
    weights = (*SAFETENSORS_FILES, *([BIN_FILE] if include_bin else []))
    inner = (list(folder.glob(MODULE_FOLDER.rstrip("/"))) if (folder / "modules.json").is_file()
             else [])
    if not any((f / w).is_file() for f in (folder, *inner) for w in weights):
        known = DEFAULT_REVISIONS.get(repo_id)
        hint = (f"its safetensors weights are at revision '{known}'" if known and rev != known
                else "pass a revision that has them, e.g. a 'refs/pr/N' safetensors conversion")
        cached = (" (or they are not in the local cache: connect once to fetch them)"
                  if offline else "")
        where = f" in {_shortened(sub)}/" if sub else ""
        raise ModelNotFoundError(f"hub repo '{repo_id}' has no safetensors weights{where} at "
                                 f"revision '{_shortened(rev)}'{cached}: {hint}")
    return folder


def _inside(folder: Path, sub: str) -> Path:
    """`sub` of a local model folder, which must exist."""
    if not sub:
        return folder
    try:   # (a name over the file-name limit is an OSError that is_dir does not swallow)
        found = (folder / sub).is_dir()
    except OSError as e:
        raise ModelNotFoundError(f"{folder}: subfolder '{_shortened(sub)}': "
                                 f"{e.strerror or e}") from None
    if not found:
        raise ModelNotFoundError(f"{folder}: no subfolder '{_shortened(sub)}'")
    return folder / sub


def _local_folder(name: str | os.PathLike) -> Path | None:
    """`name` as an existing folder; None when it reads as a hub repo id; else an error."""
    text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ConfigError(f"model name {shown(name)} must be a string or a path")
    if not text.strip():  # Path("") is ".", which would silently load the working directory
        raise ConfigError("empty model name: pass a folder or a hub repo id such as 't5-small'")
    path = Path(text).expanduser()
    try:   # (a name over the file-name limit is an OSError that is_dir does not swallow)
        if path.is_dir():
            return path
        if not isinstance(name, os.PathLike) and not _looks_like_path(text):
            return None
        exists = path.exists()
    except OSError as e:
        raise ModelNotFoundError(f"model '{_shortened(text)}': {e.strerror or e} (neither a "
                                 "folder nor a hub repo id)") from None
    if exists:
        raise ModelNotFoundError(f"'{_shortened(text, 200)}' is a file, not a model folder: pass "
                                 "the folder holding config.json and the weights (minfer.load "
                                 "reads a single .safetensors file itself)")
    raise ModelNotFoundError(f"no such folder '{_shortened(text, 200)}': check the path "
                             "(hub repo ids look like 'org/name')")


def _shortened(text: str, limit: int = 80) -> str:
    """A long name as its start, its length and its end, control characters escaped: an error
    stays one readable line."""
    if len(text) <= limit:
        return _printable(text)
    return (f"{_printable(text[:limit // 2])}...({len(text)} characters)..."
            f"{_printable(text[-(limit // 4):])}")


def _printable(text: str) -> str:
    # escapes only what cannot print (a newline, NUL): a path's accented letters stay as they are
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _looks_like_path(text: str) -> bool:
    # "org/name" contains "/" too, so a slash alone does not make a path: its first part must exist.
    if text.startswith((".", "~")) or os.path.isabs(text):
        return True
    first = re.split(r"[\\/]" if os.altsep else "/", text, maxsplit=1)
    return len(first) == 2 and first[0] != "" and os.path.exists(first[0])


def _offline_from_env(hub_flag: bool) -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import. Read it again so that a value set later
    # in the process (a CLI flag, a test) still counts; the hub's own spelling of "true" is used.
    raw = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(hub_flag) or raw.strip().upper() in {"1", "ON", "YES", "TRUE"}


@contextlib.contextmanager
def _progress_bars(hf, progress: bool | None) -> Iterator[None]:
    """Hide the hub's tqdm bars unless wanted (and on a terminal); restore the previous state."""
    show = progress if progress is not None else _stderr_is_tty()
    utils = hf.utils
    # HF_HUB_DISABLE_PROGRESS_BARS=0 is an explicit request for bars that the hub lets win.
    if (show or utils.are_progress_bars_disabled()
            or hf.constants.HF_HUB_DISABLE_PROGRESS_BARS is False):
        yield
        return
    utils.disable_progress_bars()
    try:
        yield
    finally:
        utils.enable_progress_bars()  # they were enabled globally before (checked above)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


# The hub's answers about a repository itself, in the order they are tested (GatedRepoError
# subclasses RepositoryNotFoundError): the error class's name in huggingface_hub.errors, the message.
_REFUSALS = (
    ("GatedRepoError", "hub repo '{repo}' is gated: accept its terms on huggingface.co and set "
                       "HF_TOKEN to a token of that account"),
    ("RepositoryNotFoundError", "no hub repo '{repo}' (check the name, or set HF_TOKEN for a "
                                "private or gated repo)"),
    ("RevisionNotFoundError", "revision '{rev}' not found in {repo} (use a branch, tag, commit "
                              "hash or 'refs/pr/N' that exists on the hub)"),
    ("DisabledRepoError", "hub repo '{repo}' is disabled: use another repo or a local folder"),
)


def _explain(e: Exception, errs, what: str, repo_id: str, rev: str, offline: bool,
             cache) -> Exception:
    """One line saying what went wrong and what to do, for an exception from snapshot_download."""
    # Order matters: GatedRepoError subclasses RepositoryNotFoundError, and below hub 1.0
    # LocalEntryNotFoundError subclasses the HTTP errors too.
    if isinstance(e, errs.LocalEntryNotFoundError):
        # IncompleteSnapshotError (added during hub 1.x): a download that stopped half way.
        partial = isinstance(e, getattr(errs, "IncompleteSnapshotError", ()))
        where = "only partly in" if partial else "not in"
        todo = "finish the download" if partial else "download it"
        cache = _shortened(str(cache), 200)   # cache_dir= is the caller's: any length
        return ModelNotFoundError(f"{what} is {where} the local cache ({cache}) and "
                                  f"{_why_unreachable(e, errs, offline)}: connect once to {todo}, "
                                  "or pass a local folder")
    for error_name, text in _REFUSALS:
        if isinstance(e, getattr(errs, error_name)):
            return ModelNotFoundError(text.format(repo=repo_id, rev=_shortened(rev)))
    if isinstance(e, errs.HFValidationError):
        return ConfigError(f"cannot fetch {what}: {_first_line(e)}")
    status = _http_status(e)
    if status in (401, 403):
        return ModelNotFoundError(f"the hub refused access to '{repo_id}' (HTTP {status}): "
                                  "set HF_TOKEN to a token that can read it")
    network = _network_failure(e)
    if network is not None:
        slow = (" (HF_HUB_DOWNLOAD_TIMEOUT sets the limit in seconds)"
                if network.startswith(_TIMED_OUT) else "")
        return ModelNotFoundError(f"cannot fetch {what} from the hub: {network}; check the "
                                  f"network and try again{slow}, set HF_HUB_OFFLINE=1 to use only "
                                  "the local cache, or pass a local folder")
    code = f" (HTTP {status})" if status else ""
    return ModelNotFoundError(f"cannot fetch {what} from the hub{code}: {_first_line(e)} (try "
                              "again, check the network and disk space, or pass a local folder)")


def _why_unreachable(e: Exception, errs, offline: bool) -> str:
    """Why the hub was not asked, for a LocalEntryNotFoundError: the hub chains the cause to it."""
    if offline or any(isinstance(c, errs.OfflineModeIsEnabled) for c in _causes(e)):
        return "offline mode is on"
    network = _network_failure(e)
    status = next((s for s in map(_http_status, _causes(e)) if s), None)
    detail = network or (f"HTTP {status}" if status else None)
    return "the hub could not be reached" + (f" ({detail})" if detail else "")


def _http_client_errors() -> tuple[type[BaseException], ...]:
    """The error classes of the HTTP clients loaded, for an `except` clause."""
    return tuple(cls for cls, _ in _http_client_failures())


def _http_client_failures() -> Iterator[tuple[type[BaseException], str | None]]:
    """(exception class, what it means or None) for each HTTP client that is loaded."""
    for module_name, failures in _HTTP_CLIENT_FAILURES.items():
        # Looked up, never imported: the hub has imported its client before anything can fail,
        # and importing httpx beside httpx2 would make httpx2.alias_httpx() fail later.
        module = sys.modules.get(module_name)
        for class_name, meaning in failures:
            cls = getattr(module, class_name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                yield cls, meaning


def _network_failure(e: BaseException) -> str | None:
    """'what went wrong (detail)' for a transport error in `e` or its causes; None without one."""
    for cause in _causes(e):
        for cls, meaning in _http_client_failures():
            if meaning is not None and isinstance(cause, cls):
                return f"{meaning} ({_first_line(cause)})"
    return None


def _causes(e: BaseException) -> Iterator[BaseException]:
    """`e`, then the errors a traceback would show above it: the hub raises its
    LocalEntryNotFoundError from the network or HTTP error that made it fall back to the cache."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)


def _http_status(e: BaseException) -> int | None:
    # HfHubHTTPError.response: a requests.Response below hub 1.0, an httpx one after; both have
    # status_code. Some errors carry response=None.
    return getattr(getattr(e, "response", None), "status_code", None)


def _first_line(e: BaseException) -> str:
    # the hub's messages repeat what they were given (a revision, a path): cut, not trusted short
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return _shortened(lines[0], 200) if lines else type(e).__name__
