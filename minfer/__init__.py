"""minfer: framework-free inference for T5 and Transformer-XL over NumPy (and CuPy).

The public surface: `load()`, the model classes and the errors. See README.md for the API and
docs/architecture.md for how a token travels from the CLI to the logits.
"""

from __future__ import annotations

# What load() uses is imported under private names: the package's namespace holds only its
# public surface (__all__) and its submodules.
import dataclasses as _dataclasses
import functools as _functools
import os as _os
from pathlib import Path as _Path
from typing import Any as _Any

from . import errors
from .backend import FP8_FORMATS as _FP8_FORMATS, QUANTISED_FORMATS as _QUANTISED_FORMATS
from .backend import option_name as _option_name
from .devices import cuda_available as _cuda_available, make_backend as _make_backend
from .encoding.cache import EncodeCache as _EncodeCache
from .errors import (ArenaExhausted, Cancelled, CheckpointError, ConfigError, InputError,
                     MinferError, ModelNotFoundError, NonFiniteError, StreamingError,
                     TokenizerError)
from .hub import check_subfolder as _check_subfolder, resolve_model as _resolve_model
from .io.checkpoint import Checkpoint as _Checkpoint, read_json as _read_json
from .io.sentence_transformers import read_sentence_modules as _read_sentence_modules
from .io.gguf import GGUFFile as _GGUFFile, is_gguf as _is_gguf
from .io.single_file import SingleFile as _SingleFile, is_single_file as _is_single_file
from .kernels import set_threads as _set_threads
from .models.registry import model_class_of as _model_class_of
from .params.table import Linear as _Linear
from .models.t5 import T5Config, T5Model
from .models.t5.config import config_from_tensors as _config_from_tensors
from .models.transfo_xl import XLConfig, XLModel, XLSession
from .tokenizers import has_tokenizer as _has_tokenizer, load_tokenizer as _load_tokenizer
from .tokenizers.gguf_vocab import gguf_tokenizer as _gguf_tokenizer
from .io.formats import FORMATS as _FORMATS

__all__ = ["load", "T5Model", "T5Config", "XLModel", "XLConfig", "XLSession", "MinferError",
           "ConfigError", "CheckpointError", "InputError", "ArenaExhausted", "ModelNotFoundError",
           "StreamingError", "TokenizerError", "NonFiniteError", "Cancelled", "errors"]
__version__ = "0.1.0"
del annotations   # the __future__ flag has done its work; the name is not ours to export


def load(model: str | _Path, device: str = "cpu", dtype: _Any = None, workspace: int | str | None = None,
         *, compute: str | None = None, memory_limit: int | str | None = None,
         num_threads: int | None = None,
         revision: str | None = None, offline: bool | None = None, token: str | None = None,
         cache_dir: str | None = None, parts: str | None = None, subfolder: str | None = None,
         tokenizer_subfolder: str | None = None, config: str | _Path | None = None,
         tokenizer: str | _Path | None = None, encode_cache: int | str | None = None,
         **options: _Any) -> T5Model | XLModel:
    """Load a model by hub name, from a local folder in the Hugging Face layout, or from a
    single .safetensors or GGUF file.

    model: "t5-small", "google/flan-t5-base", "transfo-xl-wt103", ... (fetched into the
        huggingface_hub cache) or a folder with config.json and model.safetensors (or an index and
        shards, or a pytorch_model.bin read without executing pickle code), or one .safetensors
        file of a T5 / UMT5 encoder in Hugging Face's tensor names with no config.json, as
        ComfyUI and model hubs ship them (t5xxl_fp16.safetensors,
        t5xxl_fp8_e4m3fn_scaled.safetensors, umt5_xxl_fp8_e4m3fn_scaled.safetensors): its
        config is inferred from its tensors (layers, d_model, d_ff, heads and buckets from the
        position bias, gated FF -> v1.1's gated-gelu, a bias in every block -> UMT5; see
        models/t5/config.py's config_from_tensors) and it loads as an encoder (parts="all"
        reads a decoder the file holds). Tensors may be F32, F16, BF16, F8_E4M3 or F8_E5M2
        (widened exactly), and ComfyUI's scaled fp8 (each fp8 weight times its float32
        scale_weight) is read as fp8 x scale. With dtype unset such a file keeps its fp8 codes
        on the CPU ("float8_e4m3" / "float8_e5m2": one byte a weight and a float32 scale per
        row; a matrix stored otherwise keeps its own exact format), and loads as float16 on
        CUDA; `minfer info` says what the fp8 tensors became. Or one GGUF file of a T5 / UMT5
        model as llama.cpp's convert_hf_to_gguf.py writes it (architecture t5encoder, or t5
        for a whole seq2seq model; city96's T5-XXL / UMT5-XXL encoder files): read with the
        `gguf` package (the [gguf] extra), config from its metadata and shapes, tensors F32,
        F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K (io/gguf.py).
        With dtype unset its blocks load exactly: as "int4g32" / "int4g16" (4 bits a weight and
        a float32 scale and offset per group of 32 / 16) where the file has types whose codes
        fit 4 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K), a slot with a wider source (Q5_*, Q6_K,
        Q8_0: llama.cpp's Q4_K_M) as "int8g32" / "int8g16" (one byte a weight, the same per
        group), and a file without 4-bit types all so (a float matrix beside the blocks keeps
        its own float format); on CUDA a GGUF
        file loads as float32. Its own T5 vocabulary (tokenizer.ggml.*) is its tokenizer unless tokenizer=
        names a folder.
    config: a single file's config.json (its path, or a folder holding one) instead of the
        inferred config: for a file whose shapes do not say everything (another
        layer_norm_epsilon, a LongT5). Only with a single file.
    tokenizer: a folder with tokenizer files (tokenizer.json, spiece.model, ...) to use: what a
        single file needs to read text; for a folder model it replaces the folder's own.
    device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when CuPy finds a device).
    dtype: how the linear layers (and heads, embeddings) are stored: "float32" (CPU default;
        bf16/fp16 checkpoints are widened), "float16" (CUDA default; on the CPU stored 2 bytes and
        computed in float32), "bfloat16" (CPU: stored 2 bytes; see compute), "int8"
        (one scale per output channel), "int4" (CPU: 4 bits, one scale per group of 128 input
        channels: io/formats.py's INT4_GROUP), "int8g32" / "int8g16" (CPU: int8 with a
        float32 scale and offset per group of 32 / 16 input channels: what a GGUF file's blocks
        load as), "int4g32" / "int4g16" (the same with unsigned 4-bit codes: a GGUF file's 4-bit
        blocks), "float8_e4m3" / "float8_e5m2" (CPU: an fp8 file's codes, kept with a scale per
        row) or "auto" (the checkpoint's own: int8, int4,
        bfloat16, float16 or float32). A
        checkpoint that `minfer convert --dtype int8 | int4` wrote loads in its format unless
        another is asked for.
    compute: what the products compute in, apart from how weights are stored. CPU: "float32"
        (default: weights widened, outputs as float32's up to rounding) or "int8" (int8 or int4
        weights, or a GGUF file's int8g blocks as they are: each product's input rows are
        rounded to int8 on the fly and multiplied as integers, on the CPU's dot-product
        instructions (VNNI) where it has them: faster, a little less exact; with dtype unset it
        stores int8, GGUF's blocks stay int8g) or "bfloat16" (bfloat16 weights, or an fp8 file's
        codes as they are: each product's inputs rounded to bfloat16, the products of bfloat16
        pairs summed in float32, on AVX512_BF16 where the CPU has it; the default for bfloat16
        weights on such a CPU, float32 elsewhere; with dtype unset it stores bfloat16, fp8
        stays fp8). CUDA: "float16" (default; float32 for float32 weights) or "float32".
    workspace: arena size for activations and caches, e.g. "512MiB" (default 1GiB, paged in
        lazily, so only what a run touches costs memory). With memory_limit: the part of the
        limit reserved for runs.
    memory_limit: the whole budget, weights included, e.g. "2GiB". Layers that do not fit stay
        out of memory and are streamed in as they are needed (see params/runtime.py); a limit too
        small even for streaming is refused up front with the minimum that would work.
    num_threads: threads of the CPU kernels and BLAS (default: the cores this process may use).
    revision / offline / token / cache_dir: hub options; the HF_* environment variables apply.
    parts: what to load of a T5: None (what the folder holds: a T5EncoderModel / UMT5EncoderModel
        save loads as an encoder-only model), "encoder" (only the embedding and the encoder of a
        full checkpoint: the decoder is never read or placed, and runs plan no decoder state) or
        "all". An encoder-only model encodes and embeds; generate() is a one-line error.
    subfolder: the model's folder inside the repo or local folder (diffusers' "text_encoder_2").
    tokenizer_subfolder: read the tokenizer from this folder of the same repo instead
        ("tokenizer_2"; default: the model's own folder).
    encode_cache: a byte budget such as "1GiB" for encoder outputs kept on the host
        (minfer/encoding/cache.py): encode, embed and generation's encoder pass take a row
        they have seen (same ids, same mask) from it instead of running the encoder; least
        recently used rows leave first. Counters: `model.encode_cache.stats()`.

    A sentence-transformers folder (modules.json) loads its Transformer module's encoder and
    keeps the rest as `model.sentence_modules`, the head `model.embed` applies.

    The model keeps these arguments as `model.load_recipe` (a local folder made absolute; never
    the token) and pickles as that recipe, a few hundred bytes: unpickling calls `load` again, so
    Ray or Dask workers load their own copy (from a shared folder, or from the hub with their own
    HF_TOKEN).
    """
    recorder = options.pop("_recorder", None)  # scheduling events, for tests
    if options:
        raise ConfigError(f"load(): unknown option {sorted(options)[0]!r}")
    recipe = _recipe(model, device=device, dtype=dtype, workspace=workspace, compute=compute,
                     memory_limit=memory_limit, num_threads=num_threads, revision=revision,
                     offline=offline, cache_dir=cache_dir, parts=parts, subfolder=subfolder,
                     tokenizer_subfolder=tokenizer_subfolder)
    if encode_cache is not None:
        recipe["encode_cache"] = encode_cache
        cache = _EncodeCache(encode_cache)   # (its budget checked before anything loads)
    # a single file's config and tokenizer folders (absolute); absent when not given
    recipe.update({k: _local_path(v) for k, v in (("config", config), ("tokenizer", tokenizer))
                   if v is not None})
    single = _is_single_file(model)
    if single is not None:
        for name, value in (("subfolder", subfolder), ("tokenizer_subfolder", tokenizer_subfolder)):
            if value:
                raise ConfigError(f"{name}={value!r}: {single} is a single file, not a folder "
                                  "(tokenizer= names a tokenizer folder)")
        ckpt, model_class, parts = _open_single_file(single, config, parts)
        root = folder = ckpt.folder
        modules = None
    else:
        if config is not None:
            raise ConfigError(f"config={config!r}: only a single .safetensors file (or GGUF file) "
                              "takes a config.json from elsewhere; a model folder has its own")
        root = folder = _resolve_model(model, revision, offline=offline, token=token,
                                      cache_dir=cache_dir, subfolder=subfolder,
                                      also=(tokenizer_subfolder,) if tokenizer_subfolder else ())
        for _ in range(len(_check_subfolder(subfolder).split("/")) if subfolder else 0):
            root = root.parent
        modules = _read_sentence_modules(folder)
        ckpt = _Checkpoint(modules.transformer if modules is not None else folder)
        model_class = _model_class_of(ckpt.config, str(ckpt.folder / "config.json"))
    gguf = isinstance(ckpt, _GGUFFile)
    matrices = _matrices(model_class, ckpt, parts) if gguf or ckpt.holds_fp8() else None
    if dtype == "auto" or dtype is None:
        # a quantised checkpoint stays in its format unless asked otherwise; fp8 and GGUF load in
        # the most compact format that holds them exactly; compute="int8" needs a quantised one
        # (int8 when the file's is not), compute="bfloat16" bfloat16
        if matrices is not None:
            dtype = ckpt.exact_format(_device_kind(device), matrices)
        else:
            dtype = _stored_format(ckpt) if dtype == "auto" else ckpt.quantised_format()
        mode = None if compute is None else _option_name(compute)
        grouped = _FORMATS[dtype] if dtype in _FORMATS and _FORMATS[dtype].group else None
        # GGUF's blocks: compute="bfloat16" would round them again (q x scale + offset is no
        # bfloat16); compute="int8" multiplies the int8 blocks as they are (the 4-bit ones have
        # no int8 product: they multiply in float32)
        if grouped and (mode == "bfloat16" or (mode == "int8" and grouped.packed)):
            raise ConfigError(f"compute={compute!r}: {single} holds GGUF blocks, which load "
                              f"exactly as {dtype} ({grouped.quantisation}) and multiply in "
                              "float32 (the int8 ones also with compute='int8'): leave compute "
                              "unset, or set dtype (e.g. dtype='int8') to re-quantise them")
        if mode == "int8" and dtype not in _QUANTISED_FORMATS and not grouped:
            dtype = "int8"
        elif mode == "bfloat16" and dtype not in _FP8_FORMATS:   # (fp8 values are bfloat16s)
            if dtype in _QUANTISED_FORMATS:   # int8 x scale is no bfloat16: a second rounding
                raise ConfigError(f"compute='bfloat16' multiplies bfloat16 or fp8 weights, and "
                                  f"{ckpt.folder} stores {dtype}: use compute='int8', or "
                                  "dtype='bfloat16' to widen them")
            dtype = "bfloat16"
    be = _make_backend(device, dtype, workspace, memory_limit, compute)
    if gguf:   # its blocks as the weight format's own bytes where it holds them exactly
        ckpt.present_as(be.weight_format, matrices)
    if compute is None and be.compute == "bfloat16":
        # chosen for this CPU (AVX512_BF16): a copy elsewhere (a pickle, a Ray worker) computes
        # the same, on another CPU's widening build
        recipe["compute"] = "bfloat16"
    be.num_threads = _set_threads(num_threads)
    if tokenizer is not None:
        tokenizer = _tokenizer_folder(tokenizer)
    elif single is None:
        tokenizer = _tokenizer(root, tokenizer_subfolder, ckpt.folder, folder)
    elif gguf and ckpt.metadata.get("tokenizer.ggml.model") == "t5":   # the file's own vocabulary
        tokenizer = _gguf_tokenizer(ckpt.metadata, ckpt.path)
    generation = None if single is not None else _read_json(ckpt.folder / "generation_config.json")
    loaded = model_class.load(ckpt, be, generation, tokenizer, recorder, parts)
    note = _source_note(ckpt, single)
    if note and hasattr(loaded.config, "source_note"):   # minfer info's "weights" line
        loaded.config = _dataclasses.replace(loaded.config, source_note=note)
    if modules is not None:
        if not hasattr(loaded, "encode"):
            raise ConfigError(f"{folder / 'modules.json'}: a sentence-transformers head needs an "
                              f"encoder, and a {model_class.family.name} model has none")
        if modules.pooling.dimension != loaded.config.d_model:
            raise ConfigError(f"{modules.folder}: '{modules.pooling.dimension_key}' "
                              f"{modules.pooling.dimension} of the Pooling module does not fit the "
                              f"encoder's d_model {loaded.config.d_model}")
        loaded.sentence_modules = modules
    if encode_cache is not None:
        loaded.encode_cache = cache
    if recorder is None:
        loaded.set_load_call(_functools.partial(load, **recipe))   # what the model pickles as
    else:
        loaded.set_load_call(None, "it was loaded with the private _recorder option (test events)")
    return loaded


def _open_single_file(path: _Path, config: _Any, parts: str | None) -> tuple[_Any, _Any, str]:
    """A single .safetensors file: its config (inferred from its tensors, or config=), the model
    class, the parts it loads as (an encoder unless asked) and every name and shape checked
    against the weight table, each problem one line naming the file (or the config) and the
    tensor, before any weight is read."""
    gguf = path.suffix.lower() == ".gguf" or _is_gguf(path)
    ckpt = _GGUFFile(path) if gguf else _SingleFile(path)
    if config is None:
        try:
            ckpt.config = _config_from_tensors(ckpt.shapes(), str(path))
        except CheckpointError as e:
            if not gguf:
                raise
            raise CheckpointError(ckpt.in_file_names(str(e))) from None
        if gguf:   # what the metadata states beside the shapes (checked against them below)
            ckpt.config.update(ckpt.metadata_config())
        what = f"the T5 config inferred from {ckpt.inferred_from}"
    else:
        ckpt.use_config(config)
        what = f"the config in {ckpt.config_source}"
    model_class = _model_class_of(ckpt.config, ckpt.config_source)
    family = model_class.family
    parts = "encoder" if parts is None and family.with_parts is not None else parts
    cfg = family.config.from_hf(ckpt.config, ckpt.config_source)
    if family.with_parts is not None:
        cfg = family.with_parts(cfg, ckpt.names(), parts, str(path))
    table = family.weight_table(cfg)
    ckpt.check_names(table.tensors, table.optional, table.aliases, what)
    return ckpt, model_class, parts


def _matrices(model_class: _Any, ckpt: _Any, parts: str | None) -> set[str]:
    """The tensors the weight format applies to: the sources of the model's linear slots (and
    the names that may stand in for them)."""
    family = model_class.family
    source = getattr(ckpt, "config_source", str(ckpt.folder / "config.json"))
    cfg = family.config.from_hf(ckpt.config, source)
    if family.with_parts is not None:
        cfg = family.with_parts(cfg, ckpt.names(), parts, str(ckpt.folder))
    table = family.weight_table(cfg)
    entries = [*table.fixed.values(), *(e for _, unit in table.units() for e in unit.values())]
    sources = {s for e in entries if isinstance(e, _Linear) for s in e.sources}
    return sources | {a for s in sources for a in table.aliases.get(s, ())}


def _source_note(ckpt: _Any, single: _Path | None) -> str:
    """minfer info's line on where the weights came from: a single file and its config, and
    what its fp8 tensors became ("" for a plain folder)."""
    parts = []
    if single is not None:
        inferred = ckpt.config_source == str(single)
        parts.append(f"single file {single.name}, config " + (
            f"inferred from {ckpt.inferred_from}" if inferred else f"from {ckpt.config_source}"))
    if ckpt.holds_fp8() or isinstance(ckpt, _GGUFFile):
        parts.append(ckpt.storage_note())
    return "; ".join(parts)


def _device_kind(device: _Any) -> str:
    """'cuda' or 'cpu' for a device option (make_backend checks its spelling)."""
    name = device.strip().lower() if isinstance(device, str) else ""
    if name == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def _tokenizer_folder(where: _Any) -> _Any:
    """tokenizer=: the tokenizer of a local folder, which must hold one."""
    if not isinstance(where, (str, _os.PathLike)) or not _os.fspath(where).strip():
        raise ConfigError(f"tokenizer={where!r}: expected a folder holding tokenizer files")
    folder = _Path(where).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"tokenizer={_os.fspath(where)!r}: no such folder (a folder holding "
                          "tokenizer.json, spiece.model or the like)")
    if not _has_tokenizer(folder):
        raise TokenizerError(f"{folder}: no tokenizer files (tokenizer={_os.fspath(where)!r})")
    return _load_tokenizer(folder)


def _local_path(value: _Any) -> _Any:
    """A local path option as an absolute path (for the recipe), anything else as given."""
    if isinstance(value, (str, _os.PathLike)) and _os.fspath(value).strip():
        return _os.path.abspath(_Path(_os.fspath(value)).expanduser())
    return value


def _tokenizer(root: _Path, subfolder: str | None, *folders: _Path) -> _Any:
    """The tokenizer of `root / subfolder` when one is named (it must hold one), else of the
    first of `folders` that holds tokenizer files (None when none does)."""
    if subfolder:
        where = root / _check_subfolder(subfolder, "tokenizer_subfolder")
        if not _has_tokenizer(where):
            raise TokenizerError(f"{where}: no tokenizer files (tokenizer_subfolder="
                                 f"{subfolder!r})")
        return _load_tokenizer(where)
    for folder in folders:
        if _has_tokenizer(folder):
            return _load_tokenizer(folder)
    return None


def _recipe(model: _Any, **arguments: _Any) -> dict[str, _Any]:
    """The arguments of `load` that rebuild this model elsewhere: the name as given, or a local
    folder as an absolute path (another process may run in another working directory); no token
    (the other side authenticates with its own HF_TOKEN)."""
    text = _os.fspath(model) if isinstance(model, (str, _os.PathLike)) else model
    if isinstance(text, str) and text.strip() and (_is_folder(text) or _is_single_file(text)):
        text = _os.path.abspath(_Path(text).expanduser())
    return {"model": text, **arguments}


def _is_folder(text: str) -> bool:
    try:
        return _Path(text).expanduser().is_dir()
    except OSError:   # a name over the file-name limit: not a folder (resolve_model says more)
        return False


def _stored_format(ckpt: _Checkpoint) -> str | None:
    """dtype="auto": the weight format the checkpoint's matrices are stored in (None: the
    device's default)."""
    quantised = ckpt.quantised_format()
    if quantised:
        return quantised
    codes = {ckpt.info(n).dtype for n in ckpt.names() if len(ckpt.info(n).shape) == 2}
    halves = {f.file_code: name for name, f in _FORMATS.items() if name in ("float16", "bfloat16")}
    return halves.get(codes.pop()) if len(codes) == 1 else None
