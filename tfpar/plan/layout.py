"""The cluster layout: which hosts run how many workers.

A layout comes from the user (`"host1:2,host2:2"` or a file of `host[: gpu ids]` lines) or
from the running `horovodrun` job, and the two must agree.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import List, Optional, Sequence, Tuple

from tfpar.errors import TfparError

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine: its name, how many worker processes it runs, and its GPU ids (if given)."""

    name: str
    slots: Optional[int]  # None: take the count from the running job (a file line without ids)
    gpus: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Hosts in rank order: host i runs the ranks after those of hosts 0..i-1 (horovodrun's order)."""

    hosts: Tuple[Host, ...]

    @property
    def num_workers(self) -> int:
        return sum(h.slots or 0 for h in self.hosts)

    def host_of_rank(self, rank: int) -> int:
        return host_of_rank([h.slots or 0 for h in self.hosts], rank)

    def __str__(self):
        return ",".join(f"{h.name}:{h.slots}" for h in self.hosts)


def host_of_rank(slots: Sequence[int], rank: int) -> int:
    """The host of `rank` when hosts run `slots[i]` workers each, ranks in host order (as
    horovodrun assigns them)."""
    start = 0
    for i, n in enumerate(slots):
        start += n
        if rank < start:
            return i
    raise IndexError(rank)


def parse_resources(resources) -> Optional[Layout]:
    """Parses `resources` ("h1:2,h2:2", a path to a resource file, a Layout, or None)."""
    if resources is None or isinstance(resources, Layout):
        return resources
    if not isinstance(resources, str):
        raise TfparError(f"resources must be a string like 'host1:2,host2:2' or a file path, "
                         f"got {type(resources).__name__}")
    text = resources.strip()
    if not text:
        raise TfparError("resources is empty: give 'host:slots,...', a file path, or None")
    if os.path.isfile(text):
        return _parse_file(text)
    if "/" in text or text.endswith((".txt", ".cfg")):
        raise TfparError(f"resource file {text!r} does not exist")
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name:
            raise TfparError(f"bad resources entry {item!r}: expected 'host:slots'")
        try:
            n = int(slots) if slots else 1
        except ValueError:
            raise TfparError(f"bad slot count in resources entry {item!r}: expected 'host:slots' "
                             "with an integer") from None
        if n < 1:
            raise TfparError(f"resources entry {item!r} has {n} slots; each host needs at least 1")
        hosts.append(Host(name.strip(), n))
    return _check_unique(Layout(tuple(hosts)), text)


def _parse_file(path: str) -> Layout:
    hosts = []
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, ids = line.partition(":")
            gpus: Tuple[int, ...] = ()
            if ids.strip():
                try:
                    gpus = tuple(int(x) for x in ids.replace(" ", "").split(",") if x)
                except ValueError:
                    raise TfparError(f"{path}:{lineno}: expected 'host[: gpu ids]' like "
                                     f"'node1: 0,1', got {line!r}") from None
            hosts.append(Host(name.strip(), len(gpus) if gpus else None, gpus))
    if not hosts:
        raise TfparError(f"resource file {path} lists no hosts")
    return _check_unique(Layout(tuple(hosts)), path)


def _check_unique(layout: Layout, source: str) -> Layout:
    names = [h.name for h in layout.hosts]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise TfparError(f"resources {source!r} list host(s) {sorted(dup)} more than once")
    return layout


def job_layout(hostnames_by_rank: Sequence[str]) -> Layout:
    """The layout of a running job, from every rank's host name in rank order."""
    hosts: List[Host] = []
    for name in hostnames_by_rank:
        if hosts and hosts[-1].name == name:
            hosts[-1] = Host(name, hosts[-1].slots + 1)
        else:
            hosts.append(Host(name, 1))
    return Layout(tuple(hosts))


def reconcile(requested: Optional[Layout], job: Layout) -> Layout:
    """Checks a requested layout against the running job; returns the one to use.

    Host names are compared only where both sides name a real host, since the job knows
    itself by `socket.gethostname()` while users write `localhost` or an address.
    """
    if requested is None:
        return job
    if len(requested.hosts) != len(job.hosts):
        raise TfparError(
            f"resources name {len(requested.hosts)} host(s) ({requested}) but the running job "
            f"has {len(job.hosts)} ({job}); make resources match the -H list given to horovodrun")
    for want in requested.hosts:
        if want.name in _LOCAL_NAMES:
            continue
        try:
            _addresses(want.name)
        except OSError as e:
            raise TfparError(
                f"resources ({requested}) name host {want.name!r}, which does not resolve from "
                f"this machine ({e}); give the host names or addresses of the -H list given to "
                "horovodrun") from None
    hosts = []
    for want, have in zip(requested.hosts, job.hosts):
        if want.slots is not None and want.slots != have.slots:
            raise TfparError(
                f"resources give host {want.name!r} {want.slots} worker(s) but the running job "
                f"has {have.slots} there (job layout {job}); make resources match the -H list "
                "given to horovodrun")
        if not _same_host(want.name, have.name):
            raise TfparError(f"resources list host {want.name!r} where the job runs on "
                             f"{have.name!r} (job layout {job})")
        hosts.append(Host(want.name, have.slots, want.gpus))
    return Layout(tuple(hosts))


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    mine = {socket.gethostname(), socket.getfqdn()} | _LOCAL_NAMES
    if a in mine and b in mine:
        return True
    try:
        return bool(set(_addresses(a)) & set(_addresses(b)))
    except OSError:
        return True  # unresolvable here: cannot prove a mismatch


def _addresses(name: str):
    return [ai[4][0] for ai in socket.getaddrinfo(name, None)]
