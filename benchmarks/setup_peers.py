"""Prepare the peers bench_suite.py compares minfer with, beyond transformers and CTranslate2:
ONNX Runtime (fp32, and dynamic int8) and llama.cpp (f32, f16, q8_0, q4_0). Dev-only, never CI.

    python benchmarks/setup_peers.py [--shapes t5-small,t5-base] [--peers onnxruntime,llama.cpp]
                                     [--tokenizer DIR] [--llama-cpp-python 0.3.36] [--jobs 2]

Everything it makes goes under benchmarks/peers/ (git-ignored) and is reused by later runs:
- onnxruntime: `optimum-cli export onnx --task text2text-generation-with-past` of the suite's
  random checkpoint (benchmarks/checkpoints/<shape>, made by bench_t5.py) into
  peers/<shape>-onnx-fp32/, then `optimum-cli onnxruntime quantize --avx512_vnni` (dynamic int8:
  weights int8 per channel, activations quantised at run time; the VNNI configuration, what
  ONNX Runtime recommends for CPUs with VNNI) into peers/<shape>-onnx-int8/. Needs the dev venv
  plus `pip install "optimum-onnx[onnxruntime]"` (checked with optimum-onnx 0.1.0, onnxruntime
  1.32.0, transformers 4.57.6).
- llama.cpp: the llama-cpp-python sdist (PyPI; it carries llama.cpp's tree in vendor/) is
  downloaded with pip, llama.cpp is built (Release, native CPU, static libraries) with
  llama-quantize, and benchmarks/llama_t5_driver.cpp is compiled against it. Each checkpoint is
  converted with the tree's convert_hf_to_gguf.py (f32 and f16, from a folder that links the
  weights and adds the public T5 tokenizer, as for CTranslate2: the converter needs
  spiece.model) and quantised to q8_0 and q4_0 with llama-quantize. The converter runs with the
  dev venv's packages and the tree's gguf-py on PYTHONPATH, not its requirements file: that pins
  protobuf<5, which breaks sentencepiece 0.2.3.
Needs cmake, a C++17 compiler and network access to PyPI (nothing else).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_t5 as b5  # noqa: E402

PEERS = HERE / "peers"
LLAMA_CPP_PYTHON = "0.3.36"
DRIVER_SOURCE = HERE / "llama_t5_driver.cpp"
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")


def run(command: list[str], **kwargs) -> None:
    print("+ " + " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], check=True, **kwargs)


def tool(name: str) -> str:
    """A console script of this interpreter's environment (or PATH's)."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else name


# -- ONNX Runtime ------------------------------------------------------------------------------------
def onnx_folders(shape: str) -> dict[str, Path]:
    return {"fp32": PEERS / f"{shape}-onnx-fp32", "int8": PEERS / f"{shape}-onnx-int8"}


def ensure_onnx(shape: str) -> dict[str, Path]:
    model_dir = b5.ensure_checkpoint(shape)
    out = onnx_folders(shape)
    if not list(out["fp32"].glob("decoder*model*.onnx")):
        run([tool("optimum-cli"), "export", "onnx", "--model", model_dir,
             "--task", "text2text-generation-with-past", out["fp32"]])
    if not list(out["int8"].glob("*.onnx")):
        run([tool("optimum-cli"), "onnxruntime", "quantize", "--onnx_model", out["fp32"],
             "--avx512_vnni", "-o", out["int8"]])
        for name in ("config.json", "generation_config.json"):   # quantize copies only the graphs
            if (out["fp32"] / name).is_file() and not (out["int8"] / name).is_file():
                shutil.copyfile(out["fp32"] / name, out["int8"] / name)
    return out


# -- llama.cpp ----------------------------------------------------------------------------------------
def llama_tree(version: str) -> Path:
    """llama.cpp's source tree from the llama-cpp-python sdist (downloaded once)."""
    root = PEERS / f"llama_cpp_python-{version}"
    tree = root / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    PEERS.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
         f"llama-cpp-python=={version}", "-d", PEERS])
    archive = PEERS / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(PEERS, filter="data")
    return tree


def llama_build(tree: Path, jobs: int) -> dict[str, Path]:
    """Build libllama, llama-quantize and the driver (static, native CPU); their paths."""
    build = PEERS / "llama-build"
    quantize = build / "bin" / "llama-quantize"
    if not quantize.is_file():
        run(["cmake", "-S", tree, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
             "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON"])
        run(["cmake", "--build", build, "--target", "llama", "llama-quantize", "-j", str(jobs)])
    driver = PEERS / "llama_t5_driver"
    if not driver.is_file() or driver.stat().st_mtime < DRIVER_SOURCE.stat().st_mtime:
        libs = [next(build.rglob(name)) for name in
                ("libllama.a", "libggml.a", "libggml-cpu.a", "libggml-base.a")]
        run(["c++", "-O2", "-std=c++17", DRIVER_SOURCE, "-I", tree / "include",
             "-I", tree / "ggml" / "include", *libs, "-fopenmp", "-lpthread", "-ldl",
             "-o", driver])
    return {"quantize": quantize, "driver": driver}


def gguf_files(shape: str) -> dict[str, Path]:
    return {t: PEERS / f"{shape}-{t}.gguf" for t in GGUF_TYPES}


def ensure_gguf(shape: str, tree: Path, quantize: Path, tokenizer: Path) -> dict[str, Path]:
    model_dir = b5.ensure_checkpoint(shape)
    out = gguf_files(shape)
    source = PEERS / f"{shape}-gguf-source"      # the weights linked, the tokenizer added
    source.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not (source / name).exists():
            (source / name).symlink_to(model_dir.resolve() / name)
    for name in b5.TOKENIZER_FILES:
        if not (source / name).is_file():
            shutil.copyfile(tokenizer / name, source / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for kind in ("f32", "f16"):
        if not out[kind].is_file():
            run([sys.executable, tree / "convert_hf_to_gguf.py", source, "--outfile", out[kind],
                 "--outtype", kind], env=env)
    for kind in ("q8_0", "q4_0"):
        if not out[kind].is_file():
            run([quantize, out["f32"], out[kind], kind.upper()])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(b5.SHAPES))
    p.add_argument("--peers", default="onnxruntime,llama.cpp")
    p.add_argument("--tokenizer", type=Path, default=b5.DEFAULT_TOKENIZER,
                   help="folder with the public T5 tokenizer files (for the GGUF converter)")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON,
                   help="the sdist whose vendored llama.cpp is built")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    peers = {x for x in args.peers.split(",") if x}
    if "llama.cpp" in peers:
        tree = llama_tree(args.llama_cpp_python)
        built = llama_build(tree, args.jobs)
    for shape in shapes:
        if "onnxruntime" in peers:
            print(f"{shape}: ONNX Runtime -> {ensure_onnx(shape)}", flush=True)
        if "llama.cpp" in peers:
            files = ensure_gguf(shape, tree, built["quantize"], args.tokenizer)
            print(f"{shape}: llama.cpp -> {files}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
