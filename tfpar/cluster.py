"""The cluster of a parameter-server job under `horovodrun`: servers, PS processes, liveness.

`horovodrun` starts only workers. For a plan with parameter servers every worker starts an
in-process TensorFlow gRPC server (job `worker`, task = Horovod rank), and each host's
local-rank-0 worker spawns one PS process (job `ps`, task = host index) that dies with it.
Addresses travel through a Horovod allgather.

Liveness: every worker keeps a TCP connection to worker 0 (the hub). A worker or PS that dies
closes its connection (or its parent reports it), the hub tells everyone what died, and
every process prints that and exits non-zero, so no job hangs in a blocked accumulator or
queue and no PS outlives its job. Heartbeats go both ways over the same connections, and
between each PS and its parent, so a process that stops responding without dying
(SIGSTOP, a swapping host, a cut link) is named and stops the job after
`Config.liveness_timeout` seconds. An orderly `close()` is a barrier over the same
connections: no PS stops while another worker may still read from it.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from tfpar import runtime
from tfpar.errors import TfparError, summary
from tfpar.resources import Layout

EXIT_PEER_DIED = 17  # what a process exits with when another process of its job died
_PS_START_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Member:
    """One worker of the job as the others see it."""

    rank: int
    host: str
    pid: int
    worker: str  # "host:port" of its TensorFlow server
    ps: str  # "host:port" of the PS it spawned ("" unless local rank 0)
    hub: str  # "host:port" of the liveness hub (worker 0 only)


def _free_port() -> Tuple[int, socket.socket]:
    """A free TCP port and the socket holding it (TensorFlow's gRPC server refuses
    SO_REUSEPORT, so the holder is closed just before the server binds)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    return s.getsockname()[1], s


def _job_address(host: str) -> str:
    """The IPv4 address peers reach `host` by, or "" (every interface) if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""


_CLUSTER: Optional["Cluster"] = None


def get_cluster(layout: Layout, session_config=None,
                liveness_timeout: float = 30.0) -> "Cluster":
    """The cluster of this job, started by the first runner that needs parameter servers.

    It lives until the process exits (TensorFlow cannot stop an in-process server), and
    later runners of the same job reuse it.
    """
    global _CLUSTER
    if _CLUSTER is None:
        _CLUSTER = Cluster(layout, session_config, liveness_timeout)
    elif _CLUSTER.layout != layout:
        raise TfparError(f"this process already runs a PS job on {_CLUSTER.layout}; a runner "
                         f"for {layout} needs a new horovodrun job")
    return _CLUSTER


def _abort_on_uncaught_exception(cluster: "Cluster"):
    """A worker dying of an exception stops the job at once (others would wait on it)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        cluster.abort(summary(value))
        previous(kind, value, tb)

    sys.excepthook = hook


class Cluster:
    """This process's part of a PS job: its server, its PS child, its liveness link."""

    def __init__(self, layout: Layout, session_config=None, liveness_timeout: float = 30.0):
        hvd = runtime.horovod()
        self.liveness_timeout = float(liveness_timeout)
        self._seen: Dict[str, float] = {}  # "worker r" / "ps t" -> last heartbeat (monotonic)
        self._ps_unresponsive = False
        self.rank, self.size = hvd.rank(), hvd.size()
        self.layout = layout
        self.host_index = layout.host_of_rank(self.rank)
        self.host = layout.hosts[self.host_index].name
        self._closing = False
        self._aborted = False
        self._ps_proc: Optional[subprocess.Popen] = None
        self._release = threading.Event()
        self._send_lock = threading.Lock()
        self._hub_conns: Dict[int, socket.socket] = {}
        self._hub_conn: Optional[socket.socket] = None
        self._hub_byes: set = set()
        self._hub_lock = threading.Lock()

        first_local = self.rank == 0 or layout.host_of_rank(self.rank - 1) != self.host_index
        worker_port, worker_hold = _free_port()
        ps_port, ps_hold = _free_port() if first_local else (None, None)
        hub_sock = None
        if self.rank == 0:
            # The hub listens only on the address the job knows this host by (127.0.0.1 on
            # a one-host job), not on every interface. (TensorFlow's servers cannot: 2.18
            # binds them to 0.0.0.0; see the README's security section.)
            hub_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            hub_sock.bind((_job_address(self.host), 0))
            hub_sock.listen(self.size)
        me = Member(self.rank, self.host, os.getpid(), f"{self.host}:{worker_port}",
                    f"{self.host}:{ps_port}" if ps_port else "",
                    f"{self.host}:{hub_sock.getsockname()[1]}" if hub_sock else "")
        self.members: List[Member] = [Member(**json.loads(s)) for s in runtime.allgather_strings(
            json.dumps(dataclasses.asdict(me)))]
        self.ps_addresses = [m.ps for m in self.members if m.ps]
        if len(self.ps_addresses) != len(layout.hosts):
            raise TfparError(f"expected one parameter server per host ({len(layout.hosts)}), "
                             f"found {len(self.ps_addresses)}: ranks of a host must be "
                             "consecutive, as horovodrun assigns them")
        self.cluster_spec = tf.train.ClusterSpec(
            {"worker": [m.worker for m in self.members], "ps": self.ps_addresses})

        self.config = self.session_config(session_config)
        self._generation = 0

        # Liveness first, so a failure while starting servers is reported too.
        if hub_sock is not None:
            threading.Thread(target=self._hub, args=(hub_sock,), daemon=True,
                             name="tfpar-hub").start()
        else:
            self._connect_hub()
        atexit.register(self.close)
        _abort_on_uncaught_exception(self)

        if ps_hold is not None:
            ps_hold.close()
            self._spawn_ps(self.host_index, ps_port)
        worker_hold.close()
        try:
            self.server = tf.distribute.Server(self.cluster_spec, job_name="worker",
                                               task_index=self.rank, config=self.config,
                                               start=True)
        except tf.errors.OpError as e:
            raise TfparError(f"worker {self.rank} could not start its TensorFlow server on "
                             f"{me.worker}: {e.message}") from None
        if self._ps_proc is not None:
            self._wait_ps_ready(ps_port)
            self._seen[f"ps {self.host_index}"] = time.monotonic()
            threading.Thread(target=self._ps_heartbeats, daemon=True,
                             name="tfpar-ps-heartbeat").start()
        threading.Thread(target=self._watchdog, daemon=True, name="tfpar-watchdog").start()
        runtime.allgather_strings("ready")  # every server is up before any session starts

    # -- what transforms and the runner need ------------------------------------------------
    @property
    def target(self) -> str:
        return self.server.target

    def session_config(self, user_config=None):
        """The user's ConfigProto, seeing only the PS tasks and this worker (without the
        filter a session dials every worker and stalls on one not yet listening)."""
        config = tf.compat.v1.ConfigProto()
        if user_config is not None:
            config.CopyFrom(user_config)
        del config.device_filters[:]
        config.device_filters.extend(["/job:ps", f"/job:worker/task:{self.rank}"])
        return config

    def next_generation(self) -> int:
        """A number for the next runner's shared PS state, equal on every worker."""
        self._generation += 1
        seen = set(runtime.allgather_strings(str(self._generation)))
        if len(seen) != 1:
            raise TfparError(f"workers created different numbers of tfpar runners "
                             f"({', '.join(sorted(seen))}): every worker must call "
                             "tfpar.get_runner the same number of times")
        return self._generation

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

    # -- PS child ----------------------------------------------------------------------------
    def _spawn_ps(self, task: int, port: int):
        spec = json.dumps({"cluster": self.cluster_spec.as_dict(), "task": task})
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL=os.environ.get(
            "TF_CPP_MIN_LOG_LEVEL", "2"))
        # Not a Horovod process: drop the launcher's variables so nothing mistakes it for one.
        for k in list(env):
            if k.startswith(("HOROVOD_", "OMPI_", "PMI_")):
                env.pop(k)
        self._ps_proc = subprocess.Popen([sys.executable, "-m", "tfpar.ps_server", spec],
                                         env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, bufsize=1)
        threading.Thread(target=self._watch_ps, args=(task,), daemon=True,
                         name="tfpar-ps-watch").start()

    def _wait_ps_ready(self, port: int):
        deadline = time.time() + _PS_START_TIMEOUT_S
        while time.time() < deadline:
            if self._ps_proc.poll() is not None:
                return  # the watcher reports it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TfparError(f"the parameter server of host {self.host} did not start within "
                         f"{_PS_START_TIMEOUT_S} s")

    def _watch_ps(self, task: int):
        proc = self._ps_proc
        err = proc.stderr.read() if proc.stderr else ""
        code = proc.wait()
        if self._closing or self._ps_unresponsive:
            return
        tail = " ".join(err.strip().splitlines()[-3:])
        self._fail(f"{self.describe(f'ps {task}')} (pid {proc.pid}) died with exit code "
                   f"{code}" + (f": {tail}" if tail else ""))

    # -- heartbeats ----------------------------------------------------------------------------
    def _interval(self) -> float:
        return max(0.2, self.liveness_timeout / 6)

    def _ps_heartbeats(self):
        """PING this host's PS; its PONGs (read by a second thread) mark it alive."""
        proc, key = self._ps_proc, f"ps {self.host_index}"

        def read():
            for line in proc.stdout:
                if line.strip() == "PONG":
                    self._seen[key] = time.monotonic()

        threading.Thread(target=read, daemon=True, name="tfpar-ps-pong").start()
        while proc.poll() is None and not self._closing:
            try:
                proc.stdin.write("PING\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                return  # it died: the watcher reports that
            time.sleep(self._interval())

    def _heartbeats(self):
        """Worker 0 pings every worker, the others ping worker 0."""
        while not self._release.is_set():
            if self.rank == 0:
                for conn in list(self._hub_conns.values()):
                    self._send(conn, "PING")
            elif self._hub_conn is not None:
                self._send(self._hub_conn, "PING")
            time.sleep(self._interval())

    def _watchdog(self):
        """Stops the job when a process it watches has sent nothing for the timeout."""
        threading.Thread(target=self._heartbeats, daemon=True, name="tfpar-heartbeat").start()
        while not self._release.is_set() and not self._aborted:
            time.sleep(self._interval())
            now = time.monotonic()
            for key, seen in list(self._seen.items()):
                if key.startswith("worker ") and int(key.split()[1]) in self._hub_byes:
                    continue  # done: it waits for the others without a step to run
                if now - seen > self.liveness_timeout and not self._release.is_set():
                    proc = self._ps_proc if key.startswith("ps ") else None
                    pid = f" (pid {proc.pid})" if proc is not None else ""
                    chief = " (the chief)" if key == "worker 0" else ""
                    if proc is not None:
                        self._ps_unresponsive = True  # its watcher must not report a death
                        proc.kill()  # a stopped process ignores SIGTERM until continued
                    self._fail(f"{self.describe(key)}{pid}{chief} stopped responding: no "
                               f"heartbeat for {now - seen:.0f} s (tfpar.Config("
                               f"liveness_timeout={self.liveness_timeout:g}))")
                    return

    # -- liveness ------------------------------------------------------------------------------
    def _hub(self, sock: socket.socket):
        """Worker 0: accept every worker, relay deaths, release everyone at close."""
        byes, lock = self._hub_byes, self._hub_lock

        def serve(reader, rank: int):
            for line in reader:
                self._seen[f"worker {rank}"] = time.monotonic()
                cmd, _, text = line.strip().partition(" ")
                if cmd == "BYE":
                    with lock:
                        byes.add(rank)
                        self._maybe_release(byes)
                elif cmd == "DEAD":
                    self._fail(text)
            if rank not in byes and not self._release.is_set():
                self._fail(f"{self.describe(f'worker {rank}')} died")

        for _ in range(self.size - 1):
            conn, _ = sock.accept()
            reader = conn.makefile("r")
            rank = int(reader.readline().split()[1])
            self._seen[f"worker {rank}"] = time.monotonic()
            self._hub_conns[rank] = conn
            threading.Thread(target=serve, args=(reader, rank), daemon=True).start()
        sock.close()

    def _maybe_release(self, byes):
        if len(byes) == self.size:
            for conn in self._hub_conns.values():
                self._send(conn, "RELEASE")
            self._release.set()

    def _connect_hub(self):
        host, port = self.members[0].hub.rsplit(":", 1)
        deadline = time.time() + 60
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=10)
                break
            except OSError:
                if time.time() > deadline:
                    raise TfparError(f"worker {self.rank} cannot reach worker 0 at "
                                     f"{self.members[0].hub}") from None
                time.sleep(0.2)
        conn.settimeout(None)
        self._hub_conn = conn
        self._send(conn, f"HELLO {self.rank}")

        self._seen["worker 0"] = time.monotonic()

        def listen():
            for line in conn.makefile("r"):
                self._seen["worker 0"] = time.monotonic()
                cmd, _, text = line.strip().partition(" ")
                if cmd == "RELEASE":
                    self._release.set()
                    return
                if cmd == "DEAD":
                    self._die(text)
            if not self._release.is_set():
                self._die(f"{self.describe('worker 0')} (the chief) died")

        threading.Thread(target=listen, daemon=True, name="tfpar-liveness").start()

    def _send(self, conn: socket.socket, line: str):
        with self._send_lock:
            try:
                conn.sendall((line + "\n").encode())
            except OSError:
                pass

    def _fail(self, text: str):
        """Something of this job died: tell everyone (through the hub), then stop."""
        if self.rank == 0:
            for conn in list(self._hub_conns.values()):
                self._send(conn, f"DEAD {text}")
        elif self._hub_conn is not None:
            self._send(self._hub_conn, f"DEAD {text}")
        self._die(text)

    def _die(self, text: str):
        if self._aborted or (self._closing and self._release.is_set()):
            return  # this process is already on its way out, or done
        sys.stderr.write(f"tfpar: {text}; stopping worker {self.rank} of the job\n")
        sys.stderr.flush()
        self._stop_ps()
        os._exit(EXIT_PEER_DIED)

    # -- teardown ------------------------------------------------------------------------------
    def abort(self, reason: str):
        """This worker failed: make every other process of the job stop too, and stop our PS."""
        if self._closing:
            return
        self._closing = self._aborted = True
        text = f"{self.describe(f'worker {self.rank}')} failed: {reason}"
        sys.stderr.write(f"tfpar: {text}; stopping the job\n")
        sys.stderr.flush()
        if self.rank == 0:
            for conn in list(self._hub_conns.values()):
                self._send(conn, f"DEAD {text}")
        elif self._hub_conn is not None:
            self._send(self._hub_conn, f"DEAD {text}")
        self._stop_ps()

    def close(self):
        """Waits until every worker is done with the job's servers, then stops this host's PS."""
        if self._closing:
            return
        self._closing = True
        if self.rank == 0:
            with self._hub_lock:
                self._hub_byes.add(0)
                self._maybe_release(self._hub_byes)
        elif self._hub_conn is not None:
            self._send(self._hub_conn, "BYE")
        self._release.wait()
        self._stop_ps()

    def _stop_ps(self):
        proc = self._ps_proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
