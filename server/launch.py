"""Start `python -m server` as a child process on a free loopback port and wait until it answers /health: what
the tests use to talk to a real uvicorn server, and handy for scripts that benchmark one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--parallel", "4"]) as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, args: list[str] = (), *, env: dict[str, str] | None = None, startup_timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(self.port),
                     "--no-progress", *args]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="qwen-jax-server-", suffix=".log", delete=False)

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, cwd=REPO_ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not answer /health within {self.startup_timeout:.0f}s:\n"
                           f"{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
