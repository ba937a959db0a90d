"""A parameter-server process: `python -m tfpar.runtime.ps_server` (started by tfpar).

It loads TensorFlow's server (`surgery.server_only`: not TensorFlow's API), then reads
its spec, one line of JSON on stdin: {"cluster": {"worker": [...], "ps": [...]}, "task":
i} (an empty line or EOF: not needed after all, it exits). It serves job `ps`, task i, until it is told to stop or its parent
(the host's first worker) dies, and answers its parent's heartbeats (PING on stdin, PONG
on stdout). Reading the spec after the import lets the parent start it before the job's
ports are known (`PsProcess`), so the import overlaps the graph's rewrite.
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


def main():
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    from tfpar.transform import surgery
    server_class, cluster_spec, config_proto = surgery.server_only()

    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    spec = json.loads(line)

    config = config_proto(device_filters=["/job:ps"])
    server = server_class(cluster_spec(spec["cluster"]), job_name="ps",
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
    main()
