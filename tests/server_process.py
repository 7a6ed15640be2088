"""`hybridjit serve` as a process on a free localhost port, for the tests that talk to a real server."""

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)  # thread-safe

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples of /metrics, by name with labels."""
        text = httpx.get(self.url + "/metrics", timeout=60).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.MULTILINE)}

    def wait_for(self, condition, what: str, timeout: float = 60):
        """Polls condition(metrics) until it holds."""
        deadline = time.monotonic() + timeout
        while not condition(samples := self.metrics()):
            assert time.monotonic() < deadline, f"{what} did not happen: {samples}"
            time.sleep(0.05)

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024


@contextlib.contextmanager
def serve(log_dir: Path, *argv):
    """A running `python -m hybridjit serve --port PORT *argv` of this source tree, killed at the end."""
    port = free_port()
    log = log_dir / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridjit", "serve", "--quiet", "--port", str(port), *argv],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(proc, port, log)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not come up:\n{log.read_text()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        yield server
    finally:
        proc.kill()
        proc.wait()
