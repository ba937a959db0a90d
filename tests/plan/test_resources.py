"""Parsing resources and checking them against the running job."""
import socket

import pytest

from tfpar import TfparError
from tfpar.plan.layout import Host, Layout, job_layout, parse_resources, reconcile


def test_parse_string():
    layout = parse_resources("host1:2, host2:3")
    assert layout.hosts == (Host("host1", 2), Host("host2", 3))
    assert layout.num_workers == 5 and layout.host_of_rank(2) == 1
    assert parse_resources("solo").hosts == (Host("solo", 1),)
    assert parse_resources(None) is None


def test_parse_file(tmp_path):
    f = tmp_path / "hosts.txt"
    f.write_text("# cluster\nnode1: 0,1,2,3\nnode2:1, 3\nnode3\n")
    layout = parse_resources(str(f))
    assert layout.hosts == (Host("node1", 4, (0, 1, 2, 3)), Host("node2", 2, (1, 3)),
                            Host("node3", None))


@pytest.mark.parametrize("bad, message", [
    ("host:x", "integer"), ("host:0", "at least 1"), ("a:1,a:2", "more than once"),
    ("", "empty"), (":2", "host:slots"), ("/no/such/file.txt", "does not exist"),
])
def test_bad_resources(bad, message):
    with pytest.raises(TfparError, match=message):
        parse_resources(bad)


def test_bad_file_line(tmp_path):
    f = tmp_path / "hosts.txt"
    f.write_text("node1: zero\n")
    with pytest.raises(TfparError, match="hosts.txt:1"):
        parse_resources(str(f))


def test_job_layout_groups_consecutive_ranks():
    assert job_layout(["a", "a", "b", "b", "b"]) == Layout((Host("a", 2), Host("b", 3)))


def test_reconcile():
    me = socket.gethostname()
    job = job_layout([me, me])
    assert reconcile(None, job) == job
    assert reconcile(parse_resources("localhost:2"), job).num_workers == 2
    with pytest.raises(TfparError, match="3 worker"):
        reconcile(parse_resources("localhost:3"), job)
    with pytest.raises(TfparError, match="2 host"):
        reconcile(parse_resources("localhost:1,otherhost:1"), job)
    # A file line without GPU ids takes its worker count from the job.
    assert reconcile(Layout((Host("localhost", None),)), job).hosts[0].slots == 2
