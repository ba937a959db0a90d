"""HYBRID and PS modes with real parameter servers equal single-device training.

Each job is one `horovodrun` launch that runs every scenario in turn (a runner each, on
the same parameter servers). N=4 runs as 2 hosts x 2 workers on this machine: horovodrun
is given `-H localhost:2,127.0.0.1:2`, two names that both resolve to this machine's
addresses, so Horovod starts all four processes locally (no ssh) while giving each half
its own host name, local ranks and, in tfpar, its own parameter server. Local aggregation
therefore really combines two workers per host before the push.

The model has a partitioned embedding (the user's own partitioner: 1, 2 or 3 pieces of 23
rows), a second embedding read by two lookups (in parts dealt out modulo, or row ranges
where a scenario's name says so), and dense layers; ids repeat within and across workers. Tolerance as in test_equivalence: rtol=1e-5, atol=1e-6 after 4 steps.
"""
import json
import os

import numpy as np
import pytest

from tests.support import models
from tests.support.launch import job_results
from tests.support.reference import check, each_scenario


STEPS, BATCH = 4, 8
TWO_HOSTS = "localhost:2,127.0.0.1:2"


def sc(name, optimizer, partitions, config=None):
    model = {"optimizer": optimizer, "emb_partitions": partitions, "shared_embedding": True}
    return {"name": name, "model": model, "config": config or {}, "steps": STEPS,
            "batch": BATCH, "vocab": models.PS_VOCAB}


SCENARIOS_2 = [
    sc("hybrid_sgd_p1", "sgd", 1),
    sc("hybrid_adagrad_p2", "adagrad", 2),
    sc("hybrid_adam_p3", "adam", 3, {"partitions": {"shared": 2}}),
    sc("hybrid_momentum_p2_ranges", "momentum", 2, {"partitions": 3, "ps_rows": "ranges"}),
    sc("ps_sgd_p2", "sgd", 2, {"run_mode": "PS"}),
    sc("ps_adagrad_p3", "adagrad", 3, {"run_mode": "PS"}),
    sc("ps_adam_p1", "adam", 1, {"run_mode": "PS"}),
]
SCENARIOS_4 = [
    sc("hybrid_sgd_p3", "sgd", 3),
    sc("hybrid_adam_p2", "adam", 2, {"partitions": {"shared": 3}}),
    sc("hybrid_adagrad_p1_no_local_aggregation", "adagrad", 1, {"local_aggregation": False}),
    sc("ps_adagrad_p3", "adagrad", 3, {"run_mode": "PS"}),
    sc("ps_adam_p2_ranges", "adam", 2, {"run_mode": "PS", "ps_rows": "ranges"}),
    sc("ps_sgd_p1_no_local_aggregation", "sgd", 1,
       {"run_mode": "PS", "local_aggregation": False}),
]

# Route "sharded" on 2 hosts x 2 workers, in the same job (rows over all 4 workers).
SHARDED_4 = [
    {**sc("sharded_adam_p2", "adam", 2, {"sparse_route": "sharded"}),
     "model": {"optimizer": "adam", "emb_partitions": 2, "shared_embedding": True,
               "clip": 0.05}},
    sc("sharded_adagrad_p1_no_local_aggregation_ranges", "adagrad", 1,
       {"sparse_route": "sharded", "local_aggregation": False, "sharded_rows": "ranges"}),
]

results2 = job_results("results2", "ps2", 2, SCENARIOS_2)

results4 = job_results("results4", "ps4", 4, SCENARIOS_4 + SHARDED_4, TWO_HOSTS)


def _plan(ranks):
    return {v["name"]: v for v in json.loads(str(ranks[0]["plan"]))["variables"]}


def check_routes(ranks, scenario):
    plan = _plan(ranks)
    mode = scenario["config"].get("run_mode", "HYBRID")
    p = scenario["model"]["emb_partitions"]
    for k in range(p):
        assert plan[f"emb/part_{k}"]["route"] == "ps"
        assert len(plan[f"emb/part_{k}"]["parts"]) == 1  # the user's pieces stay whole
    shared_parts = scenario["config"].get("partitions")
    if isinstance(shared_parts, dict):
        shared_parts = shared_parts["shared"]
    expected = shared_parts or len(json.loads(str(ranks[0]["plan"]))["hosts"])
    rows = [(q["start"], q["stop"], q["step"]) for q in plan["shared"]["parts"]]
    assert len(rows) == expected
    if expected > 1 and scenario["config"].get("ps_rows") != "ranges":  # modulo
        assert rows == [(k, models.SHARED_VOCAB, expected) for k in range(expected)]
    else:  # row ranges, one after the other
        assert rows[0][0] == 0 and rows[-1][1] == models.SHARED_VOCAB
        assert all(a[1] == b[0] and a[2] == 1 for a, b in zip(rows, rows[1:]))
    assert plan["w1"]["route"] == ("ps" if mode == "PS" else "allreduce")
    slots = [v for v in plan.values() if v["slot_of"] == "shared"]
    assert all(s["parts"] == plan["shared"]["parts"] for s in slots)
    if scenario["model"]["optimizer"] != "sgd":
        assert slots, "the optimizer's slots of a PS variable are on the PS with it"


@each_scenario(SCENARIOS_2)
def test_two_workers_equal_single_device(results2, scenario):
    ranks = check(results2, scenario, 2)
    check_routes(ranks, scenario)


@each_scenario(SCENARIOS_4)
def test_two_hosts_of_two_workers_equal_single_device(results4, scenario):
    ranks = check(results4, scenario, 4)
    check_routes(ranks, scenario)
    assert [h for h, _ in json.loads(str(ranks[0]["plan"]))["hosts"]] == ["localhost",
                                                                         "127.0.0.1"]


@each_scenario(SHARDED_4)
def test_sharded_on_two_hosts_of_two_workers_equals_single_device(results4, scenario):
    ranks = check(results4, scenario, 4)
    plan = _plan(ranks)
    way = "R" if scenario["config"].get("sharded_rows") == "ranges" else "M"  # else modulo
    assert plan["shared"]["route"] == "sharded" and plan["shared"]["tiling"] == f"{way}4"
    # Local aggregation (the default): the ids and the row gradients go to a worker of
    # the host first, which asks for the host's unique ids and sums the host's rows by id
    # before they cross to their owners (three more all-to-alls, within the host).
    aggregated = scenario["config"].get("local_aggregation", True)
    assert json.loads(str(ranks[0]["plan"]))["local_aggregation"] is aggregated
    for data in ranks:
        comm = json.loads(str(data["communication"]))
        assert comm["sharded"] > 0 and comm["ps_push"] == comm["ps_pull"] == 0
        names = json.loads(str(data["alltoalls"]))
        kinds = [k for k in ("_host", "_host_ids", "_host_rows")
                 if any(n.endswith(k) for n in names)]
        assert kinds == (["_host", "_host_ids", "_host_rows"] if aggregated else []), names


def test_local_aggregation_sends_one_push_per_host_per_part(results4):
    """Each PS part receives one push per host per step with local aggregation (2 hosts),
    and one per worker (4) without it."""
    for scenario in SCENARIOS_4:
        ranks = [np.load(os.path.join(results4, scenario["name"], f"rank{r}.npz"))
                 for r in range(4)]
        pushes = json.loads(str(ranks[0]["ps_pushes"]))
        plan = _plan(ranks)
        parts = sum(len(v["parts"]) for v in plan.values() if v["route"] == "ps"
                    and not v["slot_of"] and v["role"] == "trained")
        assert len(pushes) == parts
        per_step = 2 if scenario["config"].get("local_aggregation", True) else 4
        assert set(pushes.values()) == {per_step * STEPS}, (scenario["name"], pushes)


def test_communication_is_reported_per_path(results2, results4):
    for out, n, scenarios in ((results2, 2, SCENARIOS_2), (results4, 4, SCENARIOS_4)):
        for scenario in scenarios:
            for r in range(n):
                data = np.load(os.path.join(out, scenario["name"], f"rank{r}.npz"))
                comm = json.loads(str(data["communication"]))
                assert comm["steps"] == STEPS
                assert comm["ps_push"] > 0 and comm["ps_pull"] > 0
                if scenario["config"].get("run_mode") == "PS":
                    assert comm["allreduce"] == 0  # no Horovod collective at run time
                else:
                    dense = sum(v["nbytes"] for v in _plan([data]).values()
                                if v["route"] == "allreduce")
                    # Ring allreduce: 4w(N-1)/N per worker per step.
                    assert comm["allreduce"] == pytest.approx(
                        STEPS * 4 * dense * (n - 1) / n)
