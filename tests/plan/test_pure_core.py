"""The pure core (the decision layer: tfpar.plan and tfpar.partition, every module of them)
imports and works without TensorFlow or Horovod installed."""
import os
import subprocess
import sys
import textwrap

from tests.support.launch import REPO

BLOCKED = textwrap.dedent("""
    import sys

    class Block:  # as if TensorFlow and Horovod were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "horovod"):
                raise ImportError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, Block())
""")


def pure_modules():
    """Every module of the decision layer."""
    out = []
    for package in ("plan", "partition"):
        for root, _, files in os.walk(os.path.join(REPO, "tfpar", package)):
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), REPO)[:-3]
                    out.append(rel.replace(os.sep, ".").replace(".__init__", ""))
    return sorted(out)


def test_the_pure_core_imports_without_tensorflow():
    assert "tfpar.plan.planner" in pure_modules() and len(pure_modules()) > 15
    code = BLOCKED + "import " + ", ".join(pure_modules()) + "\n" + textwrap.dedent("""
        from tfpar import Config, Plan
        from tfpar.plan.mesh import DeviceMesh
        from tfpar.partition.tiling import mlp, plan_tiling
        from tfpar.partition.counts.search import SearchResult
        plan = plan_tiling(mlp(64, [128, 128, 128]), DeviceMesh.hosts(2, 2, 1.25e9, 25e9))
        assert plan.devices == 4 and plan.total_bytes > 0
        assert not [m for m in sys.modules if m.split(".")[0] in ("tensorflow", "horovod")]
        print("pure core ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "pure core ok" in proc.stdout, proc.stderr[-3000:]


def test_the_block_does_block():
    """The check above could pass vacuously if the blocker did not work."""
    proc = subprocess.run([sys.executable, "-c", BLOCKED + "import tfpar.runtime.runner"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode != 0 and "blocked by the test" in proc.stderr
