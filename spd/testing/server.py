"""``spd-serve`` in its own process, started as a user starts it, for the tests and ``spd-bench serve``.

The server listens on a free port (``--port 0``) and prints its address on stderr; :class:`ServerProcess` reads
stderr up to that line, then a thread keeps reading it (``lines``) so that the server never blocks on a full pipe.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


class ServerProcess:
    """``spd-serve`` (``python -m spd.cli.serve``) in its own process on a free port: ``url`` once it listens,
    ``model`` the name it serves, ``lines`` its stderr so far."""

    def __init__(
        self,
        *args: str,
        timeout: float = 300,
        threads: int = 1,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        cwd: str | Path | None = None,
        program: Sequence[str] = ("-m", "spd.cli.serve"),
    ):
        """``args``: spd-serve's flags; ``threads``: its OMP_NUM_THREADS; ``env``: more of its environment;
        ``api_key``: the key it requires, if any; ``program``: what the interpreter runs (``-c SCRIPT`` for a
        server started through the Python API)."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.api_key = api_key
        self.proc = subprocess.Popen(
            [sys.executable, *program, "--port", "0", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.url = None
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                break
        if self.url is None:
            self.stop()
            raise RuntimeError("spd-serve did not start:\n" + "".join(self.lines))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = httpx.get(f"{self.url}/v1/models", headers=auth).json()["data"][0]["id"]

    def stop(self) -> None:
        """Ctrl-C (SIGINT), as a user stops it; SIGKILL if it has not exited a minute later."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
