"""A parameter-server process: `python -m tfpar.runtime.ps_server SPEC_JSON` (started by tfpar).

SPEC_JSON is {"cluster": {"worker": [...], "ps": [...]}, "task": i}. The process serves
job `ps`, task i, until it is told to stop or its parent (the host's first worker) dies,
and answers its parent's heartbeats (PING on stdin, PONG on stdout).
"""
import ctypes
import json
import os
import signal
import sys


def _die_with_parent():
    """Linux: get SIGKILL when the worker that spawned this process dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(spec_json: str):
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    spec = json.loads(spec_json)
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps"])
    server = tf.distribute.Server(tf.train.ClusterSpec(spec["cluster"]), job_name="ps",
                                  task_index=spec["task"], config=config, start=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Heartbeats: the parent writes PING lines and expects PONG back, so a PS that stops
    # responding (stopped, swapping, cut off) is noticed; EOF means the parent is gone.
    for line in sys.stdin:
        if line.strip() == "PING":
            sys.stdout.write("PONG\n")
            sys.stdout.flush()
    server.join()


if __name__ == "__main__":
    main(sys.argv[1])
