"""`tfpar run`: launches a job through `horovodrun` and relaunches it when it fails.

A job that saves checkpoints (`tfpar.MonitoredTrainingSession(checkpoint_dir=...)`, or
`Runner.save`/`restore` in the script) resumes from its latest one, so a failure costs
at most the steps since then. What failed is read from tfpar's own last words (liveness
names the process that died or stalled, or the exception a worker raised):

- a process that died, stopped answering or stalled, or a host that could not be reached,
  is a fault: the job is relaunched, up to `restarts` times within `window` seconds;
- an exception in a worker (the script's own error, a bad argument) is reported; it is
  relaunched once, in case it was a consequence of a fault, and when the same error comes
  again the launcher stops with it;
- a host named in `host_failures` faults is left out of the next launch when the workers
  left are at least `min_np` (the checkpoint restores into any worker count: the global
  batch shrinks with the workers, see the README).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.runtime.horovodrun import COMMAND as HOROVODRUN

_LAST_WORDS = re.compile(r"tfpar: (.*?); stopping (?:the job|worker \d+ of the job)")
_FAILED = re.compile(r"\bfailed: (.*)$")
_HOST = re.compile(r"\bhost ([^,\s)]+)")
_PID = re.compile(r"\bpid \d+")
_TRACEBACK_END = re.compile(r"^(?:\[\d+\]<std(?:err|out)>:)?([A-Za-z_][\w.]*(?:Error|Exception)"
                            r"\b.*)$")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What ended a failed launch: kind "fault" (retry) or "error" (the script's own), the
    text that says so, and the host it names (None: no host named)."""

    kind: str
    text: str
    host: Optional[str] = None

    @property
    def key(self) -> str:
        """The text without process ids: the same failure reads the same on every launch."""
        return _PID.sub("pid _", self.text)


def judge(returncode: int, output: str) -> Verdict:
    """Reads a failed launch's output."""
    words = _LAST_WORDS.findall(output)
    if words:
        first = words[0]  # the first process to speak saw the cause; the rest echo it
        host = _HOST.search(first)
        failed = _FAILED.search(first)
        if failed and not re.search(r"died|stopped answering|no step|did not call", first):
            return Verdict("error", failed.group(1).strip(), host.group(1) if host else None)
        return Verdict("fault", first, host.group(1) if host else None)
    tracebacks = [m.group(1) for line in output.splitlines()
                  for m in [_TRACEBACK_END.match(line.strip())] if m]
    if tracebacks:  # a worker that failed before tfpar's liveness was up
        return Verdict("error", tracebacks[-1])
    return Verdict("fault", f"the job exited with status {returncode} and no message from "
                            "tfpar (a process was killed, or a host could not be reached)")


def split_command(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(horovodrun's options, the command) from `[options] -- command...`."""
    argv = list(argv)
    if "--" not in argv:
        raise ValueError("tfpar run: give the command after `--`, e.g. "
                         "tfpar run -np 4 -H a:2,b:2 -- python train.py")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _hosts(options: List[str]) -> Tuple[Optional[int], Optional[Dict[str, int]]]:
    np_, hosts = None, None
    for i, o in enumerate(options[:-1]):
        if o in ("-np", "--num-proc"):
            np_ = int(options[i + 1])
        elif o in ("-H", "--hosts"):
            hosts = {h.split(":")[0]: int(h.split(":")[1]) if ":" in h else 1
                     for h in options[i + 1].split(",")}
    return np_, hosts


def _with_hosts(options: List[str], np_: int, hosts: Dict[str, int]) -> List[str]:
    out, skip = [], False
    for i, o in enumerate(options):
        if skip:
            skip = False
            continue
        if o in ("-np", "--num-proc", "-H", "--hosts"):
            skip = True
            continue
        out.append(o)
    return out + ["-np", str(np_), "-H", ",".join(f"{h}:{n}" for h, n in hosts.items())]


def _launch(command: List[str], echo) -> Tuple[int, str]:
    """Runs the command, echoing its output as it comes; (status, the output's tail)."""
    tail: collections.deque = collections.deque(maxlen=400)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    for line in proc.stdout:
        echo(line)
        tail.append(line)
    return proc.wait(), "".join(tail)


def run(options: Sequence[str], command: Sequence[str], restarts: int = 3,
        window: float = 3600.0, host_failures: int = 2, min_np: Optional[int] = None,
        echo=None, horovodrun: Optional[str] = None) -> int:
    """Runs `horovodrun options command` until it succeeds, relaunching it after faults.

    Returns the job's exit status: 0, or the last failure's when the launcher gave up.
    """
    echo = echo or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    say = lambda text: echo(f"tfpar run: {text}\n")  # noqa: E731
    # This interpreter's Horovod launcher, its build check asked once, not at every launch.
    launcher = [horovodrun] if horovodrun else list(HOROVODRUN)
    options = list(options)
    np_, hosts = _hosts(options)
    faults_of: collections.Counter = collections.Counter()
    restarted: List[float] = []
    last_error: Optional[str] = None
    launches = 0
    while True:
        launches += 1
        argv = [*launcher, *options, *command]
        say(f"launch {launches}: {' '.join(argv)}")
        started = time.time()
        status, output = _launch(argv, echo)
        if status == 0:
            say(f"the job succeeded (launch {launches}, {len(restarted)} restart(s))")
            return 0
        verdict = judge(status, output)
        say(f"launch {launches} failed after {time.time() - started:.0f} s: {verdict.text}")
        if verdict.kind == "error":
            if verdict.key == last_error:
                say("the same error again: it is the script's own; not relaunching")
                return status
            last_error = verdict.key
        else:
            last_error = None
        now = time.time()
        recent = [t for t in restarted if now - t < window]
        if len(recent) >= restarts:
            say(f"{len(recent)} restart(s) within {window:.0f} s already (--restarts "
                f"{restarts}): giving up")
            return status
        if verdict.kind == "fault" and verdict.host and hosts and verdict.host in hosts:
            faults_of[verdict.host] += 1
            left = (np_ or sum(hosts.values())) - hosts[verdict.host]
            if faults_of[verdict.host] >= host_failures and len(hosts) > 1 and \
                    left >= (min_np or left + 1):
                del hosts[verdict.host]
                np_ = left
                options = _with_hosts(options, np_, hosts)
                say(f"host {verdict.host} failed {faults_of[verdict.host]} times: left out; "
                    f"going on with {np_} worker(s) (the checkpoint restores into any count)")
        restarted.append(now)
        say(f"relaunching (restart {len(restarted)} of at most {restarts} within "
            f"{window:.0f} s)")
