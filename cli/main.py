"""The command line: the click group and the console entry point, which turns every failure into
one line. Click commands only, one file per command (generate.py with bulk.py, embed.py, encode.py,
info.py, score.py, convert.py, serve.py), the options they share in common.py: parse, call minfer, print. No model
logic lives here.

Every failure is one line on stderr ("minfer: error: ...") and a non-zero exit: 1 for a problem
with the model or input, 2 for a bad command line, 130 on Ctrl-C. Set MINFER_DEBUG=1 to see the
traceback of an unexpected error. Bare `minfer` prints the help on stdout and exits 2 (no command:
click's status for a group called without one). A reader that leaves early (`minfer generate ... |
head -1`) ends the run quietly with status 0; a stdout closed from the start (`>&-`) is "stdout is
closed" when there is something to print (with stderr closed too, the status alone). Text input
(stdin, `score FILE`) must be UTF-8: an invalid byte is named by its offset.
"""

from __future__ import annotations

import os
import sys

import click

from .common import (EXIT_INTERRUPT, EXIT_USAGE, ClosedStdout, OutputFailed, exit_on_closed_pipe,
                     fail, writing)
from .convert import convert
from .embed import embed
from .encode import encode
from .generate import generate
from .info import info
from .score import score
from .serve import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="minfer")
def cli() -> None:
    """minfer: framework-free T5 and Transformer-XL inference and T5 sentence embeddings."""


for command in (generate, embed, encode, info, score, convert, serve):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run click without its own exit handling, so every error is one line."""
    from minfer.errors import MinferError
    if sys.stdout is None:   # started with stdout closed: printing to it is one line (a closed
        sys.stdout = ClosedStdout()   # stderr stays None: click prints nothing, the status says)
    try:
        if not (sys.argv[1:] if argv is None else argv):
            # the whole help, as help (not squeezed into one error line), and the usage status
            with cli.make_context("minfer", [], resilient_parsing=True) as ctx:
                click.echo(cli.get_help(ctx))
            sys.exit(EXIT_USAGE)
        cli.main(args=argv, prog_name="minfer", standalone_mode=False)
        with writing("stdout"):   # what is still buffered: a full disk is named now, not at exit
            sys.stdout.flush()
    except OutputFailed as e:
        fail(str(e))
    except click.exceptions.Exit as e:  # --help / --version
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("minfer: interrupted", err=True)
        sys.exit(EXIT_INTERRUPT)
    except click.ClickException as e:
        fail(e.format_message(), EXIT_USAGE)
    except MinferError as e:
        fail(str(e))
    except MemoryError as e:  # the machine's memory, not a bug: say what to lower
        fail(f"out of memory: {e} (lower --workspace, --memory-limit, the batch or the lengths)")
    except KeyboardInterrupt:
        click.echo("\nminfer: interrupted", err=True)
        sys.exit(EXIT_INTERRUPT)
    except BrokenPipeError:  # e.g. piped into `head`, outside a command
        exit_on_closed_pipe()
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("MINFER_DEBUG"):
            raise
        fail(f"unexpected {type(e).__name__}: {e} (set MINFER_DEBUG=1 for the traceback)")


if __name__ == "__main__":
    main()