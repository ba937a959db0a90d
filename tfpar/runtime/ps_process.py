"""One host's parameter-server process, as the worker that spawned it sees it.

The host's first worker starts `python -m tfpar.runtime.ps_server` (job `ps`, task = host index),
which dies with it. The job's liveness links watch the PS like a worker: the parent pings
it, and names it when it dies or stops answering.

The process starts before it knows what to serve (`PsProcess()`, then `serve`): its
TensorFlow import, 1.5-2 s that the whole job would wait for, runs while the workers plan
and rewrite the graph (`cluster.prestart`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from tfpar.errors import TfparError
from tfpar.runtime.liveness import Liveness

START_TIMEOUT_S = 120


class PsProcess:
    """A PS child process: started at construction, given its part of the cluster by
    `serve`, watched by `watch`, ended by `stop`."""

    def __init__(self):
        self.task: Optional[int] = None
        self.liveness: Optional[Liveness] = None
        self.description = ""
        self._unresponsive = False
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL=os.environ.get(
            "TF_CPP_MIN_LOG_LEVEL", "2"))
        # Not a Horovod process: drop the launcher's variables so nothing mistakes it for one.
        for k in list(env):
            if k.startswith(("HOROVOD_", "OMPI_", "PMI_")):
                env.pop(k)
        self.proc = subprocess.Popen([sys.executable, "-m", "tfpar.runtime.ps_server"],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self._stderr = []  # read from the start, so its pipe never fills while it waits
        self._stderr_done = threading.Thread(target=self._read_stderr, daemon=True,
                                             name="tfpar-ps-stderr")
        self._stderr_done.start()

    def serve(self, cluster: dict, task: int, liveness: Liveness, description: str):
        """Tells the process its cluster and task; from now on its death is the job's."""
        self.task, self.liveness, self.description = task, liveness, description
        try:
            self.proc.stdin.write(json.dumps({"cluster": cluster, "task": task}) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it died: its watcher reports that
        threading.Thread(target=self._report_death, daemon=True, name="tfpar-ps-watch").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, port: int, host: str):
        """Returns when the PS listens on `port` (or has died: its watcher reports that)."""
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)  # a connection attempt is cheap; the job waits on this
        raise TfparError(f"the parameter server of host {host} did not start within "
                         f"{START_TIMEOUT_S} s")

    def watch(self):
        """Adds the PS to the job's liveness links, kept alive by heartbeats."""
        key = f"ps {self.task}"
        self.liveness.watch(key, f"{self.description} (pid {self.pid})", self._kill_unresponsive)
        threading.Thread(target=self._heartbeats, daemon=True,
                         name="tfpar-ps-heartbeat").start()

    def stop(self):
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _read_stderr(self):
        if self.proc.stderr is not None:
            self._stderr.append(self.proc.stderr.read())

    def _report_death(self):
        proc = self.proc
        code = proc.wait()
        self._stderr_done.join()
        err = "".join(self._stderr)
        if self.liveness.closing or self.liveness.dying or self._unresponsive:
            return
        tail = " ".join(err.strip().splitlines()[-3:])
        self.liveness.fail(f"{self.description} (pid {proc.pid}) died with exit code {code}"
                           + (f": {tail}" if tail else ""))

    def _heartbeats(self):
        """PING the PS; its PONGs (read by a second thread) mark it alive."""
        proc, key = self.proc, f"ps {self.task}"

        def read():
            for line in proc.stdout:
                if line.strip() == "PONG":
                    self.liveness.beat(key)

        threading.Thread(target=read, daemon=True, name="tfpar-ps-pong").start()
        while proc.poll() is None and not self.liveness.closing:
            try:
                proc.stdin.write("PING\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                return  # it died: the watcher reports that
            time.sleep(self.liveness.interval())

    def _kill_unresponsive(self):
        self._unresponsive = True  # its watcher must not report a death
        self.proc.kill()  # a stopped process ignores SIGTERM until continued
