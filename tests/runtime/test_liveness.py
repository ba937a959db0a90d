"""The liveness hub admits only the job's workers, and tfpar binds the job's interface."""
import os
import subprocess
import sys

import pytest

import tfpar
from tfpar.runtime import liveness
from tfpar.errors import TfparError
from tests.support.launch import REPO

# Worker 0's hub in a process of its own (a failing liveness check ends its process), a
# stranger and the genuine worker 1 knocking. Prints one line per check.
HUB_SCRIPT = r'''
import socket, sys, time
from tfpar.runtime import liveness as L
from tfpar.errors import TfparError

hub = socket.socket(); hub.bind(("127.0.0.1", 0)); hub.listen(4)
address = "127.0.0.1:%d" % hub.getsockname()[1]
members = [{"rank": 0, "host": "localhost", "pid": 1, "hub": address},
           {"rank": 1, "host": "localhost", "pid": 2, "hub": address}]
live = L.Liveness(0, members, "job-secret", 60.0, None, hub)

def knock(secret, rank=1):
    c = socket.create_connection(("127.0.0.1", hub.getsockname()[1]), timeout=5)
    f = c.makefile("r")
    word, nonce = f.readline().split()
    c.sendall(("HELLO %d mine %s\n" % (rank, L.handshake_mac(secret, "worker %d %s" % (rank, nonce)))).encode())
    return c, f.readline().split()

c, answer = knock("guessed")
print("stranger:", answer or "refused")
c, answer = knock("job-secret", rank=0)
print("rank 0 claimed:", answer or "refused")
c, answer = knock("job-secret")
print("worker 1:", answer[0], answer[1] == L.handshake_mac("job-secret", "hub mine"))
time.sleep(0.3)
try:
    socket.create_connection(("127.0.0.1", hub.getsockname()[1]), timeout=2)
    print("port: open")
except OSError:
    print("port: closed")

# A worker refuses a hub that does not know the secret.
fake = socket.socket(); fake.bind(("127.0.0.1", 0)); fake.listen(1)
fake_address = "127.0.0.1:%d" % fake.getsockname()[1]
import threading
def impostor():
    conn, _ = fake.accept(); f = conn.makefile("r")
    conn.sendall(b"CHALLENGE abc\n"); f.readline(); conn.sendall(b"WELCOME 0000\n")
threading.Thread(target=impostor, daemon=True).start()
try:
    L.Liveness(1, [dict(members[0], hub=fake_address), members[1]], "job-secret", 60.0, None)
    print("impostor: accepted")
except TfparError as e:
    print("impostor:", e)
c.sendall(b"BYE 0 0\n")  # the genuine worker is done: the hub's last barrier releases
'''


def test_hub_admits_only_workers_that_know_the_job_secret():
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "stranger: refused" in out and "rank 0 claimed: refused" in out, out
    assert "worker 1: WELCOME True" in out, out
    assert "port: closed" in out, out  # once every worker is in, nothing listens
    assert "impostor: worker 1: the process at 127.0.0.1:" in out
    assert "failed the job-secret check" in out
    assert proc.stderr.count("refused a connection to the liveness hub from 127.0.0.1") == 2


def test_interface_address_and_job_address():
    assert liveness.interface_address("lo") == "127.0.0.1"
    assert liveness.job_address("localhost", "lo") == "127.0.0.1"
    with pytest.raises(TfparError, match=r"Config\(interface='nosuch0'\): this host has no "
                                         r"IPv4 address on that interface"):
        liveness.job_address("localhost", "nosuch0")


@pytest.mark.parametrize("kwargs, message", [
    ({"step_deadline": 0}, r"step_deadline must be a positive number of seconds or None"),
    ({"step_deadline": True}, r"step_deadline must be"),
    ({"interface": ""}, r"interface must be a network interface name"),
    ({"liveness_timeout": -1}, r"liveness_timeout must be a positive number"),
    ({"first_step_deadline": 0}, r"first_step_deadline must be a positive number"),
])
def test_config_rejects_bad_liveness_settings(kwargs, message):
    with pytest.raises(TfparError, match=message):
        tfpar.Config(**kwargs)


def test_config_defaults_bound_every_wait():
    c = tfpar.Config()
    assert c.liveness_timeout == 30.0 and c.step_deadline == 600.0 and c.interface is None
    assert tfpar.Config(step_deadline=None).step_deadline is None
    assert tfpar.Config().first_step_deadline == 120.0


def test_closing_gives_the_process_its_excepthook_back():
    script = ("import sys\nfrom tfpar.runtime import liveness as L\nbefore = sys.excepthook\n"
              "live = L.Liveness(0, [{'rank': 0, 'host': 'h', 'pid': 1, 'hub': ''}], 's', 5.0,"
              " None)\nprint('installed', sys.excepthook is not before)\nlive.close()\n"
              "print('restored', sys.excepthook is before)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.split() == ["installed", "True", "restored", "True"], proc.stderr


def test_a_stage_is_the_first_one_a_step_has_not_passed():
    from tfpar.transform import stages
    counts = {"read": [3], "joined": [2, 3], "pushed": [2], "token": [2]}
    assert stages.describe(counts, 2) == stages.STAGES["joined"]  # one of two not passed
    assert stages.describe({"read": [2]}, 2) == stages.STAGES["read"]
    assert "every marked stage passed" in stages.describe({"read": [3], "token": [3]}, 2)
    # Update groups run by turns: each counter against its own group's steps, and those
    # of a group this step does not run (None) are not waited for.
    counts = {"read": [2, 1], "pushed": [2, 1], "token": [1, 1]}
    done = {"read": [1, None], "pushed": [1, None], "token": [1, None]}
    assert stages.describe(counts, done) == stages.STAGES["token"]
    done = {"read": [None, 1], "pushed": [None, 1], "token": [None, 1]}
    assert stages.describe(counts, done) == stages.STAGES["read"]
