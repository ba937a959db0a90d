"""Horovod's own `horovodrun`, with its build checks remembered: `python PATH/horovodrun.py
ARGS...` (run by path, `COMMAND` below) takes horovodrun's arguments and runs its code.

Before every launch horovodrun forks a process that imports `horovod.tensorflow`, and with
it TensorFlow, only to ask whether the extension was built with Gloo (or MPI): about 3 s of
a core per launch, more than a small job's training, and paid again at each relaunch of
`tfpar run`. The answer depends only on the installed extension, so here it is asked once
and remembered in `~/.cache/tfpar/horovod-build-checks.json`, keyed by the extension
file's path, size and modification time (a rebuilt Horovod is asked again). Nothing else
of horovodrun changes.

Run by path, not with `-m`, so that starting it does not import tfpar (and TensorFlow).
"""
import json
import os
import sys

COMMAND = [sys.executable, os.path.abspath(__file__)]  # the launcher's command line
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tfpar", "horovod-build-checks.json")


def _extension_key() -> str:
    import horovod
    from horovod.common import util
    path = os.path.join(os.path.dirname(horovod.__file__), "tensorflow",
                        "mpi_lib" + util.get_ext_suffix())
    try:
        st = os.stat(path)
    except OSError:
        return ""  # no TensorFlow extension: ask every time, as horovodrun does
    return f"{path} {st.st_size} {st.st_mtime_ns}"


def _remembered(name, check):
    def answer(verbose=False):
        key = _extension_key()
        if not key:
            return check(verbose=verbose)
        try:
            with open(CACHE) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        entry = f"{name} {key}"
        if entry not in known:
            known[entry] = check(verbose=verbose)
            try:  # written whole, then renamed: launches at the same time read a whole file
                os.makedirs(os.path.dirname(CACHE), exist_ok=True)
                tmp = f"{CACHE}.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(known, f)
                os.replace(tmp, CACHE)
            except OSError:
                pass  # not remembered: the next launch asks again
        return known[entry]
    return answer


def main():
    from horovod.common import util
    from horovod.runner import launch
    launch.gloo_built = _remembered("gloo_built", util.gloo_built)
    launch.mpi_built = _remembered("mpi_built", util.mpi_built)
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":
    sys.path.pop(0)  # this folder: its modules must not shadow top-level names
    sys.exit(main())
