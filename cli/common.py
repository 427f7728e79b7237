"""What every command shares: exit statuses, one-line failures, closed pipes, UTF-8 input, and
the model options (declared once here; `with_model_options` gives a command all of them as one
`ModelOptions` argument, which `load_model` turns into `minfer.load`'s call).

Every failure is one line on stderr ("minfer: error: ...") and a non-zero exit: 1 for a problem
with the model or input, 2 for a bad command line, 130 on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, Iterator, Mapping

import click

from minfer.io.formats import INT4_GROUP

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPT = 0, 1, 2, 130


def fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"minfer: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def exit_on_closed_pipe() -> None:
    """The reader of stdout went away: nothing is wrong, stop quietly. stdout is pointed at
    /dev/null so that the interpreter's last flush cannot fail again (the Python docs' recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_OK)


def quiet_on_closed_pipe(command):
    """Click turns EPIPE inside a command into exit status 1; catch it first (see above)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            exit_on_closed_pipe()
    return run


class OutputFailed(Exception):
    """Writing an output failed (a full disk, a device that refuses): its message names it."""


class ClosedStdout(io.TextIOBase):
    """sys.stdout when the process started with it closed (`>&-`: Python sets it to None, and
    click then drops what is printed while a flush fails on None): a write is one line saying
    so; nothing written, nothing wrong (bulk output to a file). Its `buffer` is itself."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if data:
            raise OutputFailed("stdout is closed (nowhere to print the output)")
        return 0

    @property
    def buffer(self) -> ClosedStdout:
        return self


@contextlib.contextmanager
def writing(name: str) -> Iterator[None]:
    """Writes to the output `name` (a path, or "stdout") inside the block: an OSError from them
    becomes one line naming it (a reader that went away stays the quiet BrokenPipeError)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputFailed(f"{name}: cannot write: {e.strerror or e}") from None


def emit(text: str = "", nl: bool = True) -> None:
    """Print to stdout, flushed, a failure named (see `writing`)."""
    with writing("stdout"):
        click.echo(text, nl=nl)
        sys.stdout.flush()


def read_text(stream: BinaryIO, name: str) -> str:
    r"""All of a byte stream as UTF-8 text, newlines normalised as text mode would (\r\n, \r ->
    \n); an invalid byte is a one-line error naming the stream and the byte's offset."""
    data = stream.read()
    if isinstance(data, str):  # a text stream without .buffer (an embedding program's stdin)
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{name}: not valid UTF-8 at byte {e.start} ({data[e.start:e.start + 1]!r}: {e.reason})")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# -- the model options --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelOptions:
    """How to load the model: what every command that loads one accepts."""
    model: str
    revision: str | None
    device: str
    dtype: str | None
    workspace: str | None
    compute: str | None
    memory_limit: str | None
    offline: bool
    threads: int | None
    subfolder: str | None = None
    tokenizer_subfolder: str | None = None
    parts: str | None = None
    config: str | None = None
    tokenizer: str | None = None


_MODEL_OPTIONS = [
    click.option("--model", "-m", required=True, metavar="NAME_OR_PATH",
                 help="Hub name (t5-small, google/flan-t5-base, ...), a local folder in the HF "
                      "layout, or one .safetensors file of a T5 / UMT5 encoder (e.g. ComfyUI's "
                      "t5xxl_fp8_e4m3fn_scaled.safetensors; config inferred from its tensors)."),
    click.option("--revision", default=None, help="Hub revision (branch, tag or commit)."),
    click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto."),
    click.option("--dtype", default=None, metavar="DTYPE",
                 help="How weights are stored: float32 (CPU default), float16 (CUDA default), "
                      "bfloat16, int8 (one scale per output channel), int4 (CPU; one scale per "
                      f"{INT4_GROUP} input channels), int8g32 / int8g16 / int4g32 / int4g16 (CPU; "
                      "a GGUF file's blocks), float8_e4m3 / float8_e5m2 (CPU; an fp8 file's codes) "
                      "or auto (as the checkpoint stores them; fp8 and GGUF files load in the "
                      "most compact format that holds them exactly)."),
    click.option("--compute", default=None, metavar="MODE",
                 help="What products compute in: CPU float32 (default), int8 (int8/int4 "
                      "weights or GGUF's int8g blocks x inputs rounded to int8, on VNNI where "
                      "the CPU has it) or bfloat16 (bfloat16 weights or fp8 codes x inputs "
                      "rounded to bfloat16; the default for bfloat16 weights on a CPU with "
                      "AVX512_BF16); CUDA float16 (default) or float32."),
    click.option("--workspace", default=None, metavar="SIZE",
                 help="Arena size for activations and caches, e.g. 512MiB  [default: 1GiB]; with "
                      "--memory-limit, the part of the limit kept for them."),
    click.option("--memory-limit", default=None, metavar="SIZE",
                 help="Whole memory budget incl. weights, e.g. 2GiB: layers that do not fit are "
                      "streamed in as needed."),
    click.option("--offline", is_flag=True, help="Use only the local cache; never contact the hub."),
    click.option("--threads", type=click.IntRange(min=1), default=None,
                 help="CPU threads for the model's work  [default: the cores this process may use]."),
    click.option("--subfolder", default=None, metavar="FOLDER",
                 help="The model's folder inside the repo or local folder, e.g. text_encoder_2."),
    click.option("--tokenizer-subfolder", default=None, metavar="FOLDER",
                 help="Read the tokenizer from this folder of the same repo, e.g. tokenizer_2."),
    click.option("--parts", type=click.Choice(["all", "encoder"]), default=None,
                 help="Load only the encoder of a full T5 checkpoint (encode / embed), or all  "
                      "[default: what the folder holds; a single file: encoder]."),
    click.option("--config", default=None, metavar="PATH",
                 help="A single file's config.json (or a folder holding one) instead of the "
                      "config inferred from its tensors."),
    click.option("--tokenizer", default=None, metavar="FOLDER",
                 help="A folder with the tokenizer files to use (a single file has none)."),
]
_MODEL_FIELDS = [f.name for f in fields(ModelOptions)]


def with_model_options(command):
    """Give a command the model options, passed to it as one `load: ModelOptions` argument."""
    @functools.wraps(command)
    def run(**kwargs):
        load = ModelOptions(**{name: kwargs.pop(name) for name in _MODEL_FIELDS})
        return command(load=load, **kwargs)
    for option in reversed(_MODEL_OPTIONS):
        run = option(run)
    return run


# load()'s arguments that a model option sets: a ConfigError that begins with one of them is
# about that option's value (minfer.load checks them before it reads any weights)
_LOAD_ARGUMENTS = {"device": "--device", "dtype": "--dtype", "compute": "--compute",
                   "workspace": "--workspace", "memory_limit": "--memory-limit",
                   "num_threads": "--threads", "revision": "--revision",
                   "subfolder": "--subfolder", "tokenizer_subfolder": "--tokenizer-subfolder",
                   "parts": "--parts", "config": "--config", "tokenizer": "--tokenizer"}


def load_model(opts: ModelOptions) -> Any:
    """minfer.load with the model options; a bad option value is a usage error naming its
    flag (status 2), as click's own checks are."""
    import minfer
    try:
        return minfer.load(opts.model, device=opts.device, dtype=opts.dtype,
                           revision=opts.revision, workspace=opts.workspace,
                           compute=opts.compute, memory_limit=opts.memory_limit,
                           offline=True if opts.offline else None, num_threads=opts.threads,
                           subfolder=opts.subfolder,
                           tokenizer_subfolder=opts.tokenizer_subfolder, parts=opts.parts,
                           config=opts.config, tokenizer=opts.tokenizer)
    except minfer.ConfigError as e:
        if re.match(rf"({'|'.join(_LOAD_ARGUMENTS)})\b[ :=]", str(e)):
            fail(with_flags(str(e), _LOAD_ARGUMENTS), EXIT_USAGE)
        raise


def with_flags(message: str, flags: Mapping[str, str]) -> str:
    """A library message about options with their Python names written as the command line's
    flags ("min_new_tokens (9) exceeds max_new_tokens (3)" -> "--min-new-tokens (9) exceeds
    --max-new-tokens (3)"): every name with an underscore, and a plain word (task, dtype) where
    it is the message's subject (its start) or a keyword (dtype='int8'), not where it is English
    ("the model's prompts"). Names inside formulas (1/temperature, |length_penalty|) or quotes
    stay as they are."""
    from minfer.generation.prompts import TRUNCATION_CURE
    message = message.replace("do_sample=False", "--greedy").replace("do_sample=True",
                                                                     "--do-sample")
    message = message.replace(TRUNCATION_CURE, "--truncate cuts it")
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))

    def flag(m: re.Match) -> str:
        name = m.group(1)
        keyword = message.startswith("=", m.end())
        return flags[name] if "_" in name or m.start() == 0 or keyword else name
    return re.sub(rf"(?<![\w*|/('.-])({names})(?![\w*|'])", flag, message)


def command_flags(**renamed: str) -> dict[str, str]:
    """The running command's options: Python name -> its long flag; `renamed` adds the names a
    library call gives some of them (truncation="truncate": the --truncate flag)."""
    flags = {}
    for param in click.get_current_context().command.params:
        if isinstance(param, click.Option) and param.name:
            flags[param.name] = max(param.opts, key=len)
    return {**flags, **{name: flags[param] for name, param in renamed.items()}}
