"""Two "nodes" on this machine with a real link between them: two network namespaces joined by a
veth pair, shaped with `tc` (rate, delay), each with its own host name (`node-a`, `node-b`) and
a hosts file naming both, so that programs run in them see two hosts on a network.

    with TwoNodes(rate_mbit=1000) as nodes:
        proc = nodes.popen("node-a", ["torchrun", ...], env=...)

Only the namespaces, links and files this object made are touched, and they are removed on exit
whatever happens (an exception, a signal turned into one, the interpreter exiting). Needs root and
iproute2 (`ip`, `tc`) and util-linux (`unshare`): `why_not()` says what is missing, for a skip.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from pathlib import Path

HOSTS = ("node-a", "node-b")


def why_not() -> str | None:
    """Why the harness cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()[:120]}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoNodes:
    """`node-a` at 10.{net}.0.1 and `node-b` at 10.{net}.0.2 over a veth pair, each end shaped to
    `rate_mbit` (tbf) and `delay_ms` (netem) where given."""

    def __init__(self, rate_mbit: float | None = None, delay_ms: float | None = None, net: int = 77):
        tag = f"hf{os.getpid() % 100000}"
        self.ns = {h: f"{tag}-{h[-1]}" for h in HOSTS}
        self.dev = {h: f"{tag}{h[-1]}" for h in HOSTS}  # interface names: at most 15 characters
        self.addr = {h: f"10.{net}.0.{i + 1}" for i, h in enumerate(HOSTS)}
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        self._made: list[str] = []

    def __enter__(self) -> "TwoNodes":
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        a, b = HOSTS
        for h in HOSTS:
            _ip("netns", "add", self.ns[h])
            self._made.append(self.ns[h])
            etc = Path("/etc/netns") / self.ns[h]  # `ip netns exec` mounts these over /etc
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{self.addr[x]} {x}\n" for x in HOSTS))
        _ip("link", "add", self.dev[a], "netns", self.ns[a], "type", "veth", "peer", "name", self.dev[b],
            "netns", self.ns[b])
        for h in HOSTS:
            ns = ["-n", self.ns[h]]
            _ip(*ns, "addr", "add", f"{self.addr[h]}/24", "dev", self.dev[h])
            _ip(*ns, "link", "set", self.dev[h], "up")
            _ip(*ns, "link", "set", "lo", "up")
            self._shape(h)

    def _shape(self, host: str) -> None:
        if self.rate_mbit is None and self.delay_ms is None:
            return
        tc = ["ip", "netns", "exec", self.ns[host], "tc", "qdisc", "add", "dev", self.dev[host]]
        parent = ["root"]
        if self.delay_ms is not None:
            subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"], check=True,
                           capture_output=True)
            parent = ["parent", "1:1"]
        if self.rate_mbit is not None:
            burst = max(int(self.rate_mbit * 1e6 / 8 / 250), 16 * 1024)  # a 4 ms burst, at least 16 KiB
            subprocess.run([*tc, *parent, "tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst),
                            "latency", "50ms"], check=True, capture_output=True)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run in `host`'s namespace, under its host name."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "--", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *argv]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kw)

    def run(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kw)

    def close(self) -> None:
        for ns in reversed(self._made):  # removing a namespace removes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._made.clear()
