"""Local aggregation decided by measurement in a real job on 2 hosts x 2 workers: the rows
are measured, the plan says what it decided and why, and training equals single-device
training (rtol=1e-5, atol=1e-6, as test_equivalence) whichever way it decided.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import job_results
from tests.support.reference import check, each_scenario

import tfpar
from tfpar.plan import routing
from tfpar.graph.analysis import analyse
from tfpar.errors import TfparError
from tfpar.plan.measurements import Measurements
from tfpar.plan.planner import decide_aggregation, make_plan
from tfpar.plan.layout import parse_resources
from tfpar.transform.parameter_server import sum_by_id

TWO_HOSTS = "localhost:2,127.0.0.1:2"


SCENARIOS = [
    {"name": "auto_adagrad", "model": {"optimizer": "adagrad", "emb_partitions": 2,
                                       "shared_embedding": True},
     "config": {"local_aggregation": "auto"}, "steps": 4, "batch": 8,
     "vocab": models.PS_VOCAB, "feed_trials": True},
    {"name": "auto_ps_momentum", "model": {"optimizer": "momentum", "emb_partitions": 1,
                                           "shared_embedding": True},
     "config": {"run_mode": "PS", "local_aggregation": "auto"}, "steps": 4, "batch": 8,
     "vocab": models.PS_VOCAB, "feed_trials": True},
]

results = job_results("results", "aggregation", 4, SCENARIOS, TWO_HOSTS)


@each_scenario(SCENARIOS)
def test_measured_in_the_job_and_equal_to_single_device(results, scenario):
    ranks = check(results, scenario, 4)
    plan = json.loads(str(ranks[0]["plan"]))
    decision = plan["routing"]["aggregation"]
    assert decision is not None and decision["cost_s"] > 0
    assert plan["local_aggregation"] is decision["on"]
    assert any(n.startswith(f"local aggregation {'on' if decision['on'] else 'off'} (measured)")
               for n in plan["notes"])
    if scenario["config"].get("run_mode") == "PS":  # dense gradients: spared whatever the rows
        assert decision["saved_bytes"] > 0
    # Every rank decided alike (the measurements are agreed).
    assert all(json.loads(str(r["plan"]))["local_aggregation"] is decision["on"] for r in ranks)
