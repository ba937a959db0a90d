"""Density routing: a sparse variable goes to the parameter servers, through a dense
allreduce or through Horovod's allgather.

- The decision (tfpar.plan.routing, pure): alpha near 1 -> allreduce, alpha << 1 on a large
  variable of many workers -> parameter servers, few rows whose savings cannot pay for
  the parameter servers' protocol -> allgather (no parameter servers at all), duplicate
  ids costed, forced routes kept.
- The dense allreduce route of a sparse gradient equals single-device training with real
  processes (2 workers, and 2 hosts x 2 workers), alone and beside variables on the
  parameter servers; tolerance as in test_equivalence (rtol=1e-5, atol=1e-6, 4 steps).
- Measured in real jobs: the LM example on 2 local workers routes a small vocabulary
  (alpha ~0.5) to allreduce and a large one (alpha ~0.003) to allgather (on slow emulated
  links, to the parameter servers: test_emulated_hosts).
"""
import dataclasses
import json
import os

import pytest

from tests import models
from tests.launch import REPO, horovodrun, job_results
from tests.reference import equal_single_device_tests

import tfpar
from tfpar.plan import routing
from tfpar.errors import TfparError
from tfpar.plan.layout import parse_resources

STEPS, BATCH = 4, 8
TWO_HOSTS = "localhost:2,127.0.0.1:2"
LINKS = routing.Links(latency_s=1e-3, per_byte_s=1e-8)  # 100 MB/s, 1 ms per exchange


def candidate(alpha, rows=100_000, row_bytes=256, name="emb"):
    return routing.Candidate(name, rows, row_bytes, alpha)


# -- the decision ------------------------------------------------------------------------------
def test_dense_rows_go_to_allreduce():
    choice = routing.decide((candidate(0.99),), 4, LINKS)["emb"]
    assert choice.route == "allreduce"
    assert choice.allreduce_s < choice.ps_s
    assert "most rows touched" in choice.reason


def test_sparse_rows_of_a_large_variable_go_to_the_parameter_servers():
    choice = routing.decide((candidate(0.01),), 4, LINKS)["emb"]
    assert choice.route == "ps"
    assert choice.ps_s < choice.allreduce_s / 50


def test_small_savings_do_not_pay_for_the_parameter_server_protocol():
    # alpha 0.3 of a 300-row variable: the servers would save 1.6 ms of bytes over the
    # dense allreduce (2.3 ms), but their protocol costs 3 ms; the allgather saves 0.9 ms
    # of bytes, less than the collective it adds (1 ms).
    small = routing.decide((candidate(0.3, rows=300),), 4, LINKS)["emb"]
    assert small.route == "allreduce" and "protocol" in small.reason
    assert small.ps_s < small.allgather_s < small.allreduce_s < small.allgather_s + 1e-3
    # Twice the rows: the allgather's saving (1.8 ms) pays for its collective.
    assert routing.decide((candidate(0.3, rows=600),), 4, LINKS)["emb"].route == "allgather"
    # Beside a variable that needs the parameter servers anyway, it goes there too.
    both = routing.decide((candidate(0.3, rows=300), candidate(0.01, name="big")), 4, LINKS)
    assert both["emb"].route == "ps" and both["big"].route == "ps"


def test_few_rows_of_a_large_variable_go_to_allgather_when_latency_dominates():
    # A small batch on fast links: 128 rows of 264 bytes per worker. The servers would
    # move half the allgather's bytes at N = 4, 0.1 ms less, but add three exchanges.
    fast = routing.Links(latency_s=1e-3, per_byte_s=1e-9)
    few = routing.decide((candidate(128 / 100_000),), 4, fast)["emb"]
    assert few.route == "allgather" and "protocol" in few.reason
    assert few.allgather_s == routing.allgather_bytes(candidate(128 / 100_000), 4) * 1e-9
    # Many workers and slow links make the same rows' bytes count: the servers pay.
    slow = routing.Links(latency_s=1e-3, per_byte_s=1e-7)
    many = routing.decide((candidate(128 / 100_000),), 16, slow)["emb"]
    assert many.route == "ps" and "an allgather of" in many.reason


def test_duplicate_ids_are_costed_on_the_allgather_route():
    # 1,000 distinct rows per step but 4,000 ids: the allgather sends every id's row.
    once = routing.Candidate("emb", 100_000, 256, 0.01, sent_rows=1000)
    dup = dataclasses.replace(once, sent_rows=4000)
    assert routing.allgather_bytes(dup, 2) == 4 * routing.allgather_bytes(once, 2)
    assert routing.allgather_bytes(once, 2) == 2 * 1000 * (256 + routing.INDEX_BYTES)
    fast = routing.Links(latency_s=1e-4, per_byte_s=1e-9)
    assert routing.decide((once,), 2, fast)["emb"].route == "allgather"
    assert routing.decide((dup,), 2, fast)["emb"].route == "ps"


def test_a_variable_without_an_exact_dense_route_chooses_between_the_others():
    # alpha 0.99: the dense allreduce is the fastest, but a norm over the gradient's rows
    # (dense_route=False) rules it out.
    clipped = dataclasses.replace(candidate(0.99), dense_route=False)
    assert routing.decide((candidate(0.99),), 4, LINKS)["emb"].route == "allreduce"
    assert routing.decide((clipped,), 4, LINKS)["emb"].route == "ps"
    few = dataclasses.replace(candidate(0.3, rows=300), dense_route=False)
    assert routing.decide((few,), 4, LINKS)["emb"].route == "allgather"


def test_forced_routes_are_kept_and_pay_the_protocol():
    forced = routing.decide((candidate(0.3, rows=300),), 4, LINKS, {"other": "ps"})
    assert forced["emb"].route == "ps"  # the protocol is paid for "other" already
    kept = routing.decide((candidate(0.01),), 4, LINKS, {"emb": "allreduce"})
    assert kept["emb"].route == "allreduce" and "Config" in kept["emb"].reason


def test_the_dense_routes_local_passes_are_costed():
    # alpha 0.99: fewer bytes by allreduce, but summing 100,000 rows densely on each worker
    # (measured: 1 ns per byte of the dense tensor) takes longer than the servers' bytes.
    slow = routing.Links(latency_s=1e-3, per_byte_s=1e-10, dense_per_byte_s=1e-9)
    choice = routing.decide((candidate(0.99),), 4, slow)["emb"]
    assert routing.allreduce_bytes(candidate(0.99), 4) < routing.ps_bytes(candidate(0.99), 4)
    assert choice.route == "ps" and choice.ps_s < choice.allreduce_s


def test_a_dense_route_is_never_predicted_cheaper_than_its_allreduce():
    fast = routing.Links(latency_s=1e-3, per_byte_s=1e-8, dense_per_byte_s=1e-15)
    choice = routing.decide((candidate(0.01),), 4, fast)["emb"]
    assert choice.route == "ps"
    assert choice.allreduce_s == routing.allreduce_bytes(candidate(0.01), 4) * 1e-8


def test_one_worker_needs_no_parameter_server():
    assert routing.decide((candidate(0.01),), 1, LINKS)["emb"].route == "allreduce"


# -- configuration and plan ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fast", {"emb": "auto"}, {}, 3])
def test_bad_sparse_route_is_a_clear_error(bad):
    with pytest.raises(TfparError, match="sparse_route must be one of"):
        tfpar.Config(sparse_route=bad)


def test_sparse_route_needs_hybrid_mode():
    with pytest.raises(TfparError, match="only HYBRID mode"):
        tfpar.Config(run_mode="AR", sparse_route="allreduce")


def _plan(config, **model):
    graph, _ = models.build(**model)
    analysis = tfpar.analyse(graph)
    from tfpar.plan.planner import make_plan
    return make_plan(analysis, config, parse_resources("localhost:2"))


def test_forced_allreduce_plans_a_dense_allreduce_and_no_parameter_server():
    plan = _plan(tfpar.Config(sparse_route="allreduce"), optimizer="adam", sparse=True)
    emb = plan.variable("emb")
    assert (emb.route, emb.kind, emb.parts) == ("allreduce", "sparse", ())
    assert plan.mode == "AR" and plan.num_ps == 0
    # The summed rows plus one count per row, ring allreduce: 4 w (N-1)/N.
    assert emb.predicted_bytes == 4 * models.VOCAB * (models.IN * 4 + 4) / 2
    assert tfpar.Plan.from_json(plan.to_json()) == plan


def test_a_dict_forces_some_and_the_rest_wait_for_measurement():
    plan = _plan(tfpar.Config(sparse_route={"shared": "allreduce"}), optimizer="sgd",
                 emb_partitions=2, shared_embedding=True)
    assert plan.variable("shared").route == "allreduce"
    assert plan.variable("emb/part_0").route == "ps"
    assert any("density not measured" in n for n in plan.notes)


def test_forced_allgather_plans_horovods_allgather_and_no_parameter_server():
    plan = _plan(tfpar.Config(sparse_route="allgather"), optimizer="adam", sparse=True,
                 clip=0.05)
    emb = plan.variable("emb")
    assert (emb.route, emb.kind, emb.parts) == ("allgather", "sparse", ())
    assert plan.mode == "AR" and plan.num_ps == 0
    mixed = _plan(tfpar.Config(sparse_route={"emb/part_0": "ps", "shared": "allgather"}),
                  optimizer="sgd", emb_partitions=2, shared_embedding=True)
    assert [mixed.variable(n).route for n in ("emb/part_0", "emb/part_1", "shared")] == [
        "ps", "ps", "allgather"]
    assert mixed.mode == "HYBRID" and mixed.num_ps == 1
    assert tfpar.Plan.from_json(mixed.to_json()) == mixed


def test_allreduce_of_a_globally_clipped_sparse_gradient_is_refused():
    with pytest.raises(TfparError, match="sum over its rows.*'ps' or 'allgather'"):
        _plan(tfpar.Config(sparse_route="allreduce"), optimizer="sgd", sparse=True, clip=0.05)


def test_unknown_or_dense_variable_in_the_dict_is_refused():
    with pytest.raises(TfparError, match="does not have"):
        _plan(tfpar.Config(sparse_route={"nope": "ps"}), sparse=True)
    with pytest.raises(TfparError, match="not sparse"):
        _plan(tfpar.Config(sparse_route={"w1": "ps"}), sparse=True)


# -- equivalence with real processes -------------------------------------------------------------
def sc(name, optimizer, config, partitions=2, **extra):
    model = {"optimizer": optimizer, "emb_partitions": partitions, "shared_embedding": True}
    return {"name": name, "model": {**model, **extra.pop("model", {})}, "config": config,
            "steps": STEPS, "batch": BATCH, "vocab": models.PS_VOCAB, **extra}


ALL = {"sparse_route": "allreduce"}
SCENARIOS_2 = [
    sc("allreduce_sgd", "sgd", ALL),
    sc("allreduce_momentum", "momentum", ALL, partitions=3),
    sc("allreduce_adam", "adam", ALL, partitions=1),
    sc("allreduce_adagrad_sum", "adagrad", {**ALL, "average_dense": False,
                                            "average_sparse": False},
       model={"reduce": "sum"}),
    sc("mixed_momentum", "momentum", {"sparse_route": {"emb/part_0": "ps",
                                                       "shared": "allreduce"}},
       feed_trials=True),
    sc("auto_adagrad", "adagrad", {"sparse_route": "auto"}, feed_trials=True),
    sc("allgather_adam_clip", "adam", {"sparse_route": "allgather"},
       model={"clip": 0.05}),
]
SCENARIOS_4 = [
    sc("allreduce_adam", "adam", ALL, partitions=3),
    sc("mixed_adagrad", "adagrad", {"sparse_route": {"emb/part_0": "ps", "emb/part_1": "ps",
                                                     "shared": "allreduce"}}),
    sc("mixed_momentum_allgather", "momentum",
       {"sparse_route": {"emb/part_0": "ps", "shared": "allgather"}}, partitions=3,
       feed_trials=True),
]

results2 = job_results("results2", "density2", 2, SCENARIOS_2)

results4 = job_results("results4", "density4", 4, SCENARIOS_4, TWO_HOSTS)


def _check_routes(ranks, scenario):
    plan = json.loads(str(ranks[0]["plan"]))
    routes = {v["name"]: v["route"] for v in plan["variables"]}
    setting = scenario["config"]["sparse_route"]
    sparse = [v["name"] for v in plan["variables"] if v["kind"] == "sparse"
              and v["role"] == "trained"]
    assert len(sparse) == scenario["model"]["emb_partitions"] + 1
    forced = setting if isinstance(setting, dict) else {
        n: setting for n in sparse if setting != "auto"}
    used = {routes[n] for n in sparse}
    for name in sparse:
        if name in forced:
            assert routes[name] == forced[name], (name, routes[name])
            continue
        choice = plan["routing"]["choices"][name]
        assert routes[name] == choice["route"], (name, routes[name], choice)
        assert 0 < choice["alpha"] < 0.875, choice
        t = {r: choice[f"{r}_s"] for r in ("ps", "allreduce", "allgather")}
        fastest = min(t, key=t.get)
        if routes[name] != fastest:  # only a kind of route not paid for is passed over
            assert fastest not in used and "less than" in choice["reason"], choice
        if "ps" not in forced.values():  # tiny variables: savings cannot pay the protocol
            assert routes[name] != "ps", choice
    comm = json.loads(str(ranks[0]["communication"]))
    if all(routes[n] != "ps" for n in sparse):
        assert plan["mode"] == "AR" and comm["ps_push"] == 0 and comm["ps_pull"] == 0
    else:
        assert plan["mode"] == "HYBRID" and comm["ps_push"] > 0
    assert comm["allreduce"] > 0
    assert (comm["allgather"] > 0) == any(routes[n] == "allgather" for n in sparse)


test_two_workers_equal_single_device, test_two_hosts_of_two_workers_equal_single_device = \
    equal_single_device_tests(SCENARIOS_2, SCENARIOS_4, also=_check_routes)


# -- the LM example: measured alpha decides -----------------------------------------------------
@pytest.mark.job
@pytest.mark.parametrize("vocab,route", [(300, "allreduce"), (100_000, "allgather")])
def test_lm_routes_by_measured_density(tmp_path, vocab, route):
    out = tmp_path / "summary.json"
    proc = horovodrun(2, os.path.join(REPO, "examples", "lm.py"), "--steps", "12",
                      "--warmup", "2", "--log-every", "5", "--vocab", str(vocab),
                      "--partitions", "1", "--sparse-route", "auto", "--json", str(out),
                      timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads(out.read_text())
    sparse = ("embedding", "softmax/weights", "softmax/bias")
    assert {summary["routes"][n] for n in sparse} == {route}
    alphas = [summary["routing"]["choices"][n]["alpha"] for n in sparse]
    moved = summary["bytes_per_step"]
    assert moved["ps_pull"] == 0 and moved["ps_push"] == 0  # no parameter server
    if route == "allgather":  # few rows on one host: the protocol would cost more
        assert max(alphas) < 0.05 and moved["allgather"] > 0
    else:
        assert min(alphas) > 0.2 and moved["allgather"] == 0
    links = summary["routing"]["links"]
    assert links["latency_s"] > 0 and links["per_byte_s"] > 0
