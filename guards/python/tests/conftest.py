"""Fixtures: a real ``guardmesh serve`` process on 127.0.0.1 (port 0).

The binary is ``$GUARDMESH_BIN``, else the checkout's target/debug/guardmesh
(build it with ``cargo build --bin guardmesh``)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest


def guardmesh_bin() -> str:
    env = os.environ.get("GUARDMESH_BIN")
    if env:
        return env
    candidate = Path(__file__).resolve().parents[3] / "target" / "debug" / "guardmesh"
    if not candidate.exists():
        pytest.fail(f"no guardmesh binary: set GUARDMESH_BIN or build {candidate}")
    return str(candidate)


class Mesh:
    """One ``guardmesh serve`` process; ``addr`` is ``127.0.0.1:PORT``."""

    def __init__(self, config: str = "", workdir: Optional[str] = None):
        self.dir = workdir or tempfile.mkdtemp(prefix="guardmesh-pytest-")
        config_file = os.path.join(self.dir, "mesh.toml")
        with open(config_file, "w", encoding="utf-8") as out:
            out.write(config)
        self.process = subprocess.Popen(
            [guardmesh_bin(), "serve", "--config", config_file, "--listen", "127.0.0.1:0"],
            cwd=self.dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        found = threading.Event()
        self.addr = ""

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                self.log.append(line)
                match = re.search(r"guardmesh serving addr=(\S+)", line)
                if match and not found.is_set():
                    self.addr = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(30) or not self.addr:
            self.stop()
            raise RuntimeError("guardmesh serve did not start:\n" + "".join(self.log))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def mesh() -> Iterator[Mesh]:
    m = Mesh()
    yield m
    m.stop()


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """``guardmesh certs DIR``: a CA and certificates for the mesh, a
    coordinator, a registrar, an admin and a guard."""
    subprocess.run([guardmesh_bin(), "certs", str(tmp_path)], check=True,
                   stdout=subprocess.DEVNULL, timeout=60)
    return tmp_path


def wait_until(predicate: "object", timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients read GUARDMESH_TOKEN by default; tests give tokens explicitly."""
    monkeypatch.delenv("GUARDMESH_TOKEN", raising=False)
