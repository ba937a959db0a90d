"""An emulated cluster on one Linux machine: hosts as network namespaces on shaped links.

Each host is a network namespace with an interface `eth0` (Horovod needs one interface name
on every host) on a bridge, an address in the benchmarking range 198.18.0.0/15, its own
host name (a UTS namespace) resolved by every host's hosts file (`/etc/netns/<ns>/hosts`;
Gloo finds its peers by host name), and an sshd with a key made for this cluster. Each
link is shaped with `tc tbf` in both directions to the given rate (netem is not available
in every kernel). Then `run(...)` starts a command in the first host, exactly as a user
logged in there would: `horovodrun -np 4 -H h1:2,h2:2 python train.py` reaches the other
hosts over ssh. The root-side veth counters give each host's bytes on the wire.

Needs root, iproute2 (`ip`, `tc`), `unshare` and OpenSSH's sshd. Everything it makes is
named after `name` and removed by `down()`, also after a failure, and by `python -m
tfpar.testing.emulate down NAME` after a crash:

    with EmulatedCluster(hosts=2, rate="100mbit") as cluster:
        proc = cluster.run(["horovodrun", "-np", "4", "-H", cluster.hosts_arg(2), ...])
        print(cluster.wire_bytes())

No TensorFlow here: it is a test and benchmark tool, not part of a job.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

NETNS_ETC = "/etc/netns"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` failed: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class EmulatedCluster:
    """`hosts` namespaces `<name>h1..` joined by a bridge, links at `rate` (tc syntax, e.g.
    "100mbit", "1gbit"), addresses 198.18.<subnet>.1.. (host names h1, h2, ...)."""

    def __init__(self, hosts: int = 2, rate: str = "1gbit", name: str = "tfpe",
                 subnet: int = 0, burst: str = "512kb"):
        if not 1 <= hosts <= 200:
            raise ValueError("an emulated cluster has 1 to 200 hosts")
        if len(name) > 6 or not name.isalnum():
            raise ValueError("name: up to 6 letters or digits (interface names are short)")
        self.num_hosts, self.rate, self.name, self.burst = hosts, rate, name, burst
        self.names = [f"h{i + 1}" for i in range(hosts)]
        self.addresses = [f"198.18.{subnet}.{i + 1}" for i in range(hosts)]
        self.namespaces = [f"{name}{h}" for h in self.names]
        self.bridge = f"{name}br"
        self.workdir = os.path.join(tempfile.gettempdir(), f"tfpar-emulated-{name}")
        self.key = os.path.join(self.workdir, "id_ed25519")

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self) -> "EmulatedCluster":
        """Creates the hosts (after removing any leftovers of a cluster of this name)."""
        if os.geteuid() != 0:
            raise RuntimeError("an emulated cluster needs root (network namespaces, tc)")
        if not os.path.exists(SSHD):
            raise RuntimeError("an emulated cluster needs OpenSSH's sshd (apt-get install "
                               "openssh-server)")
        self.down()
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self):
        os.makedirs(self.workdir, mode=0o700)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
            os.path.join(self.workdir, "host_key"))
        shutil.copy(self.key + ".pub", os.path.join(self.workdir, "authorized_keys"))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for i, (ns, host, addr) in enumerate(zip(self.namespaces, self.names, self.addresses)):
            outside, inside = self._veth(i), f"{self.name}p{i + 1}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _sh("ip", "link", "set", inside, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", inside, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/16", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "link", "set", outside, "master", self.bridge)
            _sh("ip", "link", "set", outside, "up")
            self._shape(ns, outside)
            etc = os.path.join(NETNS_ETC, ns)
            os.makedirs(os.path.join(etc, "ssh"), exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            with open(os.path.join(etc, "hostname"), "w") as f:
                f.write(host + "\n")
            # `ip netns exec` mounts this folder over /etc/ssh: the ssh client of every
            # process in the host uses the cluster's key and keeps no known_hosts.
            with open(os.path.join(etc, "ssh", "ssh_config"), "w") as f:
                f.write(f"Host *\n  IdentityFile {self.key}\n  UserKnownHostsFile /dev/null\n"
                        "  StrictHostKeyChecking no\n  LogLevel ERROR\n  BatchMode yes\n")
            self._start_sshd(ns, host, addr)
        for ns, addr in zip(self.namespaces, self.addresses):
            self._wait_ssh(ns, addr)

    def _veth(self, i: int) -> str:
        return f"{self.name}v{i + 1}"

    def _shape(self, ns: str, outside: str, verb: str = "add"):
        """Rate-limits both directions of a host's link: its uploads leave through eth0
        inside the namespace, its downloads through the bridge-side veth."""
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "eth0", "root", *tbf)
        _sh("tc", "qdisc", verb, "dev", outside, "root", *tbf)

    def set_rate(self, rate: str):
        """Reshapes every host's link (both directions) to `rate`, e.g. "100mbit"."""
        self.rate = rate
        for i, ns in enumerate(self.namespaces):
            self._shape(ns, self._veth(i), verb="replace")

    def _start_sshd(self, ns: str, host: str, addr: str):
        w = self.workdir
        options = [f"ListenAddress={addr}", "Port=22", f"PidFile={w}/sshd-{host}.pid",
                   f"HostKey={w}/host_key", f"AuthorizedKeysFile={w}/authorized_keys",
                   "StrictModes=no", "UsePAM=no", "PermitRootLogin=prohibit-password",
                   "PasswordAuthentication=no", "AcceptEnv=*", "LogLevel=ERROR",
                   "PermitUserEnvironment=no"]
        os.makedirs("/run/sshd", exist_ok=True)
        sshd = " ".join([SSHD, "-f", "/dev/null"] + [f"-o {o}" for o in options])
        _sh("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
            f"hostname {host}; exec {sshd}")

    def _wait_ssh(self, ns: str, addr: str, timeout: float = 20.0):
        deadline = time.time() + timeout
        while True:
            p = _sh("ip", "netns", "exec", ns, "ssh", addr, "true", check=False, timeout=20)
            if p.returncode == 0:
                return
            if time.time() > deadline:
                raise RuntimeError(f"emulated host {addr}: ssh does not answer: {p.stderr}")
            time.sleep(0.2)

    def down(self):
        """Removes every namespace, link, sshd, key and file of this cluster's name."""
        for pidfile in _glob(self.workdir, "sshd-", ".pid"):
            try:
                with open(pidfile) as f:
                    os.kill(int(f.read().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        for ns in self._existing_namespaces():
            # Whatever still runs in a host (workers, their sshd sessions) goes with it.
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            _sh("ip", "netns", "delete", ns, check=False)
        for i in range(200):
            if os.path.exists(f"/sys/class/net/{self._veth(i)}"):
                _sh("ip", "link", "delete", self._veth(i), check=False)
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            _sh("ip", "link", "delete", self.bridge, check=False)
        for ns in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []:
            if ns.startswith(self.name + "h"):
                shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _existing_namespaces(self) -> List[str]:
        out = _sh("ip", "netns", "list", check=False).stdout.split("\n")
        return [line.split()[0] for line in out
                if line.strip() and line.split()[0].startswith(self.name + "h")]

    def leftovers(self) -> List[str]:
        """What of this cluster still exists (empty after `down()`)."""
        left = [f"namespace {ns}" for ns in self._existing_namespaces()]
        left += [f"link {n}" for n in os.listdir("/sys/class/net")
                 if n == self.bridge or n.startswith(self.name + "v")]
        left += [f"{NETNS_ETC}/{ns}" for ns in (os.listdir(NETNS_ETC)
                                               if os.path.isdir(NETNS_ETC) else [])
                 if ns.startswith(self.name + "h")]
        if os.path.exists(self.workdir):
            left.append(self.workdir)
        return left

    # -- using it -----------------------------------------------------------------------------
    def hosts_arg(self, slots: int, hosts: Optional[int] = None) -> str:
        """horovodrun's -H for the first `hosts` hosts with `slots` workers each."""
        return ",".join(f"{n}:{slots}" for n in self.names[:hosts or self.num_hosts])

    def command(self, argv: Sequence[str], host: int = 0) -> List[str]:
        """`argv` as run by a user logged in on host `host` (its namespace and host name)."""
        inner = " ".join(shlex.quote(a) for a in argv)
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f"hostname {self.names[host]}; exec {inner}"]

    def run(self, argv: Sequence[str], host: int = 0, **kw) -> subprocess.CompletedProcess:
        """Runs `argv` on host `host`; keyword arguments go to subprocess.run."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(argv, host), **kw)

    def wire_bytes(self) -> Dict[str, Dict[str, int]]:
        """{host name: {"sent": bytes, "received": bytes}} so far, from each link's veth."""
        out = {}
        for i, host in enumerate(self.names):
            stats = f"/sys/class/net/{self._veth(i)}/statistics"
            with open(f"{stats}/rx_bytes") as f:
                sent = int(f.read())  # what the host sent arrives at the bridge side
            with open(f"{stats}/tx_bytes") as f:
                received = int(f.read())
            out[host] = {"sent": sent, "received": received}
        return out


def _glob(folder: str, prefix: str, suffix: str) -> List[str]:
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, f) for f in os.listdir(folder)
            if f.startswith(prefix) and f.endswith(suffix)]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfpar.testing.emulate", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the hosts and links")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help="tc rate of every link, e.g. 100mbit")
    up.add_argument("--name", default="tfpe")
    down = sub.add_parser("down", help="remove everything of a cluster")
    down.add_argument("--name", default="tfpe")
    status = sub.add_parser("status", help="hosts, addresses and wire bytes")
    status.add_argument("--name", default="tfpe")
    status.add_argument("--hosts", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "up":
        c = EmulatedCluster(args.hosts, args.rate, args.name).up()
        print(f"up: {', '.join(f'{n} {a}' for n, a in zip(c.names, c.addresses))}; run on "
              f"the first host: {' '.join(c.command(['bash']))}")
    elif args.cmd == "down":
        c = EmulatedCluster(name=args.name)
        c.down()
        print("down" + ("" if not c.leftovers() else f"; left: {c.leftovers()}"))
    else:
        c = EmulatedCluster(args.hosts, name=args.name)
        print(json.dumps(c.wire_bytes(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
