"""Several real-script workers in one job, each writing into OUT_DIR/<worker>: one
TensorFlow import and one Horovod start for all, not one each (the suite's time).

usage: horovodrun -np N ... python real_scripts.py OUT_DIR WORKER...
       python real_scripts.py OUT_DIR --single N WORKER...   (their one-device references)
WORKER: a module of tests/support/workers with `main(out, single=None)`.
"""
import importlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(args):
    out, args = args[0], args[1:]
    single = None
    if args[:1] == ["--single"]:
        single, args = int(args[1]), args[2:]
    for name in args:
        worker = importlib.import_module(f"tests.support.workers.{name}")
        worker.main(os.path.join(out, name), single)


if __name__ == "__main__":
    main(sys.argv[1:])
