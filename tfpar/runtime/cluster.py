"""The servers of a parameter-server job under `horovodrun`: TensorFlow servers and addresses.

`horovodrun` starts only workers. For a plan with parameter servers every worker starts an
in-process TensorFlow gRPC server (job `worker`, task = Horovod rank), and each host's
local-rank-0 worker spawns one PS process (job `ps`, task = host index; `tfpar.runtime.ps_process`)
that dies with it. Addresses travel through a Horovod allgather. The last barrier at exit
(`tfpar.runtime.liveness`) keeps every PS up until no worker may read from it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import List, Optional, Tuple

import tensorflow as tf

from tfpar.runtime import job
from tfpar.errors import TfparError
from tfpar.runtime.liveness import Liveness, job_address
from tfpar.runtime.ps_process import PsProcess
from tfpar.plan.layout import Layout


@dataclasses.dataclass(frozen=True)
class Member:
    """One worker of the job as the others see it."""

    rank: int
    host: str
    pid: int
    worker: str  # "address:port" of its TensorFlow server
    ps: str  # "address:port" of the PS it spawned ("" unless local rank 0)


def _free_port() -> Tuple[int, socket.socket]:
    """A free TCP port and the socket holding it (TensorFlow's gRPC server refuses
    SO_REUSEPORT, so the holder is closed just before the server binds)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    return s.getsockname()[1], s


_CLUSTER: Optional["Cluster"] = None
_PRESTARTED: Optional[PsProcess] = None  # this host's PS process, started ahead of its cluster


def _first_of_host(layout: Layout, rank: int) -> bool:
    return rank == 0 or layout.host_of_rank(rank - 1) != layout.host_of_rank(rank)


def prestart(layout: Layout):
    """Starts this host's PS process ahead of the cluster, on the host's first worker of a
    job with none yet: it imports TensorFlow while the workers plan and rewrite the graph.
    `get_cluster` gives it its task; `discard_prestarted` ends it if none comes."""
    global _PRESTARTED
    if _CLUSTER is None and _PRESTARTED is None and _first_of_host(layout,
                                                                    job.horovod().rank()):
        _PRESTARTED = PsProcess()


def discard_prestarted():
    """Ends a PS process started ahead that no cluster took (the plan had no parameter
    servers after all, or get_runner stopped before starting them)."""
    global _PRESTARTED
    if _PRESTARTED is not None:
        _PRESTARTED.stop()
        _PRESTARTED = None


def _take_prestarted() -> PsProcess:
    global _PRESTARTED
    ps, _PRESTARTED = _PRESTARTED, None
    return ps if ps is not None else PsProcess()


def get_cluster(layout: Layout, liveness: Liveness, session_config=None,
                interface: Optional[str] = None) -> "Cluster":
    """The cluster of this job, started by the first runner that needs parameter servers.

    It lives until the process exits (TensorFlow cannot stop an in-process server), and
    later runners of the same job reuse it.
    """
    global _CLUSTER
    stopped = _CLUSTER is not None and getattr(_CLUSTER.liveness, "stopped_by", None)
    if stopped:  # its parameter servers are gone: a runner would wait on them for ever
        raise TfparError(f"an earlier error stopped this job's parameter servers ({stopped}):"
                         " start the job again (a new process, or a new horovodrun) for "
                         "another runner with parameter servers")
    if _CLUSTER is None:
        _CLUSTER = Cluster(layout, liveness, session_config, interface)
    elif _CLUSTER.layout != layout:
        raise TfparError(f"this process already runs a PS job on {_CLUSTER.layout}; a runner "
                         f"for {layout} needs a new horovodrun job")
    return _CLUSTER


_GENERATION = 0  # PS runners made by this process


def next_generation() -> int:
    """A number for the next runner's shared PS state, equal on every worker (a
    collective; taken before the rewrite, so before any server starts)."""
    global _GENERATION
    _GENERATION += 1
    seen = set(job.allgather_strings(str(_GENERATION)))
    if len(seen) != 1:
        raise TfparError(f"workers created different numbers of tfpar runners "
                         f"({', '.join(sorted(seen))}): every worker must call "
                         "tfpar.get_runner the same number of times")
    return _GENERATION


def current() -> Optional["Cluster"]:
    """The cluster this process started, if any."""
    return _CLUSTER


class Cluster:
    """This process's part of a PS job: its server and its PS child."""

    def __init__(self, layout: Layout, liveness: Liveness, session_config=None,
                 interface: Optional[str] = None):
        hvd = job.horovod()
        self.liveness = liveness
        self.rank, self.size = hvd.rank(), hvd.size()
        self.layout = layout
        self.host_index = layout.host_of_rank(self.rank)
        self.host = layout.hosts[self.host_index].name
        self.ps: Optional[PsProcess] = None  # the PS this worker spawned, if any

        first_local = _first_of_host(layout, self.rank)
        # Peers dial the address of the job's interface (tfpar.Config(interface=...), else
        # Gloo's); TensorFlow 2.18 still listens on every interface (README, security).
        address = job_address(self.host, interface) or self.host
        worker_port, worker_hold = _free_port()
        ps_port, ps_hold = _free_port() if first_local else (None, None)
        me = Member(self.rank, self.host, os.getpid(), f"{address}:{worker_port}",
                    f"{address}:{ps_port}" if ps_port else "")
        self.members: List[Member] = [Member(**json.loads(s)) for s in job.allgather_strings(
            json.dumps(dataclasses.asdict(me)))]
        self.ps_addresses = [m.ps for m in self.members if m.ps]
        if len(self.ps_addresses) != len(layout.hosts):
            raise TfparError(f"expected one parameter server per host ({len(layout.hosts)}), "
                             f"found {len(self.ps_addresses)}: ranks of a host must be "
                             "consecutive, as horovodrun assigns them")
        self.cluster_spec = tf.train.ClusterSpec(
            {"worker": [m.worker for m in self.members], "ps": self.ps_addresses})

        self.config = self.session_config(session_config)

        if ps_hold is not None:
            ps_hold.close()
            self.ps = _take_prestarted()
            liveness.on_exit(self.ps.stop)
            self.ps.serve(self.cluster_spec.as_dict(), self.host_index, liveness,
                          self.describe(f"ps {self.host_index}"))
        worker_hold.close()
        try:
            self.server = tf.distribute.Server(self.cluster_spec, job_name="worker",
                                               task_index=self.rank, config=self.config,
                                               start=True)
        except tf.errors.OpError as e:
            raise TfparError(f"worker {self.rank} could not start its TensorFlow server on "
                             f"{me.worker}: {e.message}") from None
        if self.ps is not None:
            self.ps.wait_ready(ps_port, self.host)
            self.ps.watch()
        job.allgather_strings("ready")  # every server is up before any session starts

    # -- what transforms and the runner need ------------------------------------------------
    @property
    def target(self) -> str:
        return self.server.target

    @property
    def ps_pid(self) -> Optional[int]:
        return self.ps.pid if self.ps is not None else None

    def session_config(self, user_config=None):
        """The user's ConfigProto, seeing only the PS tasks and this worker (without the
        filter a session dials every worker and stalls on one not yet listening)."""
        config = tf.compat.v1.ConfigProto()
        if user_config is not None:
            config.CopyFrom(user_config)
        del config.device_filters[:]
        config.device_filters.extend(["/job:ps", f"/job:worker/task:{self.rank}"])
        return config

    @property
    def num_ps(self) -> int:
        return len(self.ps_addresses)

    def describe(self, what: str) -> str:
        """Human words for 'worker 3' / 'ps 1' (host and pid)."""
        kind, _, idx = what.partition(" ")
        i = int(idx)
        if kind == "worker":
            m = self.members[i]
            return f"worker {i} (host {m.host}, pid {m.pid})"
        return f"parameter server ps:{i} (host {self.layout.hosts[i].name})"
