"""A real `keel serve` in a subprocess on a free loopback port, stopped by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx2 as httpx
import psutil
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_pid(self) -> int:
        kids = psutil.Process(self.proc.pid).children()
        (engine,) = [p for p in kids if "python" in p.name().lower()
                     and "resource_tracker" not in " ".join(p.cmdline())]
        return engine.pid

    def metrics(self) -> dict[str, float]:
        """The keel:* samples of /metrics as {name{labels}: value}."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line.startswith("keel:"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))


def start_server(model: str, *extra: str, api_key: str | None = API_KEY) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "keel.entrypoints.cli", "serve", model, "--port", str(port),
           "--dtype", "float32", "--served-model-name", MODEL_NAME, "--kv-cache-memory-gib",
           "0.25", "--uvicorn-log-level", "warning", *extra]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_API_KEY"}
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, env=env)
    server = Server(proc, port, api_key)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"keel serve exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError("keel serve did not become healthy within 120 s")


def stop_server(server: Server) -> None:
    """SIGINT (uvicorn's graceful stop, which stops the engine), then SIGKILL; then check that
    nothing the server started is left."""
    try:
        kids = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(kids, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind by keel serve: {alive}"


@pytest.fixture(scope="session")
def server(hf_model_dir):
    srv = start_server(hf_model_dir("llama"))
    yield srv
    stop_server(srv)
