"""Two "hosts" on one machine for the reliability suite: Linux network namespaces joined by a veth pair.

Each namespace has its own address (`ADDR`), loopback and port space; the test cuts the link between them
(`Hosts.link(up=False)`: packets vanish, no connection is reset) or loses a host (`Hosts.kill`: every
process in it). Needs root and iproute2; `two_hosts` skips the test elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT

ADDR = {"a": "10.213.0.1", "b": "10.213.0.2"}
DEADLINE_S = 600  # generous: a loaded 2-core machine; a wait this long is a hang


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=60)


class Hosts:
    """Two network namespaces joined by a veth pair; each end is named after its namespace."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns = {h: f"df{h}{tag}" for h in ADDR}

    def create(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for h, ns in self.ns.items():
            _ip("link", "set", ns, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDR[h]}/24", "dev", ns)
            _ip("-n", ns, "link", "set", ns, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, up: bool) -> None:
        _ip("-n", self.ns["a"], "link", "set", self.ns["a"], "up" if up else "down")

    def pids(self, h: str) -> list[int]:
        run = subprocess.run(["ip", "netns", "pids", self.ns[h]], capture_output=True, text=True, timeout=60)
        return [int(p) for p in run.stdout.split()]

    def kill(self, h: str) -> None:
        """SIGKILL every process in host `h` (the node is lost), then wait until none is left."""
        deadline = time.monotonic() + DEADLINE_S
        while pids := self.pids(h):
            assert time.monotonic() < deadline, f"processes left in {self.ns[h]}: {pids}"
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)  # polling until the kernel has reaped them

    def destroy(self) -> None:
        for h, ns in self.ns.items():
            self.kill(h)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)

    def start(self, h: str, cmd: list[str], log: Path, cwd: Path = ROOT, **env: str) -> subprocess.Popen:
        """`cmd` in host `h` (its own process group), its output appended to `log`."""
        env = os.environ | {"PET_LOCAL_ADDR": ADDR[h], "GLOO_SOCKET_IFNAME": self.ns[h], "OMP_NUM_THREADS": "1",
                            "PYTHONUNBUFFERED": "1", **env}
        with open(log, "a") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[h], *cmd], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (`ip netns`, veth) to build the two hosts")
    hosts = Hosts()
    try:
        hosts.create()
    except subprocess.CalledProcessError as exc:
        hosts.destroy()
        pytest.skip(f"no network namespaces here: {exc.stderr.strip()}")
    try:
        yield hosts
    finally:
        hosts.destroy()


def wait_listening(proc: subprocess.Popen, port: int) -> None:
    """Until something in `proc`'s namespace listens on `port` (its /proc/<pid>/net/tcp*: that namespace's)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and proc.poll() is None:
        for table in ("tcp", "tcp6"):
            rows = Path(f"/proc/{proc.pid}/net/{table}").read_text().splitlines()[1:]
            if any(r.split()[3] == "0A" and int(r.split()[1].rsplit(":", 1)[1], 16) == port for r in rows):
                return
        time.sleep(0.1)  # polling a condition, not waiting a fixed time
    raise AssertionError(f"node B never listened on {port}")
