"""The words the CLI and the package say are true (issue 30, item 17): the int4 group size, the
layer counts and the fits verdict of `minfer info`, the plan's printed summary, the package's
public namespace, and the names docstrings and comments point at."""
import importlib.util
import re
import types
from pathlib import Path


from test_cli_resume import FAMILY
from test_fuzz_inputs import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_int4_help_and_docs_give_the_group_size_the_code_uses():
    import minfer
    from minfer.io.formats import INT4_GROUP
    for command in ("generate", "embed", "info", "convert"):
        code, out, _ = run_cli([command, "--help"])
        text = " ".join(out.split())
        assert code == 0, out
        assert (f"per {INT4_GROUP} input channels" in text
                or f"group of {INT4_GROUP} input channels" in text), (command, text)
        assert not re.search(r"(per|group of) (?!%d)\d+ input channels" % INT4_GROUP, text)
    assert f"group of {INT4_GROUP} input" in " ".join(minfer.load.__doc__.split())


def info(*args):
    code, out, err = run_cli(["info", *map(str, args)])
    assert code == 0, err
    return dict(re.match(r"(.+?)\s{2,}(.*)", line).groups() for line in out.splitlines())


def test_info_counts_layers_per_stack():
    import json
    config = json.loads((FAMILY / "deeper_decoder" / "config.json").read_text())
    enc, dec = config["num_layers"], config["num_decoder_layers"]
    got = info("-m", FAMILY / "deeper_decoder")
    # T5's cross stack: each decoder layer's cross-attention k|v, placed apart from its layer
    units = f"{enc + 2 * dec} units: encoder {enc}, cross {dec}, decoder {dec}"
    assert got["layer weights"].endswith(" in " + units)
    assert got["resident layers"].startswith(f"{enc + 2 * dec} units (")
    assert got["resident layers"].endswith(f"): encoder {enc}, cross {dec}, decoder {dec}")
    assert got["streamed layers"] == "none"


def test_info_says_whether_the_run_fits_the_arena(text_model_folder):
    big = info("-m", text_model_folder, "--batch", 8, "--src-len", 100000)
    need = next(v for k, v in big.items() if k.startswith("workspace for ")).split(" (")[0]
    assert big["fits"] == (f"no: needs {need}, the arena has {big['arena capacity']} free (raise "
                           "--workspace or --memory-limit, or lower --batch or the lengths)")
    small = info("-m", text_model_folder, "--batch", 1, "--src-len", 8)
    need = next(v for k, v in small.items() if k.startswith("workspace for ")).split(" (")[0]
    assert small["fits"] == f"yes: {need} of the {small['arena capacity']} free in the arena"


def test_weight_plan_summary_prints_aligned_lines(text_model):
    summary = text_model.weight_plan.summary()
    assert list(summary) and all(isinstance(k, str) and isinstance(v, str) for k, v in summary)
    width = max(len(k) for k, _ in summary)
    assert str(summary) == "\n".join(f"{k.ljust(width)}  {v}" for k, v in summary)
    assert not str(summary).startswith("[")


def test_the_package_namespace_holds_only_its_public_names():
    import minfer
    public = {n for n in vars(minfer) if not n.startswith("_")}
    submodules = {n for n in public if isinstance(getattr(minfer, n), types.ModuleType)
                  and getattr(minfer, n).__name__ == f"minfer.{n}"}
    assert public - submodules == set(minfer.__all__) - submodules, \
        sorted(public - submodules ^ set(minfer.__all__) - submodules)
    for name in minfer.__all__:
        assert hasattr(minfer, name), name
    # every minfer.X the README names is there (a submodule may need importing)
    for name in set(re.findall(r"\bminfer\.([A-Za-z_]\w*)", (ROOT / "README.md").read_text())):
        assert name in minfer.__all__ or importlib.util.find_spec(f"minfer.{name}"), name


def test_reorder_docstrings_name_what_plans_the_scratch():
    import minfer
    from minfer.models.t5 import buffers as t5_buffers, math as t5_math
    from minfer.models.transfo_xl import math as xl_math
    from test_cli import XL_BIN
    assert "`buffers.reorder_elements`" in t5_math.reorder_state.__doc__
    assert callable(t5_buffers.reorder_elements)
    assert "`reorder_scratch`" in xl_math.reorder_memory.__doc__
    assert "reorder_scratch" in minfer.load(XL_BIN).plan(2, 8, 4)   # the part of XL's plan


def test_pyproject_names_the_files_that_draw_progress_bars():
    text = (ROOT / "pyproject.toml").read_text()
    comment = text[:text.index('"tqdm')].rsplit('"huggingface_hub', 1)[1]
    named = set(re.findall(r"cli/\w+\.py", comment))
    using = {f"cli/{p.name}" for p in (ROOT / "cli").glob("*.py") if "from tqdm" in p.read_text()}
    assert named == using and named
