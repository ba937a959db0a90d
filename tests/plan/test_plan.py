"""The Plan value, the planner's decisions and the cost model."""
import pytest
import tensorflow as tf

import tfpar
from tfpar.plan import cost
from tfpar.graph.analysis import analyse
from tfpar.plan import Plan
from tfpar.plan.planner import make_plan
from tfpar.plan.layout import parse_resources

from tests.support import models

tf1 = tf.compat.v1


def plan_for(n=2, **model):
    graph, _ = models.build(batch=8, **model)
    config = tfpar.Config(run_mode="AR" if model.get("sparse") else "HYBRID")
    return make_plan(analyse(graph), config, parse_resources(f"localhost:{n}"))


def test_json_round_trip():
    for plan in (plan_for(), plan_for(3, sparse=True, optimizer="adam")):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        assert again.table() == plan.table()


def test_json_round_trip_of_a_plan_with_every_route():
    """allreduce, allgather, ps (in parts), replicated and tiled in one plan."""
    import dataclasses
    from tfpar.plan.mesh import DeviceMesh
    from tfpar.partition.tiling import Dataflow, plan_tiling
    graph, _ = models.build(sparse=True, optimizer="adam", batch=8)
    analysis, layout = analyse(graph), parse_resources("a:2,b:2")
    hybrid = make_plan(analysis, tfpar.Config(partitions=2), layout)
    gathered = make_plan(analysis, tfpar.Config(run_mode="AR"), layout).variable("emb")
    df = Dataflow()
    df.matrix("x", (8, models.IN), "input")
    df.matrix("w1", (models.IN, models.HIDDEN), "weight")
    df.matrix("h", (8, models.HIDDEN), "activation")
    df.matmul("mm", "x", "w1", "h")
    tiling = plan_tiling(df, DeviceMesh.hosts(2, 2, 1.25e9, 25e9, 1e-5))
    plan = dataclasses.replace(hybrid, variables=hybrid.variables + (
        dataclasses.replace(gathered, name="emb_gathered"),)).with_tiling(tiling)
    routes = {v.route for v in plan.variables}
    assert routes == {"allreduce", "allgather", "ps", "replicated", "tiled"}, routes
    assert plan.variable("w1").tiling == tiling.tilings["w1"]
    assert plan.variable("w1/Adam").route == "tiled"  # slots follow their variable
    assert any(len(v.parts) == 2 for v in plan.variables if v.route == "ps")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.table() == plan.table()
    assert again.tiling.mesh == tiling.mesh and again.tiling.tile("w1", 3) == tiling.tile("w1", 3)
    two = plan_tiling(df, 2)
    stranger = dataclasses.replace(two, tilings={**two.tilings, "w9": two.tilings["w1"]},
                                   kinds={**two.kinds, "w9": "weight"})
    with pytest.raises(ValueError, match="does not have"):
        hybrid.with_tiling(stranger)


def test_the_rewrite_holds_a_tiled_route_as_tiles():
    """The planner's tiling slots into the Plan, and the rewrite gives the weight and its
    slots tiles of their own (equivalence: tests/transform/test_tiled_rewrite.py)."""
    from tfpar.runtime import job
    from tfpar.partition.tiling import Dataflow, plan_tiling
    from tfpar.transform.rewrite import rewrite
    job.horovod()  # building Horovod ops needs it initialised (here a job of one)
    graph, _ = models.build(batch=8, optimizer="momentum")
    plan = make_plan(analyse(graph), tfpar.Config(), parse_resources("localhost:2"))
    df = Dataflow()
    df.matrix("x", (8, models.IN), "input")
    df.matrix("w1", (models.IN, models.HIDDEN), "weight")
    df.matrix("h", (8, models.HIDDEN), "activation")
    df.matmul("mm", "x", "w1", "h")
    tiled = plan.with_tiling(plan_tiling(df, 2))
    tiling = tiled.variable("w1").tiling
    done = rewrite(graph, tiled, 0)
    assert set(done.tiled.tiles) == {"w1", "w1/Momentum"}
    for tile in done.tiled.tiles.values():
        assert tuple(tile.shape.as_list()) == tiling.tile_shape((models.IN, models.HIDDEN))
    whole = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
    assert not whole & {"w1", "w1/Momentum"} and "w2" in whole


def test_routes_and_predicted_bytes():
    plan = plan_for(4, sparse=True, optimizer="adam")
    assert plan.variable("w1").route == "allreduce"
    assert plan.variable("w1").predicted_bytes == cost.allreduce_bytes(models.IN * models.HIDDEN * 4, 4)
    emb = plan.variable("emb")
    assert emb.route == "allgather" and emb.reduction == "average"
    # 8 looked-up rows of IN floats per worker, gathered by 3 others: 2 s (N-1).
    assert emb.predicted_bytes == 2 * (8 * models.IN * 4) * 3
    assert plan.variable("emb/Adam").route == "replicated"
    assert plan.variable("global_step").route == "replicated"
    assert plan.predicted_bytes_per_step == sum(
        v.predicted_bytes for v in plan.variables if v.route != "replicated")


def test_parallax_table3_vectors():
    # Parallax section 3.1 (digest test vectors): N = 8, w = 4 MB.
    mb = 1e6
    assert cost.allreduce_bytes(4 * mb, 8) == pytest.approx(14 * mb)
    assert cost.allgather_bytes(0.02 * 4 * mb, 8) == pytest.approx(1.12 * mb)
    assert cost.allreduce_bytes(4 * mb, 1) == 0


def test_hybrid_without_sparse_runs_as_ar():
    plan = plan_for()
    assert plan.run_mode == "HYBRID" and plan.mode == "AR"
    assert any("HYBRID runs as AR" in n for n in plan.notes)


def test_hybrid_puts_sparse_variables_and_slots_on_the_ps():
    graph, _ = models.build(sparse=True, optimizer="adagrad", batch=8)
    plan = make_plan(analyse(graph), tfpar.Config(), parse_resources("a:2,b:2"))
    assert plan.mode == "HYBRID" and plan.num_ps == 2 and plan.local_aggregation
    emb = plan.variable("emb")
    # rows dealt out modulo (Config.ps_rows "auto", nothing measured)
    assert emb.route == "ps" and [(p.start, p.stop, p.step) for p in emb.parts] == \
        [(0, 20, 2), (1, 20, 2)]
    assert {p.ps_task for p in emb.parts} == {0, 1}  # balanced by bytes
    slot = plan.variable("emb/Adagrad")
    assert slot.route == "ps" and slot.slot_of == "emb" and slot.parts == emb.parts
    assert plan.variable("w1").route == "allreduce"
    assert plan.variable("w1/Adagrad").route == "replicated"
    # Parallax Table 3: sparse PS moves 4 alpha w (N-1)/N, against 2 alpha w (N-1) allgathered.
    ar = make_plan(analyse(graph), tfpar.Config(run_mode="AR"), parse_resources("a:2,b:2"))
    assert ar.variable("emb").predicted_bytes / emb.predicted_bytes == pytest.approx(4 / 2)
    assert Plan.from_json(plan.to_json()) == plan
    assert "1::2@1" in plan.table() or "1::2@0" in plan.table()


def test_ps_mode_puts_every_trained_variable_on_the_ps():
    graph, _ = models.build(sparse=True, optimizer="adam")
    plan = make_plan(analyse(graph), tfpar.Config(run_mode="PS", partitions=3),
                     parse_resources("a:1,b:1"))
    assert all(v.route == "ps" for v in plan.variables if v.role in ("trained", "slot"))
    assert plan.variable("global_step").route == "replicated"
    assert len(plan.variable("emb").parts) == 3 and len(plan.variable("w1").parts) == 1
    load = plan.ps_load()
    assert len(load) == 2 and min(load) > 0


def test_partition_count_errors():
    graph, _ = models.build(sparse=True)
    a = analyse(graph)
    layout = parse_resources("localhost:2")
    with pytest.raises(tfpar.TfparError, match="into 21 parts: it has only 20 rows"):
        make_plan(a, tfpar.Config(partitions=21), layout)
    with pytest.raises(tfpar.TfparError, match="names nope"):
        make_plan(a, tfpar.Config(partitions={"nope": 2}), layout)
    with pytest.raises(tfpar.TfparError, match="'w1', which is not on the parameter servers"):
        make_plan(a, tfpar.Config(partitions={"w1": 2}), layout)
    with pytest.raises(tfpar.TfparError, match="positive int"):
        tfpar.Config(partitions=0)



def test_reference_variables_and_post_processed_gradients_go_to_the_ps():
    """Once refused; now planned (tests/jobs/test_post_processing.py runs them)."""
    layout = parse_resources("localhost:2")
    graph, _ = models.build(sparse=True, use_resource=False)
    assert make_plan(analyse(graph), tfpar.Config(), layout).variable("emb").route == "ps"
    graph, _ = models.build(sparse=True, clip=0.1)
    emb = make_plan(analyse(graph), tfpar.Config(), layout).variable("emb")
    g = emb.gradients[0]
    assert emb.route == "ps" and g.post_processed and g.final_values != g.values
    assert g.row_sums == ("global_norm/L2Loss:0",)  # summed over workers for the norm


def _densified(clip=False):
    """An embedding whose IndexedSlices gradient the user densifies (Adam then applies a
    dense update, as Google BERT's AdamWeightDecayOptimizer does with its arithmetic);
    clip: clipped by global norm first (a sum over the rows: no dense allreduce)."""
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [10, 3], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2, 2]))
        (grad, var), = tf1.train.AdamOptimizer(0.1).compute_gradients(loss)
        if clip:
            (grad,), _ = tf.clip_by_global_norm([grad], 1.0)
        tf1.train.AdamOptimizer(0.1).apply_gradients([(tf.convert_to_tensor(grad), var)])
    return analyse(g)


def test_a_sparse_variable_with_a_dense_update_takes_a_replicated_route():
    """The servers and sharded rows apply sparse updates only: a sparse variable whose
    optimizer densifies its rows goes to the dense allreduce (the allgather where a sum
    over its rows makes that inexact) under the global routes, with a note; a route set
    for it by name, or PS mode, is refused with the fix."""
    layout = parse_resources("localhost:2")
    a = _densified()
    assert a.variable("emb").kind == "sparse"
    for route in ("ps", "sharded"):
        plan = make_plan(a, tfpar.Config(sparse_route=route), layout)
        assert plan.variable("emb").route == "allreduce", route
        assert any(n.startswith("emb: allreduce, as its optimizer's update is dense")
                   for n in plan.notes)
    assert make_plan(_densified(clip=True), tfpar.Config(), layout).variable(
        "emb").route == "allgather"
    with pytest.raises(tfpar.TfparError, match="no sparse apply.*Route it to 'allreduce' or "
                                               "'allgather'"):
        make_plan(a, tfpar.Config(sparse_route={"emb": "ps"}), layout)
    with pytest.raises(tfpar.TfparError, match="no sparse apply.*run_mode 'HYBRID'"):
        make_plan(a, tfpar.Config(run_mode="PS"), layout)
    # density routing never prices the servers or sharded rows for it
    from tfpar.plan import routing
    allowed = routing.allowed_routes(routing.Candidate("emb", 10, 12, 0.3, ps_route=False,
                                                       sharded_route=False), 2)
    assert set(allowed) == {"allreduce", "allgather"}


def test_an_add_to_a_table_outside_the_step_keeps_it_off_the_servers():
    """Every worker runs a write between steps, so an add (assign_add, scatter_add, ...)
    would reach the servers once per worker: the analysis lists such ops, the global
    "ps" route falls back to a replicated one with a note, and the servers named for the
    variable (or PS mode) are refused at planning, before any server starts; sharded
    rows (one writer a row) take it. A write of values leaves the servers possible."""
    layout = parse_resources("localhost:2")

    def table(write):
        g = tf.Graph()
        with g.as_default():
            emb = tf1.get_variable("emb", [10, 3], use_resource=True)
            loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2, 2]))
            tf1.train.AdagradOptimizer(0.1).minimize(loss)
            write(emb)
        return analyse(g)

    added = table(lambda emb: tf1.scatter_add(emb, [0], tf.ones([1, 3]), name="counts"))
    assert added.variable("emb").adds_outside == ("counts",)
    plan = make_plan(added, tfpar.Config(sparse_route="ps"), layout)
    assert plan.variable("emb").route == "allreduce"
    assert any(n.startswith("emb: allreduce, not the parameter servers: op 'counts' adds")
               for n in plan.notes)
    assert make_plan(added, tfpar.Config(sparse_route="sharded"), layout).variable(
        "emb").route == "sharded"
    with pytest.raises(tfpar.NotYetSupportedError, match=r"cannot put 'emb' on the parameter "
                       r"servers: op 'counts' adds to it.*sparse_route=\{'emb': 'sharded'\}"):
        make_plan(added, tfpar.Config(sparse_route={"emb": "ps"}), layout)
    with pytest.raises(tfpar.NotYetSupportedError, match="once per worker.*run_mode 'HYBRID'"):
        make_plan(added, tfpar.Config(run_mode="PS"), layout)
    written = table(lambda emb: tf1.scatter_update(emb, [0], tf.zeros([1, 3])))
    assert written.variable("emb").adds_outside == ()
    assert make_plan(written, tfpar.Config(sparse_route="ps"), layout).variable(
        "emb").route == "ps"


def test_sum_semantics_in_plan():
    graph, _ = models.build(sparse=True)
    plan = make_plan(analyse(graph), tfpar.Config(run_mode="AR", average_dense=False),
                     parse_resources("localhost:2"))
    assert plan.variable("w1").reduction == "sum" and plan.variable("emb").reduction == "average"


def test_training_batch_norms_are_normalised_over_the_global_batch():
    """A fused batch norm in training mode, and tf.nn.moments over the batch (a non-fused
    batch norm, named by its mean), are listed in the plan (the rewrite synchronises them;
    the JSON keeps them), and so is Keras's tf.cond for training=<a tensor>; one worker
    needs nothing; a mean named as moments' but not built by tf.nn.moments, and a fused
    batch norm inside another tf.cond, are not synchronised, and the plan says so."""
    plan = plan_for(batch_norm=True)
    assert plan.batch_norms == ("bn/FusedBatchNormV3",)
    assert any("normalised over the global batch" in note for note in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan_for(1, batch_norm=True).batch_norms == ()
    assert plan_for().batch_norms == ()
    assert plan_for(batch_norm="moments").batch_norms == ("bn/moments/mean",)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [8, 4])
        h = tf1.layers.batch_normalization(tf1.layers.dense(x, 4), training=True)
        with tf1.name_scope("moments"):  # a mean of the batch, not tf.nn.moments
            h = h - tf.reduce_mean(tf1.layers.dense(x, 4, name="d2"), 0, name="mean")
        loss = tf.reduce_mean(tf.square(h))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    assert plan.batch_norms == ("batch_normalization/moments/mean",)
    assert any(note.startswith("not single-device training: the batch statistics of "
                               "moments/mean are") for note in plan.notes), plan.notes
    # A training flag that is a tensor: the fused ops sit inside tf.cond's functions.
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 2, 2, 3])
        training = tf1.placeholder_with_default(True, [])
        h = tf1.layers.batch_normalization(x, training=training)
        loss = tf.reduce_mean(tf.square(h))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    assert plan.batch_norms == ("batch_normalization/cond",)
    assert not any(note.startswith("not single-device training") for note in plan.notes)
    # A fused batch norm in a cond that is not Keras's: its branch computes more after it.
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 2, 2, 3])
        training = tf1.placeholder_with_default(True, [])
        scale = tf1.get_variable("scale", [3])
        h = tf.cond(training, lambda: 2.0 * tf1.nn.fused_batch_norm(
            x, scale, tf.zeros([3]), is_training=True)[0], lambda: x)
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(h)))
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    assert plan.batch_norms == ()
    assert any(note.startswith("not single-device training") and "cond_true" in note
               for note in plan.notes), plan.notes


def test_sharded_route_splits_rows_and_slots_over_the_workers():
    """Config(sparse_route="sharded", sharded_rows="ranges"): the sparse variable and its
    slots split by rows over the workers (the first ranges a row longer), the dense ones
    on allreduce, no parameter server; the plan prints each worker's rows and survives a
    JSON round trip."""
    graph, _ = models.build(sparse=True, optimizer="adam", batch=8)
    plan = make_plan(analyse(graph), tfpar.Config(sparse_route="sharded", sharded_rows="ranges"),
                     parse_resources("a:2,b:1"))
    emb = plan.variable("emb")
    assert emb.route == "sharded" and str(emb.tiling) == "R3" and not emb.parts
    assert [emb.tiling.tile_ranges(emb.shape, d)[0] for d in range(3)] == [
        (0, 7), (7, 14), (14, 20)]
    assert {plan.variable(s).route for s in ("emb/Adam", "emb/Adam_1")} == {"sharded"}
    assert plan.variable("emb/Adam").tiling == emb.tiling
    assert plan.variable("w1").route == "allreduce" and plan.num_ps == 0
    # ids and rows to and from their owners: 4 (values + ids) (N-1)/N
    values = 8 * models.IN * 4
    assert emb.predicted_bytes == pytest.approx(cost.sharded_bytes(values, 8 * 8, 3))
    assert "emb R3: w0[0:7,0:6] w1[7:14,0:6] w2[14:20,0:6]" in plan.table()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.table() == plan.table()
    per_variable = make_plan(analyse(graph), tfpar.Config(sparse_route={"emb": "sharded"}),
                             parse_resources("localhost:2"))
    assert per_variable.variable("emb").route == "sharded"


def test_sharded_rows_are_dealt_out_modulo_unless_ranges_are_asked_or_measured_better():
    """Config.sharded_rows: "modulo" (row i on worker i % N; the default where nothing was
    measured), "ranges", or "auto" with the measured rows asked of the busiest owner:
    the way with the fewer wins, the plan's notes give both; slots follow."""
    from tfpar.plan.measurements import Measurements
    graph, _ = models.build(sparse=True, optimizer="adam", batch=8)
    layout = parse_resources("a:2,b:1")
    plan = make_plan(analyse(graph), tfpar.Config(sparse_route="sharded"), layout)
    emb = plan.variable("emb")
    assert str(emb.tiling) == "M3" and emb.tiling.cyclic
    assert plan.variable("emb/Adam").tiling == plan.variable("emb/Adam_1").tiling == emb.tiling
    assert "emb M3: w0[0::3,0:6] w1[1::3,0:6] w2[2::3,0:6]" in plan.table()
    assert Plan.from_json(plan.to_json()) == plan
    assert not any("sharded rows" in note for note in plan.notes)  # nothing measured
    for ranges, modulo, way in ((30.0, 12.0, "M3"), (11.0, 12.0, "R3"), (12.0, 12.0, "M3")):
        measured = Measurements(owner_rows={"emb": {"ranges": ranges, "modulo": modulo,
                                                    "even": 10.0}})
        chosen = make_plan(analyse(graph), tfpar.Config(sparse_route="sharded"), layout,
                           measured)
        assert str(chosen.variable("emb").tiling) == way
        assert str(chosen.variable("emb/Adam").tiling) == way
        note = next(x for x in chosen.notes if x.startswith("sharded rows of emb"))
        assert f"{modulo:.0f} rows a step with modulo, {ranges:.0f} with ranges" in note
        # An explicit choice is kept whatever was measured.
        forced = make_plan(analyse(graph), tfpar.Config(sparse_route="sharded",
                                                        sharded_rows="ranges"),
                           layout, measured)
        assert str(forced.variable("emb").tiling) == "R3"
    with pytest.raises(tfpar.TfparError, match="sharded_rows must be"):
        tfpar.Config(sharded_rows="hash")
    with pytest.raises(tfpar.TfparError, match="only a sparse variable on route 'sharded'"):
        tfpar.Config(tiling={"w1": "M"})


def test_sharded_route_refusals():
    """What route "sharded" cannot do exactly is refused with the fix where a variable is
    named to it: a dense update of a sparse variable, fewer rows than workers; and a mode
    other than HYBRID."""
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [10, 3], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2, 2]))
        (grad, var), = tf1.train.AdamOptimizer(0.1).compute_gradients(loss)
        tf1.train.AdamOptimizer(0.1).apply_gradients([(tf.convert_to_tensor(grad), var)])
    with pytest.raises(tfpar.TfparError, match="cannot shard 'emb': its optimizer's update "
                                               "is dense"):
        make_plan(analyse(g), tfpar.Config(sparse_route={"emb": "sharded"}),
                  parse_resources("localhost:2"))
    graph, _ = models.build(sparse=True, optimizer="sgd", batch=8)
    with pytest.raises(tfpar.TfparError, match="cannot shard 'emb'"):
        make_plan(analyse(graph), tfpar.Config(sparse_route={"emb": "sharded"}),
                  parse_resources("localhost:21"))
    # Under the global route such a table takes the allgather (no server), with a note.
    plan = make_plan(analyse(graph), tfpar.Config(sparse_route="sharded"),
                     parse_resources("localhost:21"))
    assert plan.variable("emb").route == "allgather"
    assert "emb: allgather, not sharded rows: it needs a static number of rows, at least " \
           "one a worker" in plan.notes
    with pytest.raises(tfpar.TfparError, match="only HYBRID mode mixes"):
        tfpar.Config(run_mode="AR", sparse_route="sharded")
