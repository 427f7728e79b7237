"""A `minfer serve` process for tests and benchmarks: started on 127.0.0.1 with a free port
(`--port 0`, read back from its output), ready once /health answers 200, stopped by its owner.
Every wait is bounded in time."""
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx


class Server:
    """`minfer serve ... --port 0` in a subprocess; its output goes to a file (a full pipe
    would stall it). Ready once /health answers 200."""

    def __init__(self, model, *args, startup=90):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minfer", "serve", "-m", str(model), "--host", "127.0.0.1",
             "--port", "0", "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup
        self.url = None
        while self.url is None:
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.output())
            if found:
                self.url = found.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not start:\n{self.output()}")
            else:
                time.sleep(0.05)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server never became healthy:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def client(self, **kwargs) -> "httpx.Client":
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def openai(self, key: str) -> "openai.OpenAI":
        """The official client (no retries: each request is one the test sees)."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r"^(minfer_\S+) (\S+)$", text, re.M)}

    def settle(self, seconds=30) -> dict[str, float]:
        """The metrics once nothing runs or waits (bounded in time)."""
        deadline = time.monotonic() + seconds
        while True:
            m = self.metrics()
            if m["minfer_requests_running"] == 0 and m["minfer_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, f"requests still in flight: {m}"
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, seconds=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise AssertionError(f"the server did not stop in {seconds} s:\n{self.output()}")
        return self.proc.returncode


@contextmanager
def serving(model, *args):
    """A Server of `model` for the with-block, stopped however the block ends."""
    server = Server(model, *args)
    try:
        yield server
    finally:
        server.stop()
