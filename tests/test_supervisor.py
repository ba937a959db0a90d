"""`tfpar run`'s reading of a failed launch and its host bookkeeping (no job started; the
launcher with real kills: tests/jobs/test_recovery.py)."""
import pytest

from tfpar import supervisor


def test_a_death_is_a_fault_on_the_host_it_names():
    out = ("[1]<stderr>:tfpar: worker 1 (host h2, pid 4242) died; stopping worker 0 of the job\n"
           "[0]<stderr>:tfpar: worker 1 (host h2, pid 4242) died; stopping worker 2 of the job\n")
    v = supervisor.judge(17, out)
    assert (v.kind, v.host) == ("fault", "h2")
    assert "pid 4242" in v.text and "pid _" in v.key  # the same fault, the same key


def test_a_workers_exception_is_the_scripts_error():
    out = "[0]<stderr>:tfpar: worker 0 (host h1, pid 7) failed: ValueError: bad lr; stopping the job\n"
    assert supervisor.judge(1, out) == supervisor.Verdict("error", "ValueError: bad lr", "h1")


def test_a_traceback_before_tfpar_started_is_an_error_and_silence_a_fault():
    out = "[1]<stderr>:Traceback (most recent call last):\n[1]<stderr>:NameError: name 'x'\n"
    assert supervisor.judge(1, out).kind == "error"
    assert supervisor.judge(-9, "Process 1 exit with status code -9.\n").kind == "fault"


def test_the_command_and_the_hosts():
    options, command = supervisor.split_command(["--gloo", "-np", "4", "-H", "a:2,b:2", "--",
                                                 "python", "train.py"])
    assert command == ["python", "train.py"]
    assert supervisor._hosts(options) == (4, {"a": 2, "b": 2})
    assert supervisor._with_hosts(options, 2, {"a": 2}) == ["--gloo", "-np", "2", "-H", "a:2"]
    with pytest.raises(ValueError, match="after `--`"):
        supervisor.split_command(["-np", "2", "python", "train.py"])
