"""POST /v1/encode answered from the encode cache: server time of a repeated 512-token prompt.

    python benchmarks/bench_encode_cache.py [--widths 32,768,4096] [--repeats 50]

For each width a random one-layer T5 encoder of that d_model over the committed tiny vocabulary
(tests/factories.py, written into a temporary folder) is served (`minfer serve --encode-cache
1GiB`, a subprocess on 127.0.0.1), a 512-token prompt is sent once (the miss), then --repeats
times again (hits, checked through /metrics' minfer_encode_cache_hits_total). Server time is
the mean of minfer_request_duration_seconds{endpoint="encode"} over the repeats (arrival to the
last byte, the JSON body built and sent included); the client's wall time per request is
printed beside it. The answer is base64 float32 (preset flux): 512 x d_model x 4 bytes.

A hit is the input's answer kept in the cache as the whole body of a one-input request
(serve/encode.py): no tokenizing, no conversion, no base64, no join; what is left is the
worker hand-off and the write to the socket (uvicorn copies what the socket does not take at
once into its buffer: ~11 MB at d_model 4096).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from conftest import TINY_TOKENIZER  # noqa: E402
from factories import write_t5  # noqa: E402
from serve_process import serving  # noqa: E402

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)   # > 512 tokens


def histogram(server, name: str) -> float:
    import httpx
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf'^minfer_request_duration_seconds_{name}{{endpoint="encode"}} (\S+)$',
                      text, re.M)
    return float(found.group(1)) if found else 0.0


def run(width: int, repeats: int) -> None:
    import shutil
    folder = write_t5(Path(tempfile.mkdtemp()) / "m", vocab_size=600, d_model=width, d_kv=64,
                      num_heads=max(width // 64, 1), d_ff=64, num_layers=1, num_decoder_layers=1)
    for name in ("tokenizer.json", "spiece.model", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(TINY_TOKENIZER / name, folder / name)
    body = {"input": PROMPT, "preset": "flux", "encoding_format": "base64"}
    with serving(folder, "--encode-cache", "1GiB") as server, server.client() as http:
        assert http.post("/v1/encode", json=body).status_code == 200
        hits0, total0, count0 = (server.metrics()["minfer_encode_cache_hits_total"],
                                 histogram(server, "sum"), histogram(server, "count"))
        start = time.perf_counter()
        for _ in range(repeats):
            assert http.post("/v1/encode", json=body).status_code == 200
        wall = (time.perf_counter() - start) / repeats
        hits = server.metrics()["minfer_encode_cache_hits_total"] - hits0
        server_s = (histogram(server, "sum") - total0) / (histogram(server, "count") - count0)
    print(f"d_model {width}: {hits:.0f}/{repeats} hits, server {server_s * 1e3:.2f} ms, "
          f"client wall {wall * 1e3:.2f} ms per request ({512 * width * 4 / 2**20:.2f} MiB of "
          "states each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="32,768,4096")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    for width in map(int, args.widths.split(",")):
        run(width, args.repeats)


if __name__ == "__main__":
    main()
