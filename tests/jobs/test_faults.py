"""Killing a process of a PS job mid-training stops the whole job, cleanly.

Each case starts a real 2-worker HYBRID job (one host: worker 0 spawns its PS), waits
until both workers train, kills one process with SIGKILL and checks that the job ends
non-zero within 60 s, that the output names what died, and that no process of the job and
no port it bound is left. The jobs mostly wait (for training, for the liveness timeout), so
they run two at a time.
"""
import json
import os
import random
import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.support.launch import REPO, WORKERS, concurrent_jobs, horovodrun_command


FAULT_WORKER = os.path.join(WORKERS, "fault.py")


def _start(out_dir, *args, np_=2, hosts=None, cluster=None):
    cmd, env = horovodrun_command(np_, FAULT_WORKER, str(out_dir), *args, hosts=hosts,
                                  cluster=cluster)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)


def _wait_training(proc, out_dir, n=2, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = [out_dir / f"rank{r}.json" for r in range(n)]
        if all(f.exists() and f.stat().st_size for f in files):
            time.sleep(0.3)
            return [json.loads(f.read_text()) for f in files]
        if proc.poll() is not None:
            pytest.fail("the job ended before training:\n" + proc.stdout.read()[-5000:])
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the job did not start training in time")


def _alive(pids):
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def listening(ports):
    """Which of `ports` some process still listens on (sockets of closed connections may
    linger in TIME_WAIT or FIN_WAIT, but they serve nothing)."""
    return sorted({c.laddr.port for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports})


# A dead worker is named by tfpar's liveness check or, when horovodrun's own watch of its
# children stops the survivors first, by horovodrun ("Process name: R", exit code 137 for
# SIGKILL). Only tfpar can see a PS die: that message must be tfpar's.
@pytest.mark.parametrize("victim, message", [
    ("worker 1", r"worker 1 \(host localhost, pid {pid}\) died|Process name: 1\nExit code: 137"),
    ("worker 0", r"worker 0 \(host localhost, pid {pid}\) \(the chief\) died"
                 r"|Process name: 0\nExit code: 137"),
    ("ps", r"parameter server ps:0 \(host localhost\) \(pid {pid}\) died with exit code -9"),
])
def test_killing_a_process_stops_the_job(jobs, victim, message):
    hit = jobs[("kill", victim)].result()
    pid, output, info = hit.pid, hit.output, hit.info
    assert hit.returncode != 0
    assert hit.elapsed < 60, hit.elapsed
    assert re.search(message.format(pid=pid), output), output[-5000:]
    assert "unexpected" not in output
    pids = [i["pid"] for i in info] + [info[0]["ps_pid"]]
    deadline = time.time() + 10  # processes stopping at that moment may take a moment
    while time.time() < deadline and _alive(pids):
        time.sleep(0.2)
    left = [(p, psutil.Process(p).status(), psutil.Process(p).cmdline()[:4]) for p in _alive(pids)]
    assert not left, f"left running: {left} of {pids}"
    ports = sorted({p for i in info for p in i["ports"]})
    assert len(ports) >= 4  # two worker servers, one PS, the liveness hub
    assert listening(ports) == []


def kill_job(out_dir, victim):
    """Starts a job (the default liveness timeout), SIGKILLs `victim` once both workers
    train and waits for the job's end (what it printed, the seconds after the kill)."""
    proc = _start(out_dir)
    try:
        info = _wait_training(proc, out_dir)
        pid = info[0]["ps_pid"] if victim == "ps" else info[int(victim.split()[1])]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=90)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    return _Hit(pid=pid, output=output, elapsed=elapsed, returncode=proc.returncode, info=info)


LIVENESS_TIMEOUT = 8


# A stopped (not dead) process keeps its connections open: only heartbeats can tell. The
# job must end within the liveness timeout (plus start-up of the check and teardown),
# naming the stopped process, not a healthy peer. (A stopped worker 1 may also make Gloo
# give up after ~30 s; the timeout here is shorter, so tfpar speaks first.)
@pytest.mark.parametrize("victim, message", [
    ("worker 1", r"worker 1 \(host localhost, pid {pid}\) stopped responding"),
    ("worker 0", r"worker 0 \(host localhost, pid {pid}\) \(the chief\) stopped responding"),
    ("ps", r"parameter server ps:0 \(host localhost\) \(pid {pid}\) stopped responding"),
])
def test_a_stopped_process_is_named_and_stops_the_job(jobs, victim, message):
    hit = jobs[("stop", victim)].result()
    assert hit.returncode != 0
    assert hit.elapsed < LIVENESS_TIMEOUT + 20, hit.elapsed
    assert re.search(message.format(pid=hit.pid), hit.output), hit.output[-5000:]
    assert "unexpected" not in hit.output
    # No healthy process is blamed as the one that stopped.
    for other in ("worker 0", "worker 1"):
        if other != victim:
            assert not re.search(rf"{other} \(host localhost, pid \d+\)( \(the chief\))? "
                                 "stopped", hit.output), hit.output[-5000:]
    assert not hit.left, f"left running (then killed by the test): {hit.left}"
    assert listening(hit.ports) == []


class _Hit:
    """What happened after one process of a job was signalled."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def signal_job(tmp_path, victim, sig, delay=0.0, np_=2, hosts=None, cluster=None):
    """Starts a job (liveness timeout LIVENESS_TIMEOUT), sends `sig` to `victim` ("worker
    R", "ps" for the first host's PS, "ps R" for the PS that rank R spawned) `delay` s
    after training started, waits for the job's end and for its processes to go; kills
    whatever is left (never leaving a stopped process) after recording it."""
    proc = _start(tmp_path, str(LIVENESS_TIMEOUT), np_=np_, hosts=hosts, cluster=cluster)
    info, left = [], []
    try:
        info = _wait_training(proc, tmp_path, n=np_)
        time.sleep(delay)
        kind, _, rank = victim.partition(" ")
        pid = info[int(rank or 0)]["ps_pid" if kind == "ps" else "pid"]
        os.kill(pid, sig)
        hit_at = time.time()
        output, _ = proc.communicate(timeout=120)
        elapsed = time.time() - hit_at
        pids = [i["pid"] for i in info] + [i["ps_pid"] for i in info if i["ps_pid"]]
        deadline = time.time() + 10
        while time.time() < deadline and _alive(pids):
            time.sleep(0.2)
        left = _alive(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(info)
    return _Hit(pid=pid, output=output, elapsed=elapsed, left=left, returncode=proc.returncode,
                ports=sorted({p for i in info for p in i["ports"]}), info=info)


CHAOS_RUNS = 3  # seeds 0-2: worker 1 and worker 0 killed, the PS stopped (each role once)


def chaos(run):
    """Run `run`'s random fault: (victim, signal, delay after training started)."""
    rng = random.Random(1000 + run)
    return (rng.choice(["worker 0", "worker 1", "ps"]),
            rng.choice([signal.SIGKILL, signal.SIGSTOP]), rng.uniform(0.0, 2.0))


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """{(kind, victim or run): a future of the test's job}, for the selected tests."""
    def key_of(test, params):
        if "run" in params:
            return "chaos", params["run"]
        return ("kill" if test == "test_killing_a_process_stops_the_job" else "stop"), \
            params["victim"]

    def run(key):
        kind, which = key
        folder = tmp_path_factory.mktemp(f"{kind}_{which}".replace(" ", "_"))
        if kind == "kill":
            return kill_job(folder, which)
        if kind == "stop":
            return signal_job(folder, which, signal.SIGSTOP)
        return signal_job(folder, *chaos(which))
    return concurrent_jobs(request, key_of, run)


@pytest.mark.parametrize("run", range(CHAOS_RUNS))
def test_chaos_a_random_role_killed_or_stopped_at_a_random_time(jobs, run):
    """Each run picks (from a seed shown on failure) a role, SIGKILL or SIGSTOP, and a moment
    after training started; the job must end in time, name that process, leave nothing."""
    seed = 1000 + run
    victim, sig, delay = chaos(run)
    hit = jobs[("chaos", run)].result()
    case = f"seed {seed}: {signal.Signals(sig).name} of {victim} after {delay:.2f} s"
    assert hit.returncode != 0, case
    assert hit.elapsed < LIVENESS_TIMEOUT + 20, (case, hit.elapsed)
    rank = victim.split()[1] if victim != "ps" else None
    named = (rf"parameter server ps:0 \(host localhost\) \(pid {hit.pid}\)" if victim == "ps"
             else rf"worker {rank} \(host localhost, pid {hit.pid}\)")
    # horovodrun itself may name a killed worker first ("Process name: R").
    alternative = rf"|Process name: {rank}\n" if victim != "ps" and sig == signal.SIGKILL else ""
    assert re.search(named + alternative, hit.output), (case, hit.output[-5000:])
    assert not hit.left, (case, hit.left)
    assert listening(hit.ports) == [], case


def test_no_tfpar_socket_listens_on_a_wildcard_address(tmp_path):
    """During a job, the only wildcard listeners of the job's processes are TensorFlow's
    gRPC servers (TF 2.18 binds them to 0.0.0.0; README, security). tfpar's own liveness
    hub binds the job's address (127.0.0.1 here) and closes once every worker connected."""
    proc = _start(tmp_path)
    info = []
    try:
        info = _wait_training(proc, tmp_path)
        wildcard, other = set(), set()
        for pid in [i["pid"] for i in info] + [info[0]["ps_pid"]]:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    (wildcard if c.laddr.ip in ("0.0.0.0", "::") else other).add(c.laddr.port)
    finally:
        proc.kill()
        proc.communicate()
        _kill_all(info)
    tf_ports = {p for i in info for p in i["tf_ports"]}
    assert wildcard and wildcard <= tf_ports, (wildcard, tf_ports)


def _kill_all(info):
    for p in _alive([i["pid"] for i in info] + [i["ps_pid"] for i in info if i["ps_pid"]]):
        os.kill(p, signal.SIGKILL)
