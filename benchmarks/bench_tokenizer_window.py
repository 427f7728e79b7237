"""Time and peak memory of `encode_window(text, 64)`, from the start and from the end, against a
full `encode(text)` on a long prompt (issue 22: a 10 MB prompt took 20 s and 2.9 GB before its
"too long" error, even with truncation).

    python benchmarks/bench_tokenizer_window.py [--mb 10] [--t5 ../shared/t5-tokenizer]

Each measurement runs in its own process (peak RSS is a high-water mark): the prompt (English
sentences, ~4.5 characters per T5 token) is built first, then the call is timed once, and its
peak is the process's maximum RSS less what it was before the call. Sources: T5's tokenizer.json
and spiece.model (when --t5 has them), the committed ByT5 folder and the committed byte-level BPE.
A text this regular is the tokenizers' easy case; issue 22's 2.9 GB came from a real prompt.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = ROOT / "weights" / "tokenizers"
SENTENCE = "The committee said on Tuesday that the new bridge would open to traffic next spring. "


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def measure(folder: str, mb: float, mode: str, n: int) -> dict:
    """One call in this process: {seconds, peak_bytes, ids}."""
    sys.path.insert(0, str(ROOT))
    from minfer.tokenizers import load_tokenizer
    tok = load_tokenizer(folder)
    text = (SENTENCE * int(mb * 2**20 / len(SENTENCE) + 1))[:int(mb * 2**20)]
    tok.encode_window(SENTENCE, 4)                  # libraries loaded, caches warm
    before = _peak_bytes()
    start = time.perf_counter()
    ids = tok.encode(text, add_eos=False) if mode == "full" else \
        tok.encode_window(text, n, mode, add_eos=False)[0]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": max(0, _peak_bytes() - before), "ids": len(ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=10.0, help="prompt size in MiB")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--t5", type=Path, default=ROOT.parent / "shared" / "t5-tokenizer")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.mb, args.child[1], int(args.child[2]))))
        return 0
    sources = {"byt5": TOKENIZERS / "byt5", "roberta-bpe": TOKENIZERS / "roberta-bpe"}
    spiece = Path(tempfile.mkdtemp())          # the T5 files but tokenizer.json: spiece.model read
    if (args.t5 / "tokenizer.json").is_file():
        for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
            (spiece / name).symlink_to(args.t5 / name)
        sources = {"t5 tokenizer.json": args.t5, "t5 spiece.model": spiece, **sources}
    print(f"{args.mb:g} MiB prompt, n={args.n}")
    print(f"{'source':20} {'full s':>8} {'full MiB':>9} {'start s':>8} {'start MiB':>10} "
          f"{'end s':>8} {'end MiB':>8}")
    for name, folder in sources.items():
        row = []
        for mode in ("full", "start", "end"):
            out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb),
                                  "--child", str(folder), mode, str(args.n)],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            row += [result["seconds"], result["peak_bytes"] / 2**20]
        print(f"{name:20} {row[0]:8.2f} {row[1]:9.0f} {row[2]:8.4f} {row[3]:10.1f} "
              f"{row[4]:8.4f} {row[5]:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
