"""Density routing: a sparse variable goes to the parameter servers, through a dense
allreduce or through Horovod's allgather.

- The decision (tfpar.plan.routing, pure): alpha near 1 -> allreduce, alpha << 1 on a large
  variable of many workers -> parameter servers, few rows whose savings cannot pay for
  the parameter servers' protocol -> allgather (no parameter servers at all), duplicate
  ids costed, forced routes kept.
- The plans of forced and dict routes. In real jobs: tests/jobs/test_density_routing.py.
"""
import dataclasses
import json
import os

import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import REPO, horovodrun, job_results
from tests.support.reference import equal_single_device_tests

import tfpar
from tfpar.plan import routing
from tfpar.errors import TfparError
from tfpar.plan.layout import parse_resources

tf1 = tf.compat.v1
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


def test_sharded_rows_move_the_servers_bytes_and_win_on_a_cheaper_all_to_all():
    # The all-to-alls carry what the servers carry (each worker's unique rows and ids, out
    # and back): which of the two wins is the latency of their exchanges.
    c = candidate(0.01)
    assert routing.sharded_bytes(c, 4) == pytest.approx(routing.ps_bytes(c, 4))
    cheap = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=0.5e-3)
    choice = routing.decide((c,), 4, cheap)["emb"]
    assert choice.route == "sharded" and choice.sharded_s == pytest.approx(choice.ps_s)
    assert "all-to-all" in choice.reason and "1.500 ms" in choice.reason
    assert "sharded" in routing.describe("emb", choice)
    dear = dataclasses.replace(cheap, alltoall_latency_s=2e-3)
    assert routing.decide((c,), 4, dear)["emb"].route == "ps"
    # Unmeasured, an all-to-all costs an allreduce's latency: the tie goes to the servers.
    assert routing.decide((c,), 4, LINKS)["emb"].route == "ps"


def test_each_route_is_priced_by_its_busiest_host_link():
    """Equal bytes and equal exchanges tie to the servers; with their parts in row ranges
    of a vocabulary sorted by frequency, one host serves 1.4x its share of the rows asked
    (measured: tests/runtime/test_measure.py), so its link carries 1.4x the bytes, while
    rows dealt out modulo N stay even: the sharded rows win, by the bytes' 0.4x."""
    c = candidate(0.01)
    links = routing.Links(latency_s=1e-3, per_byte_s=1e-8)
    even = routing.decide((c,), 4, links)["emb"]
    assert even.route == "ps" and (even.servers_balance, even.sharded_balance) == (1.0, 1.0)
    skewed = dataclasses.replace(c, servers_balance=1.4, sharded_balance=1.01)
    choice = routing.decide((skewed,), 4, links)["emb"]
    assert choice.route == "sharded"
    assert choice.ps_s == pytest.approx(1.4 * even.ps_s)
    assert choice.sharded_s == pytest.approx(1.01 * even.sharded_s)
    assert "1.40x its share of the rows on the servers, 1.01x sharded" in choice.reason
    assert (choice.servers_balance, choice.sharded_balance) == (1.4, 1.01)
    # and the other way round: sharded rows in ranges, the servers' parts spread
    ranges = dataclasses.replace(c, servers_balance=1.0, sharded_balance=1.4)
    assert routing.decide((ranges,), 4, links)["emb"].route == "ps"


def test_the_plan_prices_the_measured_balance_of_the_rows_as_they_are_dealt_out():
    """make_plan takes each route's measured link balance: the servers' (their parts) and
    the sharded rows' as Config.sharded_rows deals them (its "auto" by the rows the
    busiest worker is asked)."""
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements
    # slow links for a small table: bytes decide, and an all-to-all costs an allreduce
    links = routing.Links(latency_s=1e-4, per_byte_s=1e-5)
    graph, _ = models.build(optimizer="adagrad", sparse=True)
    analysis = tfpar.analyse(graph)
    balance = {"emb": {"servers": 1.4, "servers_modulo": 1.2, "ranges": 1.4, "modulo": 1.02}}
    owners = {"emb": {"ranges": 30.0, "modulo": 20.0, "even": 18.0}}

    def choice(**config):
        measured = Measurements(links=links, steps=1, alphas={"emb": 0.2},
                                link_balance=balance, owner_rows=owners)
        plan = make_plan(analysis, tfpar.Config(sparse_route="auto", **config),
                         parse_resources("localhost:2,127.0.0.1:2"), measured)
        return plan.routing.choices["emb"]

    auto = choice()
    assert (auto.servers_balance, auto.sharded_balance) == (1.2, 1.02)
    assert auto.route == "sharded"
    assert choice(sharded_rows="ranges").sharded_balance == 1.4
    assert choice(sharded_rows="ranges").route == "ps"
    assert choice(ps_rows="ranges").servers_balance == 1.4
    # equal bytes and balance: the tie to the servers
    assert choice(ps_rows="ranges", sharded_rows="ranges").route == "ps"


def test_the_servers_parts_deal_rows_out_as_measured_or_asked():
    """Config.ps_rows: "auto" takes the layout whose busiest host the job measured less
    loaded (modulo where nothing was measured); the plan shows the parts and says why."""
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements
    from tfpar.plan import Plan
    graph, _ = models.build(optimizer="adagrad", sparse=True)
    analysis = tfpar.analyse(graph)
    rows = analysis.variable("emb").shape[0]
    two_hosts = parse_resources("localhost:2,127.0.0.1:2")

    def parts(balance=None, **config):
        measured = Measurements(link_balance=balance or {})
        plan = make_plan(analysis, tfpar.Config(run_mode="HYBRID", **config), two_hosts,
                         measured)
        assert Plan.from_dict(plan.to_dict()) == plan
        return plan, plan.variable("emb").parts

    plan, dealt = parts()  # nothing measured: modulo
    assert [(p.start, p.stop, p.step) for p in dealt] == [(0, rows, 2), (1, rows, 2)]
    assert sorted(p.ps_task for p in dealt) == [0, 1]
    assert "0::2@" in plan.table() and "1::2@" in plan.table()
    assert sum(p.num_rows() for p in dealt) == rows
    _, ranged = parts(ps_rows="ranges")
    half = (rows + 1) // 2
    assert [(p.start, p.stop, p.step) for p in ranged] == [(0, half, 1), (half, rows, 1)]
    plan, measured = parts({"emb": {"servers": 1.1, "servers_modulo": 1.3}})
    assert [p.step for p in measured] == [1, 1]
    assert any("servers' rows of emb: ranges (measured" in n for n in plan.notes)
    plan, measured = parts({"emb": {"servers": 1.4, "servers_modulo": 1.0}})
    assert [p.step for p in measured] == [2, 2]
    assert any("servers' rows of emb: modulo (measured" in n for n in plan.notes)
    _, forced = parts({"emb": {"servers": 1.4, "servers_modulo": 1.0}}, ps_rows="ranges")
    assert [p.step for p in forced] == [1, 1]
    _, three = parts(partitions=3)
    assert [(p.start, p.step) for p in three] == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(tfpar.TfparError, match="ps_rows"):
        tfpar.Config(ps_rows="mod")


def test_sharded_rows_are_not_chosen_where_the_route_cannot_take_them():
    cheap = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=1e-4)
    blocked = dataclasses.replace(candidate(0.01), sharded_route=False)
    assert routing.decide((blocked,), 4, cheap)["emb"].route == "ps"
    assert routing.decide((blocked,), 4, cheap)["emb"].sharded_s is None
    assert routing.decide((candidate(0.5, rows=3),), 4, cheap)["emb"].route != "sharded"


def test_a_variable_on_the_servers_draws_the_others_there_unless_sharding_pays_its_own():
    cheap = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=0.5e-3)
    # The servers' protocol is paid for "other" already: equal bytes, no all-to-alls added.
    assert routing.decide((candidate(0.01),), 4, cheap, {"other": "ps"})["emb"].route == "ps"
    both = routing.decide((candidate(0.01), candidate(0.02, name="big")), 4, cheap)
    assert {c.route for c in both.values()} == {"sharded"}


def test_local_aggregation_spares_the_servers_and_the_sharded_routes_their_shared_rows():
    # 2 hosts: a row two workers of a host both touch crosses to the other host's server
    # (or the row's owner) once, not twice; 1,000 such rows of 264 bytes per step spare
    # 0.66 ms of bytes at 5 ns per byte (twice on the sharded route: lookups and
    # gradients), and the aggregation adds one exchange to the protocol and three
    # all-to-alls within the host to the sharded rows.
    links = routing.Links(latency_s=1e-3, per_byte_s=5e-9, alltoall_latency_s=0.5e-3)
    saving = routing.aggregation_saving_s(1000, 256, 2, links)
    assert saving == pytest.approx(2 * 1000 * 264 / 4 * 5e-9)
    assert routing.aggregation_saving_s(1000, 256, 1, links) == 0
    fixed = routing.fixed_costs(links, aggregation=True)
    assert fixed["ps"] == pytest.approx(4e-3) and fixed["sharded"] == pytest.approx(3e-3)
    c = dataclasses.replace(candidate(0.01), aggregation_s=saving)
    plain = routing.decide((candidate(0.01),), 4, links)["emb"]
    spared = routing.decide((c,), 4, links, aggregation=True)["emb"]
    # ... and forwards each of its parts (one here) from the host's PS to the part's.
    assert spared.ps_s == pytest.approx(plain.ps_s - saving
                                        + routing.AGGREGATED_PART_EXCHANGES * 1e-3)
    assert spared.sharded_s == pytest.approx(plain.sharded_s - 2 * saving)
    assert spared.route == "sharded"  # the same bytes, a cheaper exchange
    # Without the sharded route (a whole read of the variable), the servers' bytes win.
    c = dataclasses.replace(c, sharded_route=False)
    assert routing.decide((c,), 4, links, aggregation=True)["emb"].route == "ps"


def test_local_aggregation_auto_prices_one_more_all_to_all_for_sharded_rows():
    links = routing.Links(latency_s=1e-3, per_byte_s=5e-9, alltoall_latency_s=0.5e-3)
    both = routing.decide_aggregation(1e5, links, servers=True, sharded=True)
    assert both.cost_s == pytest.approx(2.5e-3) and not both.on  # 1 ms saved
    sharded = routing.decide_aggregation(2e5, links, servers=False, sharded=True)
    assert sharded.cost_s == pytest.approx(1.5e-3) and sharded.on  # 2 ms saved
    assert "3 more all-to-alls" in sharded.reason and "exchange" not in sharded.reason
    assert not routing.decide_aggregation(1e5, links, servers=False, sharded=True).on


def test_the_ids_a_step_ahead_price_two_all_to_alls_where_every_table_is_sharded():
    # Config(ids_ahead=True): the next batch's ids travel with this batch's rows, so the
    # sharded rows cost two all-to-alls, not three, where every sparse variable is
    # sharded and no host aggregates (else the plan turns it off).
    links = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=1.2e-3)
    assert routing.fixed_costs(links)["sharded"] == pytest.approx(3.6e-3)
    assert routing.fixed_costs(links, ahead=True)["sharded"] == pytest.approx(2.4e-3)
    assert routing.fixed_costs(links, True, ahead=True)["sharded"] == pytest.approx(7.2e-3)
    c = candidate(0.01)  # equal bytes: 3.6 ms of all-to-alls > 3 ms of protocol > 2.4
    assert routing.decide((c,), 4, links)["emb"].route == "ps"
    ahead = routing.decide((c,), 4, links, ahead=True)
    assert ahead["emb"].route == "sharded"
    assert routing.predicted_step_s(ahead, links, ahead=True) == pytest.approx(
        ahead["emb"].sharded_s + 2.4e-3)
    # A variable on another route turns it off: the servers' protocol is paid for "other".
    assert routing.decide((c,), 4, links, {"other": "ps"}, ahead=True)["emb"].route == "ps"
    # Local aggregation turns it off too: it costs its three all-to-alls and the one spared.
    off = routing.decide_aggregation(2e5, links, servers=False, sharded=True, ahead=True)
    assert off.cost_s == pytest.approx(4 * 1.2e-3) and "4 more all-to-alls" in off.reason


def test_local_aggregation_on_the_servers_pays_for_forwarding_each_part():
    # The recommender's case (docs/results/ps_parts/): many tables in parts on the
    # servers: each host's sum of each part is forwarded to the part's server, so
    # aggregation that pays for one part's bytes does not pay for twenty.
    links = routing.Links(latency_s=2e-3, per_byte_s=4e-9)
    one = routing.decide_aggregation(1e6, links, servers=True, parts=1)  # 8 ms spared
    assert one.on and one.cost_s == pytest.approx(2e-3 * (1 + routing.AGGREGATED_PART_EXCHANGES))
    many = routing.decide_aggregation(1e6, links, servers=True, parts=20)
    assert not many.on and "forwarding of 20 parts" in many.reason
    assert many.cost_s == pytest.approx(2e-3 * (1 + 20 * routing.AGGREGATED_PART_EXCHANGES))
    # Density routing prices it per variable: its parts, only when the hosts aggregate.
    c = candidate(0.01)
    two, eight = (dataclasses.replace(c, parts=k) for k in (2, 8))
    assert links.ps_s(eight, 4, True) - links.ps_s(two, 4, True) == pytest.approx(
        6 * routing.AGGREGATED_PART_EXCHANGES * 2e-3)
    assert links.ps_s(eight, 4) == links.ps_s(two, 4)


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


def test_density_routing_shards_only_what_the_sharded_route_can_take():
    """The measured density with a cheap all-to-all shards the embedding (a moving average
    of it too), unless a read of it whole (the rewrite would refuse it) or a time-based
    checkpoint would need it whole: then the servers, which move the same bytes."""
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements
    # Slow links for a small table: bytes decide against the dense allreduce.
    cheap = routing.Links(latency_s=1e-4, per_byte_s=1e-5, alltoall_latency_s=0.5e-4)
    # 4 of its 20 rows per step, 16 ids with duplicates. On 4 workers the all-to-alls move
    # half the bytes of an allgather of the unique rows (on 2, as many).
    measured = Measurements(links=cheap, steps=1, alphas={"emb": 0.2}, sent_rows={"emb": 16})

    def route(config, whole_read=False, **model):
        graph, h = models.build(optimizer="adagrad", sparse=True, **model)
        if whole_read:  # its sum written into another variable after the step
            with graph.as_default(), tf.control_dependencies([h["train_op"]]):
                emb = next(v for v in tf1.global_variables() if v.op.name == "emb")
                tf1.get_variable("total", [], trainable=False).assign(tf.reduce_sum(emb))
        plan = make_plan(tfpar.analyse(graph), config, parse_resources("localhost:4"),
                         measured)
        return plan.variable("emb").route, plan

    r, plan = route(tfpar.Config(sparse_route="auto"))
    assert r == "sharded" and plan.num_ps == 0
    assert plan.variable("emb").tiling is not None
    assert any("emb: alpha 0.200 -> sharded" in n for n in plan.notes)
    r, plan = route(tfpar.Config(sparse_route="auto"), ema=True)
    shadow = plan.variable("emb/ExponentialMovingAverage")
    assert r == "sharded" and (shadow.route, shadow.slot_of) == ("sharded", "emb")
    assert route(tfpar.Config(sparse_route="auto"), whole_read=True)[0] == "ps"
    assert route(tfpar.Config(sparse_route="auto", checkpoint_dir="/tmp/x",
                              checkpoint_every_secs=60))[0] == "ps"


def test_forced_allreduce_plans_a_dense_allreduce_and_no_parameter_server():
    plan = _plan(tfpar.Config(sparse_route="allreduce"), optimizer="adam", sparse=True)
    emb = plan.variable("emb")
    assert (emb.route, emb.kind, emb.parts) == ("allreduce", "sparse", ())
    assert plan.mode == "AR" and plan.num_ps == 0
    # The summed rows plus one count per row, ring allreduce: 4 w (N-1)/N.
    assert emb.predicted_bytes == 4 * models.VOCAB * (models.IN * 4 + 4) / 2
    assert tfpar.Plan.from_json(plan.to_json()) == plan


def test_the_allgather_sums_a_workers_rows_by_id_only_where_that_is_exact():
    """Summing a duplicate id's rows before the allgather is what the update does anyway,
    unless the post-processing sums over the rows (a norm) or is not linear in them (a
    clip_by_value): then the rows go as the gradient carries them, and the dense allreduce
    (which sums them too) is refused."""
    def sums(setting=True, **model):
        plan = _plan(tfpar.Config(sparse_route="allgather", sum_duplicate_rows=setting),
                     optimizer="adagrad", sparse=True, **model)
        return [g.sum_duplicates for g in plan.variable("emb").gradients]

    assert sums() == [True] and sums(scale_sparse=True) == [True]
    assert sums(clip=1.0) == [False] and sums(clip_values=0.1) == [False]
    assert sums(False) == [False] and sums("auto") == [False]  # "auto": nothing measured
    plan = _plan(tfpar.Config(sparse_route="allgather", sum_duplicate_rows=True),
                 optimizer="adagrad", sparse=True)
    assert tfpar.Plan.from_json(plan.to_json()) == plan
    assert "each worker's rows summed by id before they are sent: emb" in plan.table()
    with pytest.raises(tfpar.TfparError, match="sum_duplicate_rows must be"):
        tfpar.Config(sum_duplicate_rows="yes")
    with pytest.raises(tfpar.TfparError, match="not linear in them.*clip_by_value"):
        _plan(tfpar.Config(sparse_route="allreduce"), optimizer="adagrad", sparse=True,
              clip_values=0.1)


@pytest.mark.parametrize("per_byte_s, summed", [(1e-5, True), (1e-8, False)])
def test_auto_sums_duplicate_rows_where_the_bytes_saved_outlast_a_negotiation(per_byte_s,
                                                                               summed):
    """sum_duplicate_rows="auto": 16 rows sent with their duplicates, 4 unique: the 12
    rows saved pay for the exchange Horovod adds to negotiate a changing size on slow
    links, not on fast ones; the density price of the allgather follows."""
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements
    links = routing.Links(latency_s=1e-3, per_byte_s=per_byte_s, alltoall_latency_s=1e-3)
    measured = Measurements(links=links, steps=1, alphas={"emb": 0.2}, sent_rows={"emb": 16})
    graph, _ = models.build(optimizer="adagrad", sparse=True)
    plan = make_plan(tfpar.analyse(graph), tfpar.Config(sparse_route={"emb": "allgather"}),
                     parse_resources("localhost:2"), measured)
    assert [g.sum_duplicates for g in plan.variable("emb").gradients] == [summed]
    plan = make_plan(tfpar.analyse(graph), tfpar.Config(sparse_route="auto"),
                     parse_resources("localhost:2"), measured)
    choice = plan.routing.choices["emb"]
    rows = 4 if summed else 16  # what the allgather would carry, priced
    row = plan.variable("emb").nbytes // plan.variable("emb").shape[0] + routing.INDEX_BYTES
    assert choice.allgather_s == pytest.approx(2 * rows * row * per_byte_s, rel=1e-6)


def test_allreduced_gradients_travel_in_the_allgather_where_asked_or_measured_to_pay():
    """Config(allreduce_by_allgather): True folds the step's allreduce into route
    "allgather"'s allgather (the dense variables' bytes then priced as an allgather of
    them); "auto" only with measured links, on where their bytes take less time in the
    allgather (at its measured cost per byte) than in their own allreduce (its latency
    included); never without a variable on the allgather route."""
    from tfpar.plan import cost
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements

    def plan_of(setting, route="allgather", links=None, hosts="localhost:2"):
        graph, _ = models.build(optimizer="adagrad", sparse=True)
        measured = None if links is None else Measurements(
            links=links, steps=1, alphas={"emb": 0.2}, sent_rows={"emb": 16})
        return make_plan(tfpar.analyse(graph), tfpar.Config(
            sparse_route={"emb": route}, allreduce_by_allgather=setting),
            parse_resources(hosts), measured)

    plan = plan_of(True)
    dense = [v for v in plan.variables if v.route == "allreduce" and v.gradients]
    assert plan.allreduce_by_allgather and dense
    assert all(v.predicted_bytes == cost.allgather_bytes(v.nbytes, 2) for v in dense)
    assert "the allreduced gradients travel in it too" in plan.table()
    assert tfpar.Plan.from_json(plan.to_json()) == plan
    assert not plan_of(False).allreduce_by_allgather
    unmeasured = plan_of("auto")
    assert not unmeasured.allreduce_by_allgather
    assert any("links were not measured" in n for n in unmeasured.notes)
    assert not plan_of(True, route="ps").allreduce_by_allgather  # no allgather to ride
    for per_byte_s, on in ((1e-8, True), (1e-5, False)):
        links = routing.Links(latency_s=1e-3, per_byte_s=per_byte_s, alltoall_latency_s=1e-3)
        measured = plan_of("auto", links=links, hosts="localhost:4")
        assert measured.allreduce_by_allgather == on
        assert any(n.startswith(f"allreduce by allgather: {'on' if on else 'off'} (measured)")
                   for n in measured.notes)
    # Bytes that cost 2 ms more in an allgather at the allreduce's cost per byte: off;
    # at the allgather's own, a quarter of it (measured, no sum), on.
    size = sum(v.nbytes * len(v.gradients) for v in dense)
    per_byte_s = 2e-3 / (cost.allgather_bytes(size, 4) - cost.allreduce_bytes(size, 4))
    for gathered_s, on in ((None, False), (per_byte_s / 4, True)):
        links = routing.Links(latency_s=1e-3, per_byte_s=per_byte_s, alltoall_latency_s=1e-3,
                              allgather_per_byte_s=gathered_s)
        assert plan_of("auto", links=links, hosts="localhost:4").allreduce_by_allgather == on
    with pytest.raises(tfpar.TfparError, match="allreduce_by_allgather must be"):
        tfpar.Config(allreduce_by_allgather="yes")


def test_dense_gradients_ride_in_the_sharded_rows_all_to_all_where_asked_or_measured_to_pay():
    """Config(allreduce_by_allgather) where route "sharded" runs and no allgather: True
    sends the dense gradients in the sharded rows' gradient all-to-all (priced as an
    allgather of them); "auto" only with measured links where the bytes added cost less
    than the allreduce spared; never with local aggregation (the rows go to the host's
    collectors first) or a global norm over every gradient (the rows' post-processing
    needs the dense gradients summed first), each refusal named in the notes."""
    from tfpar.plan import cost
    from tfpar.plan.planner import make_plan
    from tfpar.plan.measurements import Measurements

    def plan_of(setting, links=None, hosts="localhost:2", clip=None, **config):
        graph, _ = models.build(optimizer="adagrad", sparse=True, clip=clip)
        measured = None if links is None else Measurements(
            links=links, steps=1, alphas={"emb": 0.2}, sent_rows={"emb": 16})
        return make_plan(tfpar.analyse(graph), tfpar.Config(
            sparse_route={"emb": "sharded"}, allreduce_by_allgather=setting,
            **{"local_aggregation": False, **config}), parse_resources(hosts), measured)

    def note(plan):
        return next(n for n in plan.notes if n.startswith("dense allreduce in the sharded"))

    plan = plan_of(True)
    dense = [v for v in plan.variables if v.route == "allreduce" and v.gradients]
    assert plan.allreduce_by_alltoall and not plan.allreduce_by_allgather and dense
    assert all(v.predicted_bytes == cost.allgather_bytes(v.nbytes, 2) for v in dense)
    assert "travel in its gradients' all-to-all" in plan.table()
    assert tfpar.Plan.from_json(plan.to_json()) == plan
    assert not plan_of(False).allreduce_by_alltoall
    assert "links were not measured" in note(plan_of("auto"))
    aggregated = plan_of(True, hosts="a:2,b:2", local_aggregation=True)
    assert not aggregated.allreduce_by_alltoall and "local aggregation" in note(aggregated)
    clipped = plan_of(True, clip=0.05)
    assert not clipped.allreduce_by_alltoall and "global norm" in note(clipped)
    for per_byte_s, on in ((1e-8, True), (1e-5, False)):
        links = routing.Links(latency_s=1e-3, per_byte_s=per_byte_s, alltoall_latency_s=1e-3)
        measured = plan_of("auto", links=links, hosts="localhost:4")
        assert measured.allreduce_by_alltoall == on
        assert note(measured).startswith("dense allreduce in the sharded all-to-all: "
                                         + ("on (measured)" if on else "off (measured"))


def test_density_routing_prices_the_dense_gradients_in_the_sharded_all_to_all():
    """Where every sparse variable is sharded and no host aggregates, the dense gradients
    may ride in the rows' all-to-all (`Fold.alltoall_s`): the step's prediction gains it
    where it pays or is forced, never with local aggregation or another route beside,
    and it is not offered where a global norm over the rows reads the dense gradients."""
    from tfpar.plan.planner import _fold
    graph, _ = models.build(batch=8, sparse=True, optimizer="adagrad")
    analysis = tfpar.analyse(graph)
    links = routing.Links(latency_s=5e-3, per_byte_s=1e-10, alltoall_latency_s=1e-5)
    auto = _fold(analysis, tfpar.Config(), 4, links)
    dense = sum(v.nbytes * len(v.updates) for v in analysis.trained if v.kind == "dense")
    assert auto.alltoall_s == pytest.approx(3 * dense * 1e-10 - 5e-3)  # 6 D against 3 D + a round
    assert auto.into_alltoall_s({"sharded"}, False) == auto.alltoall_s < 0
    assert auto.into_alltoall_s({"sharded"}, True) == 0.0
    assert auto.into_alltoall_s({"sharded", "allgather"}, False) == 0.0
    costly = routing.Fold(0.0, alltoall_s=2e-3)
    assert costly.into_alltoall_s({"sharded"}, False) == 0.0  # "auto": not where it costs
    assert dataclasses.replace(costly, forced=True).into_alltoall_s({"sharded"}, False) == 2e-3
    clipped, _ = models.build(batch=8, sparse=True, optimizer="adagrad", clip=0.05)
    assert _fold(tfpar.analyse(clipped), tfpar.Config(), 4, links).alltoall_s is None
    choices = {"emb": routing.RouteChoice("sharded", 0.3, 1.0, 1.0, "", 1.0, 2e-3)}
    plain = routing.predicted_step_s(choices, links)
    assert routing.predicted_step_s(choices, links, fold=auto) == pytest.approx(
        plain + auto.alltoall_s)


def test_density_routing_prices_the_allgather_with_the_allreduce_it_takes_in():
    """Where the dense gradients' allreduce would ride in an allgather and that pays (fast
    links, a round of 5 ms), the allgather's kind saves that round, and density routing
    prefers it to the all-to-alls it chose without the fold. (Clipped by the global norm:
    the table cannot take the dense allreduce route, free of fixed costs.)"""
    from tfpar.plan.planner import route_by_density
    graph, _ = models.build(batch=8, sparse=True, optimizer="adagrad", clip=0.05)
    analysis = tfpar.analyse(graph)
    layout = parse_resources("a:2,b:2")
    links = routing.Links(latency_s=5e-3, per_byte_s=1e-10, alltoall_latency_s=1e-5)
    routes = {}
    for setting in (False, "auto"):
        config = tfpar.Config(sparse_route="auto", local_aggregation=False,
                              allreduce_by_allgather=setting)
        routes[setting] = route_by_density(analysis, config, layout, {"emb": 0.3}, links,
                                           3).choices["emb"].route
    assert routes == {False: "sharded", "auto": "allgather"}
    dense = sum(v.nbytes * len(v.updates) for v in analysis.trained if v.kind == "dense")
    assert routing.fold_seconds(dense, 4, links) == pytest.approx(
        3 * dense * 1e-10 - 5e-3)  # 6 D in the allgather, 3 D and a round in the allreduce
    slow = dataclasses.replace(links, per_byte_s=1e-3)
    assert routing.fold_seconds(dense, 4, slow) == 0.0  # no fold
    assert routing.fold_seconds(dense, 4, slow, forced=True) > 0


def test_a_table_on_the_dense_route_is_priced_as_it_rides_in_the_folded_allgather():
    """Where the step's allreduce rides in the allgather, a table on the dense route rides
    too: its summed rows and flags gathered from every worker (6 D on 4 workers, where its
    allreduce moved 3 D). A small table with 70% of its rows touched takes the dense
    route without the fold and its rows' allgather with it; and where the fold pays for
    the dense gradients but its tables' summed rows would cost more than that, no fold."""
    big = routing.Candidate("big", 500_000, 128, 0.001)
    small = routing.Candidate("small", 300, 32, 0.7)
    links = routing.Links(latency_s=5e-3, per_byte_s=1e-8)
    fold = routing.Fold(dense_s=-4e-3)
    plain = routing.decide((big, small), 4, links)
    folding = routing.decide((big, small), 4, links, fold=fold)
    assert (plain["big"].route, plain["small"].route) == ("allgather", "allreduce")
    assert (folding["big"].route, folding["small"].route) == ("allgather", "allgather")
    # Sharded rows would move fewer bytes of both; the reason prices the step they would
    # make (no allgather left to ride in, so no fold): 4.584 - 2.292 ms.
    nearer = routing.decide((big, small), 4, dataclasses.replace(
        links, alltoall_latency_s=4e-3), fold=fold)["big"]
    assert nearer.route == "allgather"
    assert "sharded rows (all-to-all) would save 2.292 ms" in nearer.reason, nearer
    rows, D = 0.7 * 300, 300 * (32 + 4)
    assert folding["small"].folded_s == pytest.approx(6 * D * 1e-8)
    assert folding["small"].allgather_s == pytest.approx(6 * rows * (32 + 8) * 1e-8)
    assert routing.folds(folding, fold)
    assert "0.648 ms allreduce in the allgather" in routing.describe("small", folding["small"])
    assert routing.predicted_step_s(folding, links, fold=fold) == pytest.approx(
        folding["big"].allgather_s + folding["small"].allgather_s + 5e-3 - 4e-3)
    # Kept on the dense route (forced), the table's 3 D more in the allgather cost more
    # than the fold saves: "auto" leaves the fold off, as the plan does.
    small_forced = routing.decide((big,), 4, links, {"small": "allreduce"}, fold=fold)
    assert routing.folds(small_forced, fold, ("allreduce",))
    priced = routing.decide((big, small), 4, links, fold=fold)
    kept = {**priced, "small": dataclasses.replace(priced["small"], route="allreduce")}
    assert routing.fold_delta_s(kept, fold) == pytest.approx(-4e-3 + 3 * D * 1e-8)
    tight = routing.Fold(dense_s=-1e-5)
    assert not routing.folds(kept, tight) and routing.folds(kept, dataclasses.replace(
        tight, forced=True))
    assert routing.predicted_step_s(kept, links, fold=tight) == pytest.approx(
        kept["big"].allgather_s + kept["small"].allreduce_s + 5e-3)


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


def test_local_aggregation_auto_is_decided_with_the_routes():
    """Config(local_aggregation="auto") with density routing prices every route with and
    without it and keeps the faster step: the sharded rows' three more all-to-alls lose to
    the bytes their hosts share on slow links and win on fast ones."""
    from tfpar.plan.planner import route_by_density
    # (Clipped by the global norm: no dense allreduce, whose missing fixed cost would win
    # on fast links; and no fold of the dense allreduce into an allgather, which would
    # make the allgather the cheapest there.)
    graph, _ = models.build(batch=8, sparse=True, optimizer="adagrad", clip=0.05)
    analysis = tfpar.analyse(graph)
    layout = parse_resources("a:2,b:2")
    config = tfpar.Config(sparse_route="auto", local_aggregation="auto",
                          allreduce_by_allgather=False)
    rows = analysis.variable("emb").shape[0]
    for per_byte, on in ((1e-6, True), (1e-10, False)):
        links = routing.Links(latency_s=5e-3, per_byte_s=per_byte, alltoall_latency_s=1e-5)
        chosen = route_by_density(analysis, config, layout, {"emb": 0.3}, links, 3,
                                  shared={"emb": 0.1 * rows})
        always = route_by_density(analysis, dataclasses.replace(config, local_aggregation=True),
                                  layout, {"emb": 0.3}, links, 3, shared={"emb": 0.1 * rows})
        c, a = chosen.choices["emb"], always.choices["emb"]
        assert c.route == a.route == "sharded", (c, a)
        assert (c.sharded_s == a.sharded_s) is on, (c, a)  # priced with the aggregation


# -- route trials (Config(search_routes=True)) ---------------------------------------------------
def test_route_trials_time_the_models_choice_then_each_route():
    """The candidates: the model's choice first, every measured variable on one route where
    it can take it, with local aggregation on and off where "auto" decides it; those the
    model predicts over 4x its best plus 20 ms are not timed, and at most search_trials
    are."""
    from tfpar.plan.measurements import Measurements
    from tfpar.plan.planner import route_trials
    graph, _ = models.build(batch=8, sparse=True, optimizer="adagrad", emb_partitions=2,
                            shared_embedding=True)
    analysis = tfpar.analyse(graph)
    layout = parse_resources("a:2,b:2")
    links = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=1e-3)
    names = ("emb/part_0", "emb/part_1", "shared")
    measured = Measurements(links=links, steps=2, alphas={n: 0.3 for n in names},
                            duplicates={n: 1.0 for n in names})
    config = tfpar.Config(sparse_route="auto", local_aggregation="auto", search_routes=True,
                          search_trials=10)
    trials = route_trials(analysis, config, layout, measured)
    assert trials[0].label.startswith("the model's choice")
    best = min(t.predicted_s for t in trials)
    assert all(t.predicted_s <= 4 * best + 0.02 for t in trials)
    # Slow links, few rows: the dense allreduce (predicted 8x the servers' step) is not timed.
    slow = dataclasses.replace(measured, links=dataclasses.replace(links, per_byte_s=1e-4),
                               alphas={n: 0.05 for n in names})
    assert "allreduce" in {r for t in trials for r in t.routes.values()}
    assert "allreduce" not in {r for t in route_trials(analysis, config, layout, slow)
                               for r in t.routes.values()}
    keys = [(tuple(sorted(t.routes.items())), t.aggregation) for t in trials]
    assert len(set(keys)) == len(keys)  # none timed twice
    every = {r: {n: r for n in names} for r in routing.SPARSE_ROUTES}
    for t in trials[1:]:
        assert t.routes in every.values(), t
        if set(t.routes.values()) & {"ps", "sharded"}:
            assert t.aggregation in (True, False)
        else:
            assert t.aggregation is None
    assert {t.aggregation for t in trials if t.routes == every["sharded"]} == {True, False}
    capped = route_trials(analysis, dataclasses.replace(config, search_trials=2), layout,
                          measured)
    assert capped == trials[:2]
    # Fixed aggregation: one variant per set of routes.
    fixed = route_trials(analysis, dataclasses.replace(config, local_aggregation=True),
                         layout, measured)
    assert all(t.aggregation is None for t in fixed)


def test_the_fastest_route_trial_overrules_the_model_and_the_plan_shows_every_trial():
    from tfpar.plan.measurements import Measurements
    from tfpar.plan.planner import make_plan
    graph, _ = models.build(batch=8, sparse=True, optimizer="adagrad")
    analysis = tfpar.analyse(graph)
    layout = parse_resources("a:2,b:2")
    links = routing.Links(latency_s=1e-3, per_byte_s=1e-8)
    config = tfpar.Config(sparse_route="auto", local_aggregation="auto", search_routes=True)
    measured = Measurements(links=links, steps=2, alphas={"emb": 0.3},
                            duplicates={"emb": 1.0})
    model = make_plan(analysis, config, layout, measured).variable("emb").route
    other = "sharded" if model != "sharded" else "allgather"
    timed = (routing.RouteTrial("the model's choice", {"emb": model}, None, 1e-3, 9e-3),
             routing.RouteTrial("sharded x1, aggregation off", {"emb": other}, False, 2e-3,
                                4e-3),
             routing.RouteTrial("ps x1, aggregation on", {"emb": "ps"}, True, 3e-3, None))
    assert routing.fastest_trial(timed) == timed[1]
    plan = make_plan(analysis, config, layout, dataclasses.replace(
        measured, route_trials=timed, routes=timed[1].routes, local_aggregation=False))
    assert plan.variable("emb").route == other
    assert plan.routing.choices["emb"].reason.startswith("route trials: the fastest was")
    assert f"the model chose {model}" in plan.routing.choices["emb"].reason
    assert plan.routing.trials == timed
    assert any(n.startswith("route trial 3: ps x1, aggregation on: predicted 3.00 ms, "
                            "measured failed") for n in plan.notes)
    if other == "sharded":
        assert plan.local_aggregation is False
        assert "local aggregation off (route trials)" in plan.notes
    assert tfpar.Plan.from_json(plan.to_json()) == plan
    assert not plan.routing.trials_remembered
    again = make_plan(analysis, config, layout, dataclasses.replace(
        measured, route_trials=timed, routes=timed[1].routes, local_aggregation=False,
        routes_remembered=True))
    assert again.routing.trials_remembered and again.variable("emb").route == other
    assert any(n.startswith("route trials remembered") for n in again.notes)


def test_search_routes_needs_something_to_time():
    with pytest.raises(TfparError, match="search_routes.*sparse_route='auto'"):
        tfpar.Config(search_routes=True)
    with pytest.raises(TfparError, match="True, False or 'force'"):
        tfpar.Config(sparse_route="auto", search_routes="yes")
    tfpar.Config(sparse_route={"emb": "ps"}, search_routes=True)
    tfpar.Config(sparse_route="auto", search_routes="force")
