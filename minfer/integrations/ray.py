"""Ray Data: generate over a dataset with a pool of actors, each loading the model once.

    import ray, minfer.integrations.ray as mr
    ds = ray.data.read_json("prompts.jsonl")
    ds = ds.map_batches(mr.MinferPredictor, fn_constructor_kwargs={"model": "t5-small",
                        "column": "prompt", "max_new_tokens": 64}, batch_size=32,
                        compute=ray.data.ActorPoolStrategy(size=4), num_cpus=2)
    ds.write_parquet("out/")

`MinferPredictor` reads the text column, adds the generated text column, `finish_reason` and
`error`: a row minfer refuses (an empty prompt, a lone surrogate, a prompt too long for the
arena) gets its one-line message in `error` and None in the others, and the rest of the batch
runs on; the batch never fails on a row. Threads: by default as many as the CPUs Ray gave the
actor (`num_cpus=` of map_batches; 1 when unknown), so actors on one node do not oversubscribe it.

`MinferEncoder` does the same for `model.encode` (per-token states and the mask in a preset's
layout: a dataset of captions encoded once for training) and `MinferEmbedder` for `model.embed`:

    ds.map_batches(mr.MinferEncoder, fn_constructor_kwargs={"model": "t5xxl.safetensors",
                   "load_options": {"tokenizer": "t5-tokenizer/", "memory_limit": "4GiB"},
                   "preset": "flux"}, batch_size=16, compute=ray.data.ActorPoolStrategy(size=2))

Ray itself is imported only to ask for the actor's CPUs: the classes also run without Ray, on a
dict of NumPy arrays, a pandas DataFrame or a pyarrow Table.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import numpy as np

from .. import load
from ..encoding.presets import preset_named
from ..errors import ConfigError, MinferError
from ..generation.options import resolve_options
from ..kernels import set_threads

__all__ = ["MinferPredictor", "MinferEncoder", "MinferEmbedder", "actor_cpus"]

# generate() arguments the class sets itself
_RESERVED = ("stream", "return_details", "attention_mask")


def actor_cpus() -> int | None:
    """Whole CPUs Ray assigned to the current actor or task (None outside Ray, or when Ray did
    not say)."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # Ray missing, or not inside a worker
        return None
    return max(1, int(cpus)) if cpus else None


class MinferPredictor:
    """A callable class for `Dataset.map_batches(MinferPredictor, compute=ActorPoolStrategy(...),
    fn_constructor_kwargs={...})`: the model is loaded once per actor, in `__init__`.

    model: a hub name or a folder (loaded here with `load_options`), or a loaded model (it
        pickles as its load recipe and is loaded again inside each actor).
    column: the text column to read; output_column: the generated text column to add (with
        num_return_sequences n > 1 each row holds a list of n texts, and `finish_reason` a list).
    num_threads: CPU threads for the kernels and BLAS inside the actor (default: the CPUs Ray
        assigned to it, else 1).
    load_options: more `minfer.load` arguments (device, dtype, workspace, memory_limit, revision,
        offline, cache_dir), for a name or folder.
    generate_options: `generate` options (max_new_tokens, num_beams, stop, task, seed, ...),
        checked here: a bad option fails the actor at once, not every row.
    """

    def __init__(self, model: Any, column: str = "text", output_column: str = "generated", *,
                 num_threads: int | None = None, load_options: dict[str, Any] | None = None,
                 finish_column: str = "finish_reason", error_column: str = "error",
                 **generate_options: Any):
        names = {"column": column, "output_column": output_column, "finish_column": finish_column,
                 "error_column": error_column}
        for what, name in names.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"MinferPredictor: {what} must be a non-empty string, got {name!r}")
        if len({output_column, finish_column, error_column, column}) != 4:
            raise ConfigError(f"MinferPredictor: the columns must differ, got {names}")
        for name in _RESERVED:
            if name in generate_options:
                raise ConfigError(f"MinferPredictor: {name!r} is not a generate option here "
                                  "(the class returns details per row itself)")
        if "num_threads" in (load_options or {}):
            raise ConfigError("MinferPredictor: pass num_threads itself, not in load_options")
        self.num_threads = num_threads if num_threads is not None else (actor_cpus() or 1)
        if isinstance(model, (str, os.PathLike)):
            model = load(model, **{**(load_options or {}), "num_threads": self.num_threads})
        elif load_options:
            raise ConfigError("MinferPredictor: load_options apply to a model name or folder, "
                              "not to a loaded model")
        elif not hasattr(model, "generate"):
            raise ConfigError(f"MinferPredictor: model must be a name, a folder or a loaded "
                              f"minfer model, got {type(model).__name__}")
        self.model = model
        self.column, self.output_column = column, output_column
        self.finish_column, self.error_column = finish_column, error_column
        self.generate_options = generate_options
        opts, _ = resolve_options(model, **generate_options)  # unknown or bad options: fail now
        self.sequences = opts.num_return_sequences
        self._lock = threading.Lock()      # one batch at a time per actor
        # (kernels.active applies the count in whichever thread Ray calls the actor from)
        self.model.backend.num_threads = set_threads(self.num_threads)

    # -- one batch ------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        """A dict of NumPy arrays, a pandas DataFrame or a pyarrow Table -> the same kind, with
        the output, finish_reason and error columns added."""
        values = _column(batch, self.column)
        n = len(values)
        texts: list[Any] = [None] * n
        finish: list[Any] = [None] * n
        errors: list[str | None] = [None] * n
        prompts: dict[int, str] = {}
        for i, v in enumerate(values):
            if isinstance(v, str):
                prompts[i] = str(v)  # numpy's str_ -> str
            else:
                errors[i] = (f"column {self.column!r}: expected a string, got "
                             f"{type(v).__name__}" + (f" {v!r:.40}" if v is not None else ""))
        with self._lock:
            self._generate(list(prompts), prompts, texts, finish, errors)
        if self.sequences == 1:
            texts = [t[0] if t is not None else None for t in texts]
            finish = [f[0] if f is not None else None for f in finish]
        return _with_columns(batch, {self.output_column: texts, self.finish_column: finish,
                                     self.error_column: errors})

    def _generate(self, rows: list[int], prompts: dict[int, str], texts: list, finish: list,
                  errors: list) -> None:
        """Generate `rows` as one call; if minfer refuses it, split it in halves until each
        refusal is pinned to its row (a batch with one bad row costs ~2 log2(B) calls)."""
        if not rows:
            return
        try:
            results = self.model.generate([prompts[i] for i in rows], return_details=True,
                                          **self.generate_options)
        except MinferError as e:
            if len(rows) == 1:
                errors[rows[0]] = _row_message(str(e))
                return
            half = len(rows) // 2
            self._generate(rows[:half], prompts, texts, finish, errors)
            self._generate(rows[half:], prompts, texts, finish, errors)
            return
        for i, row in zip(rows, results):
            failed = next((r.error for r in row if r.error is not None), None)
            if failed is not None:   # generate's own per-row refusal (the batch still ran)
                errors[i] = _row_message(failed)
                continue
            texts[i] = [r.text for r in row]
            finish[i] = [r.finish_reason for r in row]


def _row_message(message: str) -> str:
    """generate's message for one row without its call-local "inputs: prompt N: " (the index
    is the row's place in one generate call, which means nothing in the dataset)."""
    return _CALL_INDEX.sub("", message, count=1)


_CALL_INDEX = re.compile(r"^inputs: prompt \d+: ")


def _column(batch: Any, name: str) -> list[Any]:
    """The values of column `name` as Python objects."""
    if isinstance(batch, dict):
        if name not in batch:
            raise ConfigError(f"MinferPredictor: the batch has no column {name!r} "
                              f"(columns: {', '.join(map(str, batch)) or 'none'})")
        return list(batch[name])
    columns = getattr(batch, "column_names", None)  # pyarrow.Table
    if columns is None and hasattr(batch, "columns") and hasattr(batch, "assign"):  # pandas
        columns = list(batch.columns)
    if columns is None:
        raise ConfigError(f"MinferPredictor: expected a batch as a dict of arrays, a pandas "
                          f"DataFrame or a pyarrow Table, got {type(batch).__name__}")
    if name not in columns:
        raise ConfigError(f"MinferPredictor: the batch has no column {name!r} "
                          f"(columns: {', '.join(map(str, columns)) or 'none'})")
    if hasattr(batch, "column_names"):
        return batch.column(name).to_pylist()
    return batch[name].tolist()


def _with_columns(batch: Any, new: dict[str, list]) -> Any:
    """The batch, of the same kind, with `new` columns added (or replaced)."""
    if isinstance(batch, dict):
        out = dict(batch)
        for name, values in new.items():
            col = np.empty(len(values), dtype=object)  # None where a row failed
            for i, v in enumerate(values):             # (a list per row stays one cell)
                col[i] = v
            out[name] = col
        return out
    if hasattr(batch, "column_names"):  # pyarrow.Table
        import pyarrow as pa
        for name, values in new.items():
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(name, pa.array(values))
        return batch
    return batch.assign(**new)  # pandas: a new frame, the input left as it was


class _RowActor:
    """What the encode and embed actors share: the model loaded once (a name, a folder or a
    loaded model), the actor's threads, one batch at a time, and a result per row or its
    one-line error (a call refused by minfer split in halves until each refusal is pinned to
    its row)."""

    what = ""   # the class name, in messages

    def __init__(self, model: Any, column: str, outputs: dict[str, str], error_column: str,
                 num_threads: int | None, load_options: dict[str, Any] | None):
        names = {"column": column, **outputs, "error_column": error_column}
        for what, name in names.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{self.what}: {what} must be a non-empty string, got {name!r}")
        if len(set(names.values())) != len(names):
            raise ConfigError(f"{self.what}: the columns must differ, got {names}")
        if "num_threads" in (load_options or {}):
            raise ConfigError(f"{self.what}: pass num_threads itself, not in load_options")
        self.num_threads = num_threads if num_threads is not None else (actor_cpus() or 1)
        if isinstance(model, (str, os.PathLike)):
            model = load(model, **{**(load_options or {}), "num_threads": self.num_threads})
        elif load_options:
            raise ConfigError(f"{self.what}: load_options apply to a model name or folder, not "
                              "to a loaded model")
        if not callable(getattr(model, "encode", None)):
            raise ConfigError(f"{self.what}: model must be a name, a folder or a loaded minfer "
                              f"model with an encoder, got {type(model).__name__}")
        self.model, self.column, self.error_column = model, column, error_column
        self._lock = threading.Lock()
        self.model.backend.num_threads = set_threads(self.num_threads)

    def rows(self, batch: Any) -> tuple[list[Any], list[str | None]]:
        """Each row's result (None where it failed) and error (None where it ran)."""
        values = _column(batch, self.column)
        results: list[Any] = [None] * len(values)
        errors: list[str | None] = [None] * len(values)
        texts = {}
        for i, v in enumerate(values):
            if isinstance(v, str):
                texts[i] = str(v)
            else:
                errors[i] = (f"column {self.column!r}: expected a string, got "
                             f"{type(v).__name__}" + (f" {v!r:.40}" if v is not None else ""))
        with self._lock:
            self._run(list(texts), texts, results, errors)
        return results, errors

    def _run(self, rows: list[int], texts: dict[int, str], results: list, errors: list) -> None:
        if not rows:
            return
        try:
            got = self.compute([texts[i] for i in rows])
        except MinferError as e:
            if len(rows) == 1:
                errors[rows[0]] = str(e)
                return
            half = len(rows) // 2
            self._run(rows[:half], texts, results, errors)
            self._run(rows[half:], texts, results, errors)
            return
        for i, value in zip(rows, got):
            results[i] = value

    def compute(self, texts: list[str]) -> list[Any]:
        raise NotImplementedError


class MinferEncoder(_RowActor):
    """`map_batches(MinferEncoder, ...)`: per-token encoder states of a text column.

    Adds `states_column` (each row's (T, C) float32 states: with a preset the pipeline's T and
    rule, without one the text's own tokens) and `mask_column` ((T,) int64: the preset
    pipeline's mask, else which positions hold the text's tokens), plus `error_column`. In a
    dict batch, when every row ran and the rows have one shape, the columns are (B, T, C) and
    (B, T) arrays (Ray Data's fixed-shape tensor columns, for Parquet); otherwise one object
    per row (None where it failed). A pyarrow batch gets nested lists.
    preset / max_length: as model.encode's. load_options: minfer.load's (tokenizer=,
    memory_limit=, encode_cache=, ...), for a name or folder.
    """

    what = "MinferEncoder"

    def __init__(self, model: Any, column: str = "text", *, preset: str | None = None,
                 max_length: int | None = None, states_column: str = "states",
                 mask_column: str = "attention_mask", error_column: str = "error",
                 num_threads: int | None = None, load_options: dict[str, Any] | None = None):
        super().__init__(model, column, {"states_column": states_column,
                                         "mask_column": mask_column}, error_column,
                         num_threads, load_options)
        if preset is not None:
            preset_named(preset, self.what)   # a bad preset fails the actor, not every row
        if self.model.tokenizer is None:
            raise ConfigError(f"{self.what}: {self.model.folder} has no tokenizer (load_options="
                              "{'tokenizer': FOLDER} gives a single file one)")
        self.preset, self.max_length = preset, max_length
        self.states_column, self.mask_column = states_column, mask_column

    def compute(self, texts: list[str]) -> list[Any]:
        if self.preset is not None:
            states, mask = self.model.encode(texts, preset=self.preset,
                                             max_length=self.max_length, return_mask=True)
            return list(zip(states, mask))
        cut = self.max_length is not None
        states, mask = self.model.encode(texts, max_length=self.max_length, truncation=cut,
                                         return_mask=True, padding_states=False)
        return [(s[:n], k[:n]) for s, k, n in zip(states, mask, mask.sum(axis=1))]

    def __call__(self, batch: Any) -> Any:
        results, errors = self.rows(batch)
        states = [None if r is None else r[0] for r in results]
        masks = [None if r is None else r[1] for r in results]
        if isinstance(batch, dict) and results and all(r is not None for r in results) \
                and len({s.shape for s in states}) == 1:
            out = dict(batch)
            out[self.states_column] = np.stack(states)              # (B, T, C)
            out[self.mask_column] = np.stack(masks)                 # (B, T)
            out[self.error_column] = np.full(len(results), None, dtype=object)
            return out
        if hasattr(batch, "column_names"):   # Arrow holds lists, not arrays
            states = [None if s is None else s.tolist() for s in states]
            masks = [None if m is None else m.tolist() for m in masks]
        return _with_columns(batch, {self.states_column: states, self.mask_column: masks,
                                     self.error_column: errors})


class MinferEmbedder(_RowActor):
    """`map_batches(MinferEmbedder, ...)`: sentence embeddings of a text column
    (model.embed: the folder's sentence-transformers head, or the mean of the states).

    Adds `output_column` ((E,) float32 per row; a (B, E) array in a dict batch where every row
    ran) and `error_column`. prompt_name / prompt / dimensions: as model.embed's.
    """

    what = "MinferEmbedder"

    def __init__(self, model: Any, column: str = "text", output_column: str = "embedding", *,
                 error_column: str = "error", prompt_name: str | None = None,
                 prompt: str | None = None, dimensions: int | None = None,
                 num_threads: int | None = None, load_options: dict[str, Any] | None = None):
        super().__init__(model, column, {"output_column": output_column}, error_column,
                         num_threads, load_options)
        self.output_column = output_column
        self.options = {"prompt_name": prompt_name, "prompt": prompt, "dimensions": dimensions}
        self.model.embed(["x"], **self.options)   # bad options fail the actor at once

    def compute(self, texts: list[str]) -> list[Any]:
        return list(self.model.embed(texts, **self.options))

    def __call__(self, batch: Any) -> Any:
        results, errors = self.rows(batch)
        if isinstance(batch, dict) and results and all(r is not None for r in results):
            out = dict(batch)
            out[self.output_column] = np.stack(results)                # (B, E)
            out[self.error_column] = np.full(len(results), None, dtype=object)
            return out
        if hasattr(batch, "column_names"):
            results = [None if r is None else r.tolist() for r in results]
        return _with_columns(batch, {self.output_column: results, self.error_column: errors})
