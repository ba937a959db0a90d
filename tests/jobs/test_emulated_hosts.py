"""tfpar across two emulated hosts: what `-H localhost:2,127.0.0.1:2` cannot show.

`tfpar.testing.emulate.EmulatedCluster` makes two hosts on this machine (network namespaces h1 and
h2 with their own host names, addresses 198.18.0.1-2 and sshd, on links shaped to
1 Gbit/s); horovodrun starts on h1 and reaches h2 over ssh, as on a real cluster. So the
servers must be dialled at the right addresses, host names differ, and every byte between
hosts crosses a shaped link. The equivalence tolerance is test_equivalence's (rtol=1e-5,
atol=1e-6 after 4 steps).
"""
import dataclasses
import itertools
import json
import os
import re
import signal

import pytest

from tests.support.launch import REPO, horovodrun, processes_running, run_scenarios
from tests.support.reference import check, each_scenario
from tests.jobs.test_faults import LIVENESS_TIMEOUT, listening, signal_job
from tests.jobs.test_parameter_server import SCENARIOS_4, check_routes
from tfpar.testing.emulate import EmulatedCluster
from tfpar.plan import routing


SCENARIOS = [s for s in SCENARIOS_4 if s["name"] in (
    "hybrid_adam_p2", "hybrid_adagrad_p1_no_local_aggregation", "ps_adagrad_p3")]


@pytest.fixture(scope="module")
def cluster():
    c = EmulatedCluster(hosts=2, rate="1gbit", name="tfpt")
    c.up()
    try:
        yield c
    finally:
        c.down()
        assert c.leftovers() == []


@pytest.fixture(scope="module")
def results(cluster, tmp_path_factory):
    before = cluster.wire_bytes()
    out = run_scenarios(tmp_path_factory.mktemp("emulated"), 4, SCENARIOS,
                        hosts=cluster.hosts_arg(2), cluster=cluster)
    after = cluster.wire_bytes()
    return out, {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after}


@each_scenario(SCENARIOS)
def test_two_emulated_hosts_equal_single_device(results, scenario):
    out, _ = results
    ranks = check(out, scenario, 4)
    check_routes(ranks, scenario)
    plan = json.loads(str(ranks[0]["plan"]))
    assert [h for h, _ in plan["hosts"]] == ["h1", "h2"]


def test_training_crossed_the_shaped_links(results):
    _, wire = results
    # Both hosts sent and received (allreduce rings, pushes to the other host's PS, reads).
    for host in ("h1", "h2"):
        assert wire[host]["sent"] > 100_000 and wire[host]["received"] > 100_000, wire


def test_a_stopped_parameter_server_on_the_other_host_is_named(tmp_path, cluster):
    """SIGSTOP of h2's PS: its parent on h2 stops hearing it and tells everyone through
    the hub on h1; the job ends in time naming that PS, and leaves nothing on either host."""
    hit = signal_job(tmp_path, "ps 2", signal.SIGSTOP, np_=4, hosts=cluster.hosts_arg(2),
               cluster=cluster)
    assert hit.returncode != 0
    assert hit.elapsed < LIVENESS_TIMEOUT + 25, hit.elapsed
    assert re.search(rf"parameter server ps:1 \(host h2\) \(pid {hit.pid}\) stopped "
                     "responding", hit.output), hit.output[-5000:]
    assert not hit.left, hit.left
    assert listening(hit.ports) == []
    # (this job's: the suite's other process may be running test_faults' jobs)
    assert processes_running(str(tmp_path)) == []
    # Every server was dialled at its host's address on the job's interface, not a name
    # or a loopback address; the hub listened on h1's.
    info = hit.info
    assert info[0]["hub"].startswith("198.18.0.1:")
    hosts = [a.rsplit(":", 1)[0] for a in info[0]["servers"]]
    assert set(hosts) == {"198.18.0.1", "198.18.0.2"}, hosts


@pytest.mark.parametrize("rate,batch,vocab,route", [("1gbit", 32, 100_000, "allgather"),
                                                    ("10mbit", 128, 10_000, "ps")])
def test_the_lm_routes_by_what_it_measured_on_the_links(tmp_path, cluster, rate, batch, vocab,
                                                        route):
    """Density routing on links it measures: a small batch on fast links is latency-bound
    (the parameter servers' protocol costs more than the bytes they save over an
    allgather); on slow links the same rows' bytes dominate and the large variables go to
    the servers, or to the sharded rows, which move the same bytes, where the job measured
    a cheaper exchange for their all-to-alls (a small one, the softmax's bias, may still
    take the allgather beside them: the cheapest step over every assignment wins). (At
    10 Mbit/s a smaller vocabulary: the chief sends the servers their initial parts,
    7.5 MB each here, 77 MB at 100,000 words.)"""
    cluster.set_rate(rate)
    fold = "auto" if route == "allgather" else "off"  # off: the step priced below is exact
    try:
        out = tmp_path / "summary.json"
        proc = horovodrun(4, os.path.join(REPO, "examples", "lm.py"), "--steps", "6",
                          "--warmup", "1", "--log-every", "3", "--vocab", str(vocab),
                          "--batch-size", str(batch), "--partitions", "2",
                          "--sparse-route", "auto", "--allreduce-by-allgather", fold,
                          "--json", str(out),
                          hosts=cluster.hosts_arg(2), cluster=cluster, timeout=400)
    finally:
        cluster.set_rate("1gbit")
    assert proc.returncode == 0, proc.stdout[-5000:]
    summary = json.loads(out.read_text())
    choices = {n: routing.RouteChoice(**c) for n, c in summary["routing"]["choices"].items()}
    sparse = ("embedding", "softmax/weights", "softmax/bias")
    links = routing.Links(**summary["routing"]["links"])
    routes = {n: summary["routes"][n] for n in sparse}
    if route == "allgather":
        assert set(routes.values()) == {"allgather"}, (choices, links)
    else:  # the large variables on the servers or sharded; the step the cheapest of all
        assert {routes["embedding"], routes["softmax/weights"]} <= {"ps", "sharded"}, routes
        aggregation = summary["local_aggregation"]

        def step_s(assignment):
            return routing.predicted_step_s(
                {n: dataclasses.replace(choices[n], route=r) for n, r in assignment.items()},
                links, aggregation)

        options = [[r for r in ("allreduce", "ps", "allgather", "sharded")
                    if getattr(choices[n], f"{r}_s") is not None] for n in sparse]
        best = min(step_s(dict(zip(sparse, a))) for a in itertools.product(*options))
        assert step_s(routes) <= best * (1 + 1e-9), (routes, best, choices, links)
    # The servers' price includes forwarding each host's sum of the variable's 2 parts
    # (local aggregation on, the example's default); their bytes are fewer.
    forwards = 2 * routing.AGGREGATED_PART_EXCHANGES * links.latency_s
    for name in sparse:
        c = choices[name]
        assert c.ps_s - forwards < c.allgather_s < c.allreduce_s, c  # ids: fewer rows
        # The same bytes; local aggregation (on) spares the sharded rows the hosts' shared
        # rows both ways, the servers only their pushes.
        assert c.sharded_s <= c.ps_s, c
    used = set(routes.values())
    bytes_ = summary["bytes_per_step"]
    assert (bytes_["ps_pull"] > 0) == ("ps" in used), bytes_
    assert (bytes_["allgather"] > 0) == ("allgather" in used), bytes_
    assert (bytes_["sharded"] > 0) == ("sharded" in used), bytes_
