"""What the benchmarks print about themselves: the machine, and the command that ran."""
import os
import platform
import sys


def machine() -> str:
    """CPU model, cores, memory and kernel of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/meminfo") as f:
            memory = f", {int(f.readline().split()[1]) / 2 ** 20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    return f"{cpu}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}"


def invocation(argv=None) -> str:
    """The command line of a benchmark run as a module (`python -m scripts.NAME ...`)."""
    argv = list(argv or sys.argv)
    name = os.path.splitext(os.path.basename(argv[0]))[0]
    return " ".join(["python", "-m", f"scripts.{name}", *argv[1:]])
