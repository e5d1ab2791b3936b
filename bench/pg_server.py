"""A throwaway PostgreSQL server (initdb into a temporary folder, its own port), for the fault
tests that crash one and for benchmarks that give one a CPU budget of its own
(`bench.replicas --postgres-cores`). Run as the `postgres` user when the caller is root
(PostgreSQL refuses root)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def pg_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (`initdb`, `pg_ctl`), if installed."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    for version in ("17", "16", "15", "14"):
        path = Path(f"/usr/lib/postgresql/{version}/bin")
        if (path / "pg_ctl").exists():
            return path
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Postgres:
    """One server: its programs, data folder, port and the user it runs as."""

    bin: Path
    data: Path
    port: int
    user: str | None
    fsync: bool = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            user=self.user,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.data.parent,
        )

    def init(self) -> None:
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-N")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        if not self.fsync:
            options += " -c fsync=off"
        done = self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.data / "log"), "-o", options, "-w",
            "start",
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {done.stdout}{done.stderr}{self.log()}")

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    def pids(self) -> list[int]:
        """The postmaster and the processes it has forked so far (later ones are its children,
        forked from it, so they start in whatever cgroup it is in)."""
        main = self.postmaster_pid()
        children = Path(f"/proc/{main}/task/{main}/children").read_text().split()
        return [main, *(int(c) for c in children)]

    def log(self) -> str:
        path = self.data / "log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")


def unavailable() -> str | None:
    """Why no throwaway server can run here, or None."""
    bin_dir = pg_bin()
    if bin_dir is None or not (bin_dir / "initdb").exists():
        return "no initdb/pg_ctl on this machine (PostgreSQL server binaries)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and no `postgres` user to run a PostgreSQL server as"
    return None


@contextmanager
def throwaway_postgres(*, fsync: bool = False) -> Iterator[Postgres]:
    """A started server of its own, stopped and deleted afterwards (`unavailable()` first)."""
    why = unavailable()
    bin_dir = pg_bin()
    if why is not None or bin_dir is None:
        raise RuntimeError(why)
    user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="cpn-pg-"))
    root.chmod(0o755)
    data = root / "data"
    data.mkdir(mode=0o700)
    if user is not None:
        shutil.chown(data, user, user)
        shutil.chown(root, user, user)
    server = Postgres(bin_dir, data, free_port(), user, fsync=fsync)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
