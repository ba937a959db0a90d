"""Liveness of a job's processes: arrival, heartbeats, training-step deadlines, the last barrier.

A job must never stall silently. Every worker of a multi-worker job keeps one authenticated
TCP link to worker 0 (the hub):

- **Arrival.** Before the first collective, each rank records in horovodrun's rendezvous
  store that it reached `get_runner`; a rank that never does is named within
  `Config.liveness_timeout` (a Horovod collective would wait for it forever).
- **Death and silence.** A process that dies closes its link (or its parent reports it);
  one that stops responding (SIGSTOP, swapping, a cut link) stops sending heartbeats. The
  hub tells everyone which process it was and every process exits with `EXIT_PEER_DIED`.
- **Steps.** Heartbeats carry each worker's training-step state, so the hub names a worker
  that keeps the others waiting: one whose input ended (or that finished) while others wait
  in a step, for longer than the liveness timeout; and any training step over
  `Config.step_deadline`, with the workers that are not in it.
- **Runs that differ.** Heartbeats also carry a signature of the Horovod collectives of
  each worker's current and last run that waits for the others; two workers stuck in runs
  whose runs of the same number differ (the chief alone reading a sharded variable) are
  named with what each ran, after the liveness timeout instead of the step deadline.
- **No silent start.** Each worker reports the stage it is in (starting the parameter
  servers, initialising, the broadcast, and inside a training step what the runner's probe
  finds: a PS read, a collective, a push, the chief's update, the token). A worker that has
  not finished its first training step within `Config.first_step_deadline` of entering a
  stage stops the job with every worker's stage.
- **The last barrier.** At exit each worker waits until every worker is done, so no
  parameter server stops while another worker may still read from it.

The hub listens on the job's address only until every worker has joined, and a worker joins
by proving it knows the job's secret (HMAC challenge-response, both ways); the secret
travels inside Horovod's allgather, never over the hub's port.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Dict, List, Optional

from tfpar.errors import TfparError, summary

EXIT_PEER_DIED = 17  # what a process exits with when another process of its job failed
_HANDSHAKE_TIMEOUT_S = 10.0
# An error that says a peer is gone (a PS connection reset, a collective cut) is usually the
# echo of another process's death; its owner reports the cause within this time, and that
# report, not the echo, must name what died.
_ECHO_GRACE_S = 3.0
_ECHO_ERRORS = ("UnavailableError", "AbortedError", "CancelledError", "UnknownError",
                "DeadlineExceededError", "InternalError", "HorovodInternalError")


# -- addresses ---------------------------------------------------------------------------------
def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), or raise OSError."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def job_address(host: str, interface: Optional[str] = None) -> str:
    """The IPv4 address this host uses for the job: that of `interface` (tfpar.Config), else
    of the interface Horovod's Gloo uses (HOROVOD_GLOO_IFACE), else `host` resolved; "" if
    none is known (then a socket binds every interface)."""
    if interface:
        try:
            return interface_address(interface)
        except OSError as e:
            raise TfparError(f"tfpar.Config(interface={interface!r}): this host has no IPv4 "
                             f"address on that interface ({e.strerror}); name one that "
                             "`ip -4 addr` lists") from None
    gloo = os.environ.get("HOROVOD_GLOO_IFACE")
    if gloo:
        try:
            return interface_address(gloo)
        except OSError:
            pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""


# -- arrival -------------------------------------------------------------------------------------
def wait_for_arrival(call: int, timeout: float) -> None:
    """Returns once every rank of the horovodrun job has reached its `call`-th get_runner.

    Uses horovodrun's rendezvous key-value store (HTTP; Gloo jobs), so it needs no Horovod
    collective, which would wait forever for a rank that never comes. Raises a TfparError
    naming the ranks that did not arrive within `timeout` seconds. A job not started by
    `horovodrun --gloo` (one process, or MPI) is not checked.
    """
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    size = int(os.environ.get("HOROVOD_SIZE", "1"))
    if not addr or not port or size <= 1:
        return
    rank = int(os.environ["HOROVOD_RANK"])
    base = f"http://{addr}:{port}/tfpar_arrival_{call}"
    _http(base + f"/{rank}", b"here")
    missing = [r for r in range(size) if r != rank]
    deadline = time.monotonic() + timeout
    # The others are usually a moment behind: look again soon, then less often (a look is
    # one HTTP request; a longer pause would keep every runner's start waiting past them).
    pause = 0.005
    while missing:
        missing = [r for r in missing if _http(base + f"/{r}") is None]
        if not missing:
            return
        if time.monotonic() > deadline:
            which = ", ".join(map(str, missing))
            raise TfparError(
                f"rank(s) {which} of the job did not call tfpar.get_runner within "
                f"{timeout:g} s (tfpar.Config(liveness_timeout={timeout:g})): every worker "
                "must call tfpar.get_runner, the same number of times")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def _http(url: str, put: Optional[bytes] = None) -> Optional[bytes]:
    """GET (None if absent) or PUT one key of horovodrun's rendezvous store."""
    request = urllib.request.Request(url, data=put, method="PUT" if put is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        if e.code == 404 and put is None:
            return None
        raise TfparError(f"horovodrun's rendezvous store at {url} answered {e.code}") from None
    except OSError as e:
        raise TfparError(f"cannot reach horovodrun's rendezvous store at {url}: {e}") from None


# -- the liveness links --------------------------------------------------------------------------
def handshake_mac(secret: str, text: str) -> str:
    """The proof a liveness peer gives that it knows the job's secret (HMAC-SHA256)."""
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def _lines(reader):
    """The lines of a link until it closes or breaks (a reset is a close)."""
    try:
        yield from reader
    except OSError:
        return


class _State:
    """A worker's training-step state as the hub knows it."""

    __slots__ = ("kind", "since", "steps", "input_ended", "stage", "run", "last", "finished",
                 "counted")

    def __init__(self, kind: str = "idle", since: float = 0.0, steps: int = 0):
        self.kind, self.since, self.steps = kind, since, steps
        self.input_ended = False  # its last training step raised OutOfRangeError
        self.stage = ""  # where it is: a start-up stage, or what a step waits for
        # The collectives of its current run and of its last finished one ([signature,
        # what it fetches]; signature "": none): the runs of the same number must match.
        self.run = ["", ""]
        self.last = ["", ""]
        self.finished = 0  # runs that waited for the others, done (`steps`: those counted)
        self.counted = True  # whether the current run counts as a step

    def runs(self) -> Dict[int, List[str]]:
        """{number of a run that waits for the others: [signature, what]} it is in or ran
        last (`finished` counts them)."""
        out = {self.finished: self.last} if self.last[0] else {}
        if self.kind == "step" and self.run[0]:
            out[self.finished + 1] = self.run
        return out


_LIVENESS: Optional["Liveness"] = None
_KINDS = {"idle": "its own code, outside any training step", "ended": "the end of its input",
          "bye": "the job's last barrier (it finished)"}


def get_liveness(rank: int, size: int, host: str, liveness_timeout: float,
                 step_deadline: Optional[float], interface: Optional[str],
                 first_step_deadline: Optional[float] = None) -> "Liveness":
    """This process's liveness links, made by the first runner of the job (a collective)."""
    global _LIVENESS
    if _LIVENESS is None:
        from tfpar.runtime import job
        hub, secret = None, ""
        address = job_address(host, interface)  # every rank checks Config.interface
        if rank == 0 and size > 1:  # a lone process watches only its PS
            hub = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            hub.bind((address, 0))
            hub.listen(size)
            secret = secrets.token_hex(32)
        me = {"rank": rank, "host": host, "pid": os.getpid(),
              "hub": "%s:%d" % hub.getsockname() if hub else "", "secret": secret}
        members = [json.loads(s) for s in job.allgather_strings(json.dumps(me))]
        _LIVENESS = Liveness(rank, members, members[0]["secret"], liveness_timeout,
                             step_deadline, hub, first_step_deadline)
    return _LIVENESS


def current() -> Optional["Liveness"]:
    """The liveness links of this process, if a runner started them."""
    return _LIVENESS


class Liveness:
    """This worker's side of the job's liveness links (see the module docstring).

    `members`: per rank {"rank", "host", "pid", "hub"}; `hub_socket`: worker 0's listening
    socket. Processes this worker watches itself (its parameter server) join through
    `watch` and `beat`; `on_exit` callbacks run before the process leaves (stop the PS).
    """

    def __init__(self, rank: int, members: List[dict], secret: str, timeout: float,
                 step_deadline: Optional[float], hub_socket: Optional[socket.socket] = None,
                 first_step_deadline: Optional[float] = None):
        self.rank, self.size = rank, len(members)
        self.members = members
        self.timeout = float(timeout)
        self.step_deadline = step_deadline
        self.first_step_deadline = first_step_deadline
        self._probe: Optional[Callable[[], str]] = None
        self._secret = secret
        self._seen: Dict[str, float] = {}  # watched key -> last sign of life (monotonic)
        self._names: Dict[str, str] = {}  # watched local process key -> its description
        self._kills: Dict[str, Callable[[], None]] = {}
        self._on_exit: List[Callable[[], None]] = []
        self._states: Dict[int, _State] = {r: _State(since=time.monotonic())
                                           for r in range(self.size)}
        self._mine = self._states[rank]
        self._send_lock = threading.Lock()
        self._hub_lock = threading.Lock()
        self._die_lock = threading.Lock()
        self._conns: Dict[int, socket.socket] = {}  # hub: rank -> link
        self._link: Optional[socket.socket] = None  # others: the link to the hub
        self._byes: set = set()
        self._release = threading.Event()
        self.closing = False
        self.dying = False
        self._aborted = False
        self.stopped_by: Optional[str] = None  # what stopped the job here (`abort`)
        self.hub_address = members[0]["hub"]

        now = time.monotonic()
        if rank == 0:
            for r in range(1, self.size):
                self._seen[f"worker {r}"] = now  # one that never connects times out too
            if hub_socket is not None:
                threading.Thread(target=self._accept, args=(hub_socket,), daemon=True,
                                 name="tfpar-hub").start()
        else:
            self._connect()
        atexit.register(self.close)
        self._install_excepthook()
        threading.Thread(target=self._watchdog, daemon=True, name="tfpar-watchdog").start()

    # -- what the runner and the cluster use ---------------------------------------------------
    def describe(self, rank: int) -> str:
        m = self.members[rank]
        return f"worker {rank} (host {m['host']}, pid {m['pid']})"

    def step_started(self, signature: str = "", what: str = "", counted: bool = True):
        """A run that waits for the other workers started; `signature`: its Horovod
        collectives' (equal on every worker for the same run; "" none), `what`: its
        fetches, to name it; `counted`: it counts as a step (not a re-initialisation
        alone, which would take the first step out of `first_step_deadline`)."""
        self._mine.input_ended = False
        self._mine.stage = "a training step"
        self._mine.run = [signature, what]
        self._mine.counted = counted
        self._set_state("step")

    def stage(self, text: str):
        """This worker is now in start-up stage `text` (watched by the first-step bound)."""
        self._mine.stage = text
        self._set_state("start")

    def set_probe(self, probe: Optional[Callable[[], str]]):
        """`probe()`: what this worker's current training step waits for (run in a thread
        of its own while a step lasts); None: no probe."""
        self._probe = probe

    def step_finished(self, input_ended: bool = False):
        """A training step ended; `input_ended`: it raised OutOfRangeError (input exhausted)."""
        if self._mine.kind == "step" and not input_ended:
            self._mine.steps += self._mine.counted
            self._mine.finished += 1
            self._mine.last = self._mine.run
        self._mine.input_ended = input_ended
        self._mine.stage = ""
        self._set_state("ended" if input_ended else "idle")

    def _set_state(self, kind: str):
        self._mine.kind, self._mine.since = kind, time.monotonic()

    def watch(self, key: str, name: str, kill: Callable[[], None]):
        """Watch a local process (key "ps t"): `beat(key)` on each sign of life; after the
        timeout without one it is killed and named."""
        self._names[key], self._kills[key] = name, kill
        self._seen[key] = time.monotonic()

    def beat(self, key: str):
        self._seen[key] = time.monotonic()

    def on_exit(self, fn: Callable[[], None]):
        self._on_exit.append(fn)

    # -- the hub (worker 0) ----------------------------------------------------------------------
    def _accept(self, sock: socket.socket):
        """Admit each worker that proves it knows the job's secret (`_admit` closes the port
        once all are in)."""
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn, peer, sock), daemon=True).start()

    def _admit(self, conn: socket.socket, peer, sock: socket.socket):
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            reader = conn.makefile("r")
            nonce = secrets.token_hex(16)
            conn.sendall(f"CHALLENGE {nonce}\n".encode())
            word, rank_text, their_nonce, mac = (reader.readline().split() + ["", "", "", ""])[:4]
            rank = int(rank_text) if rank_text.isdigit() else -1
            ok = (word == "HELLO" and 0 < rank < self.size and rank not in self._conns
                  and hmac.compare_digest(mac, handshake_mac(self._secret, f"worker {rank} {nonce}")))
            if not ok:
                raise ValueError("it did not prove it belongs to this job")
            conn.sendall(f"WELCOME {handshake_mac(self._secret, f'hub {their_nonce}')}\n".encode())
            conn.settimeout(None)
        except (OSError, ValueError) as e:
            sys.stderr.write(f"tfpar: refused a connection to the liveness hub from "
                             f"{peer[0]}:{peer[1]}: {e}\n")
            conn.close()
            return
        with self._hub_lock:
            self._conns[rank] = conn
            self._seen[f"worker {rank}"] = time.monotonic()
            if len(self._conns) == self.size - 1:
                sock.close()  # everyone is in: nothing listens any more
        self._serve(reader, rank)

    def _serve(self, reader, rank: int):
        key = f"worker {rank}"
        for line in _lines(reader):
            self._seen[key] = time.monotonic()
            cmd, _, text = line.strip().partition(" ")
            if cmd == "PING" and text:
                kind, steps, age, rest = (text.split(" ", 3) + ["{}"])[:4]
                rest = json.loads(rest)
                state = self._states[rank]
                state.kind, state.steps, state.stage = kind, int(steps), rest.get("stage", "")
                state.run, state.last = rest.get("run", ["", ""]), rest.get("last", ["", ""])
                state.finished = rest.get("finished", state.steps)
                state.since = time.monotonic() - float(age)
            elif cmd == "BYE":
                steps, ended = (text.split() + ["0", "0"])[:2]
                with self._hub_lock:
                    self._byes.add(rank)
                    state = self._states[rank]
                    state.kind, state.steps = "bye", int(steps)
                    state.input_ended = ended == "1"
                    self._maybe_release()
            elif cmd == "DEAD":
                self._fail(text)
        if rank not in self._byes and not self._release.is_set():
            self._fail(f"{self.describe(rank)} died")

    def _maybe_release(self):
        if len(self._byes) == self.size:
            for conn in self._conns.values():
                self._send(conn, "RELEASE")
            self._release.set()

    def where(self) -> str:
        """Every worker's stage, as the hub knows it."""
        now = time.monotonic()
        return "; ".join(
            f"{self.describe(r)} is in {s.stage or _KINDS.get(s.kind, s.kind)} "
            f"({now - s.since:.0f} s"
            + (f", after {s.steps} step(s))" if s.steps else ")")
            for r, s in sorted(self._states.items()))

    def _check_steps(self):
        """Hub: name the worker(s) a training step waits for, once it has waited too long."""
        now = time.monotonic()
        if self._check_runs(now):
            return
        bound = self.first_step_deadline
        for r, state in list(self._states.items()):
            if (bound and state.steps == 0 and state.kind in ("start", "step")
                    and now - state.since > bound):
                what = ("its first training step" if state.kind == "step"
                        else f"start-up ({state.stage})")
                self._fail(f"{self.describe(r)} has been in {what} for {now - state.since:.0f} "
                           f"s, over tfpar.Config(first_step_deadline={bound:g}): "
                           f"{self.where()}")
                return
            if state.kind != "step":
                continue
            waited = now - state.since
            gone = [e for e, s in self._states.items() if s.kind in ("ended", "bye")]
            if gone and waited > self.timeout:
                e = gone[0]
                s = self._states[e]
                what = "ran out of input" if s.input_ended else "finished"
                self._fail(
                    f"{self.describe(e)} {what} after {s.steps} training step(s) while "
                    f"{self.describe(r)} has waited {waited:.0f} s for it in step "
                    f"{state.steps + 1}: every worker must run the same number of training "
                    "steps (give each worker as many batches: tfpar.shard(dataset) and "
                    "batch(..., drop_remainder=True), or stop every worker at one step count)")
                return
            if self.step_deadline and waited > self.step_deadline:
                outside = [(e, s) for e, s in self._states.items() if s.kind != "step"]
                if outside:
                    why = "; it waits for " + ", ".join(
                        f"{self.describe(e)}, which is not in a training step "
                        f"({now - s.since:.0f} s after its step {s.steps})" for e, s in outside)
                else:
                    why = ("; every worker is in it (a step slower than the deadline, or a "
                           "collective or parameter server that does not answer): "
                           + self.where())
                self._fail(f"training step {state.steps + 1} of {self.describe(r)} has run "
                           f"for {waited:.0f} s, over tfpar.Config(step_deadline="
                           f"{self.step_deadline:g}){why}")
                return

    def _check_runs(self, now: float) -> bool:
        """Hub: two workers whose runs of the same number take part in different collectives
        (a read of a split variable, or a step, on some workers only) wait for each other
        for ever: once both have waited the liveness timeout in runs that differ, name the
        two runs. (Runs whose collectives TF1 control flow may skip have no signature and
        are not compared: `runner.collective_signature`.)"""
        stuck = {r: s for r, s in self._states.items() if s.kind == "step" and s.run[0]
                 and now - s.since > self.timeout and not s.input_ended}
        for r, e in ((r, e) for r in sorted(stuck) for e in sorted(stuck) if r < e):
            if stuck[r].run[0] == stuck[e].run[0]:
                continue  # in the same run now: slow, not apart
            theirs = stuck[e].runs()
            for number, (signature, what) in sorted(stuck[r].runs().items()):
                other = theirs.get(number)
                if other is None or other[0] == signature:
                    continue
                self._fail(
                    f"{self.describe(r)} and {self.describe(e)} took part in different "
                    f"collectives in their run {number} that waits for the other workers: "
                    f"{self.describe(r)} ran {what or '?'}, {self.describe(e)} ran "
                    f"{other[1] or '?'}. Every worker must make the same such runs in the "
                    "same order (a training step; a read of a variable split over the "
                    "workers, route 'sharded' or tiled, such as a summary or an evaluation): "
                    "make that run on every worker, or on none")
                return True
        return False

    # -- the other workers ---------------------------------------------------------------------
    def _connect(self):
        host, port = self.hub_address.rsplit(":", 1)
        deadline = time.monotonic() + max(60.0, self.timeout)
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=_HANDSHAKE_TIMEOUT_S)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TfparError(f"worker {self.rank} cannot reach worker 0's liveness hub "
                                     f"at {self.hub_address}") from None
                time.sleep(0.05)  # the hub starts at the same time: it is usually a moment away
        reader = conn.makefile("r")
        mine = secrets.token_hex(16)
        try:
            word, nonce = (reader.readline().split() + ["", ""])[:2]
            conn.sendall(f"HELLO {self.rank} {mine} "
                         f"{handshake_mac(self._secret, f'worker {self.rank} {nonce}')}\n".encode())
            answer, mac = (reader.readline().split() + ["", ""])[:2]
        except OSError:
            word = answer = mac = ""
        if word != "CHALLENGE" or answer != "WELCOME" or not hmac.compare_digest(
                mac, handshake_mac(self._secret, f"hub {mine}")):
            conn.close()
            raise TfparError(f"worker {self.rank}: the process at {self.hub_address} is not "
                             "this job's liveness hub (it failed the job-secret check)")
        conn.settimeout(None)
        self._link = conn
        self._seen["worker 0"] = time.monotonic()

        def listen():
            for line in _lines(reader):
                self._seen["worker 0"] = time.monotonic()
                cmd, _, text = line.strip().partition(" ")
                if cmd == "RELEASE":
                    self._release.set()
                    return
                if cmd == "DEAD":
                    self._die(text)
            if not self._release.is_set():
                self._die(f"{self.describe(0)} (the chief) died")

        threading.Thread(target=listen, daemon=True, name="tfpar-liveness").start()

    # -- heartbeats and the watchdog -----------------------------------------------------------
    def interval(self) -> float:
        return max(0.2, self.timeout / 6)

    def _heartbeats(self):
        while not self._release.is_set():
            if self.rank == 0:
                for conn in list(self._conns.values()):
                    self._send(conn, "PING")
            elif self._link is not None:
                s = self._mine
                self._send(self._link, f"PING {s.kind} {s.steps} "
                                       f"{time.monotonic() - s.since:.3f} " + json.dumps(
                                           {"stage": s.stage, "run": s.run, "last": s.last,
                                            "finished": s.finished}))
            time.sleep(self.interval())

    def _probing(self):
        """While this worker's step lasts, asks the runner's probe what it waits for."""
        while not self._release.is_set() and not self._aborted:
            time.sleep(min(self.interval(), 2.0))
            s, probe = self._mine, self._probe
            if probe is None or s.kind != "step" or time.monotonic() - s.since < 2.0:
                continue
            try:
                found = probe()
            except Exception as e:  # pylint: disable=broad-except
                found = f"a training step (its probe failed: {summary(e)})"
            if s.kind == "step" and found:
                s.stage = found.replace("\n", " ")

    def _watchdog(self):
        threading.Thread(target=self._heartbeats, daemon=True, name="tfpar-heartbeat").start()
        threading.Thread(target=self._probing, daemon=True, name="tfpar-probe").start()
        while not self._release.is_set() and not self._aborted:
            time.sleep(self.interval())
            now = time.monotonic()
            for key, seen in list(self._seen.items()):
                if key.startswith("worker ") and int(key.split()[1]) in self._byes:
                    continue  # done: it waits for the others without a step to run
                if now - seen > self.timeout and not self._release.is_set():
                    if key in self._kills:
                        self._kills[key]()  # a stopped process ignores SIGTERM
                        name = self._names[key]
                    else:
                        rank = int(key.split()[1])
                        name = self.describe(rank) + (" (the chief)" if rank == 0 else "")
                    self._fail(f"{name} stopped responding: no heartbeat for {now - seen:.0f} "
                               f"s (tfpar.Config(liveness_timeout={self.timeout:g}))")
                    return
            if self.rank == 0 and not self._release.is_set():
                self._check_steps()

    # -- failing and closing ---------------------------------------------------------------------
    def _send(self, conn: socket.socket, line: str):
        with self._send_lock:
            try:
                conn.sendall((line + "\n").encode())
            except OSError:
                pass

    def _tell_everyone(self, line: str):
        if self.rank == 0:
            for conn in list(self._conns.values()):
                self._send(conn, line)
        elif self._link is not None:
            self._send(self._link, line)

    def fail(self, text: str):
        """A process of this job failed (`text` names it): tell everyone, then stop."""
        self._fail(text)

    def _fail(self, text: str):
        self._tell_everyone(f"DEAD {text}")
        self._die(text)

    def _die(self, text: str):
        with self._die_lock:
            if self._aborted or self.dying or (self.closing and self._release.is_set()):
                return  # this process is already on its way out, or done
            self.dying = True  # what stopping its own PS causes is not news
        sys.stderr.write(f"tfpar: {text}; stopping worker {self.rank} of the job\n")
        sys.stderr.flush()
        self._run_exit_callbacks()
        os._exit(EXIT_PEER_DIED)

    def abort(self, reason: str):
        """This worker failed: every other process of the job stops too."""
        if self.closing:
            return
        self.closing = self._aborted = True
        text = f"{self.describe(self.rank)} failed: {reason}"
        self.stopped_by = text
        sys.stderr.write(f"tfpar: {text}; stopping the job\n")
        sys.stderr.flush()
        self._tell_everyone(f"DEAD {text}")
        self._run_exit_callbacks()

    def close(self):
        """Waits until every worker is done, then runs the exit callbacks (at exit)."""
        if self.closing:
            return
        self.closing = True
        self._mine.kind, self._mine.since = "bye", time.monotonic()
        if self.rank == 0:
            with self._hub_lock:
                self._byes.add(0)
                self._maybe_release()
        elif self._link is not None:
            self._send(self._link, f"BYE {self._mine.steps} {int(self._mine.input_ended)}")
        self._release.wait()
        self._run_exit_callbacks()
        if sys.excepthook is self._hook:  # give the process its own hook back
            sys.excepthook = self._previous_hook

    def _run_exit_callbacks(self):
        while self._on_exit:
            try:
                self._on_exit.pop()()
            except Exception:  # noqa: BLE001 (leaving anyway; the others still run)
                pass

    def _install_excepthook(self):
        """A worker dying of an exception stops the job at once (others would wait on it)."""
        previous = self._previous_hook = sys.excepthook

        def hook(kind, value, tb):
            if kind.__name__ in _ECHO_ERRORS:
                deadline = time.monotonic() + min(_ECHO_GRACE_S, self.timeout)
                while not self.dying and time.monotonic() < deadline:
                    time.sleep(0.05)
            while self.dying:  # the failure was another process's, already reported:
                time.sleep(1)  # `_die` ends this process
            self.abort(summary(value))
            previous(kind, value, tb)

        self._hook = sys.excepthook = hook

