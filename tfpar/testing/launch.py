"""The `horovodrun` command line of a job, locally or on an emulated cluster's hosts.

One place builds it, for the tests and the benchmarks alike: horovodrun with its build
check remembered (`tfpar.runtime.horovodrun`), Gloo, one slot a worker,
the running interpreter on every host, and an environment in which `repo` (a checkout's
root, for its `tests` and `examples` packages) is importable.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.runtime.horovodrun import COMMAND as HOROVODRUN  # horovodrun, its checks remembered


def horovodrun_command(np_: int, argv: Sequence[str], hosts: Optional[str] = None,
                       cluster=None, repo: Optional[str] = None,
                       env: Optional[Dict[str, str]] = None, log_level: str = "2"
                       ) -> Tuple[List[str], Dict[str, str]]:
    """(command, environment) that runs `python argv...` as `np_` workers.

    hosts: horovodrun's -H (default all on this host); cluster: a
    `tfpar.testing.emulate.EmulatedCluster` whose first host runs the command, as a user logged
    in there would type it (Horovod reaches the others by ssh, in the same folder and
    environment); env: variables added to the environment.
    """
    options = ["--gloo", "-np", str(np_), "-H", hosts or f"localhost:{np_}"]
    if cluster is not None:
        # Horovod caches which hosts it checked; emulated clusters reuse names and addresses.
        options.append("--disable-cache")
    cmd = [*HOROVODRUN, *options, sys.executable, *argv]
    if cluster is not None:
        cmd = cluster.command(cmd)
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=log_level, PYTHONUNBUFFERED="1")
    if repo is not None:
        full["PYTHONPATH"] = repo + os.pathsep + os.environ.get("PYTHONPATH", "")
    full.update(env or {})
    return cmd, full


def run_for_json(np_: int, argv: Sequence[str], what: str, hosts: Optional[str] = None,
                 cluster=None, repo: Optional[str] = None, timeout: float = 600) -> dict:
    """Runs `python argv... --out PATH` as `np_` workers (as `horovodrun_command`) and
    returns the JSON its worker wrote to PATH; a failed job raises with its output's tail,
    `what` naming it."""
    import json
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd, env = horovodrun_command(np_, [*argv, "--out", out], hosts, cluster, repo,
                                      log_level="3")
        proc = subprocess.run(cmd, env=env, cwd=repo, timeout=timeout, capture_output=True,
                              text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{what} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)
