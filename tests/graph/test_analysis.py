"""Graph analysis: classification and variable/gradient/update pairing on real graphs."""
import pytest
import tensorflow as tf

import tfpar
from tfpar.graph.analysis import analyse

tf1 = tf.compat.v1


def graph_with(optimizer=lambda: tf1.train.AdamOptimizer(0.1), use_resource=True,
               partitioner=None, clip=False, two_optimizers=False, ema=False, total=False):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 3], name="x")
        ids = tf1.placeholder(tf.int32, [4], name="ids")
        w = tf1.get_variable("w", [3, 2], use_resource=use_resource)
        emb = tf1.get_variable("emb", [10, 3], use_resource=use_resource, partitioner=partitioner)
        shared = tf1.get_variable("shared", [10, 3], use_resource=use_resource)
        frozen = tf1.get_variable("frozen", [3], use_resource=use_resource)  # no gradient
        h = x + tf.nn.embedding_lookup(emb, ids) + tf.nn.embedding_lookup(shared, ids)
        y = tf.matmul(h, w) + tf.reduce_sum(tf.matmul(x, shared, transpose_b=True))
        loss = tf.reduce_mean(y * y) + 0 * tf.reduce_sum(tf.stop_gradient(frozen))
        step = tf1.train.get_or_create_global_step()
        if two_optimizers:
            tf1.train.AdamOptimizer(0.1).minimize(loss, var_list=[w], global_step=step)
            others = [v for v in tf1.trainable_variables() if v.op.name not in ("w", "frozen")]
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=others)
        else:
            opt = optimizer()
            gv = [(g_, v) for g_, v in opt.compute_gradients(loss) if g_ is not None]
            grads, variables = zip(*gv)
            if clip:
                grads, _ = tf.clip_by_global_norm(grads, 1.0)
            train = opt.apply_gradients(list(zip(grads, variables)), global_step=step)
            if ema:
                with tf.control_dependencies([train]):
                    tf1.train.ExponentialMovingAverage(0.9).apply([emb])
            if total:  # a whole read of emb after the step, into another variable
                with tf.control_dependencies([train]):
                    tf1.get_variable("total", [], use_resource=use_resource,
                                     trainable=False).assign(tf.reduce_sum(emb))
    return g


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam", "adagrad", "rmsprop"])
def test_classification_and_pairing(use_resource, opt):
    optimizer = {"sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
                 "momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
                 "adam": lambda: tf1.train.AdamOptimizer(0.1),
                 "adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
                 "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.1)}[opt]
    a = analyse(graph_with(optimizer, use_resource=use_resource))
    w, emb, shared = a.variable("w"), a.variable("emb"), a.variable("shared")
    assert (w.kind, emb.kind, shared.kind) == ("dense", "sparse", "dense")
    assert w.resource is use_resource
    assert a.variable("frozen").role == "untrained"
    # The raw gradients are tf.gradients' outputs, paired with the right variable.
    assert w.updates[0].gradient.values.startswith("gradients/MatMul_grad")
    assert emb.updates[0].gradient.indices.startswith("gradients/embedding_lookup_grad")
    assert "AddN" in shared.updates[0].gradient.values  # gather + matmul: summed, dense
    assert a.global_step == "global_step"
    for v in (w, emb, shared):
        assert len(v.updates) == 1
        assert all(s.startswith(v.name + "/") for s in v.slots)
        for s in v.slots:
            assert a.variable(s).role == "slot" and a.variable(s).slot_of == v.name
    expected_slots = {"sgd": 0, "momentum": 1, "adam": 2, "adagrad": 1, "rmsprop": 2}[opt]
    assert len(w.slots) == expected_slots and len(emb.slots) == expected_slots
    assert w.nbytes == 24 and w.shape == (3, 2) and w.dtype == "float32"


def test_resource_op_types_are_recorded():
    a = analyse(graph_with(lambda: tf1.train.AdagradOptimizer(0.1)))
    assert a.variable("w").updates[0].op_types == ("ResourceApplyAdagrad",)
    assert a.variable("emb").updates[0].op_types == ("ResourceSparseApplyAdagrad",)
    sgd = analyse(graph_with(lambda: tf1.train.GradientDescentOptimizer(0.1)))
    assert sgd.variable("emb").updates[0].op_types == ("ResourceScatterAdd",)
    ref = analyse(graph_with(lambda: tf1.train.GradientDescentOptimizer(0.1), use_resource=False))
    assert ref.variable("emb").updates[0].op_types == ("ScatterSub",)
    assert ref.variable("w").updates[0].op_types == ("ApplyGradientDescent",)


def test_clipping_is_post_processing_before_the_update():
    a = analyse(graph_with(clip=True))
    w = a.variable("w").updates[0].gradient
    assert w.post_processed and w.values.startswith("gradients/")
    assert not analyse(graph_with()).variable("w").updates[0].gradient.post_processed


@pytest.mark.parametrize("model, nonlinear", [
    ({}, None), ({"scale_sparse": True}, None), ({"clip_values": 0.1}, "Minimum")])
def test_post_processing_not_linear_in_the_rows_is_named(model, nonlinear):
    """A scaling is linear in the rows (a duplicate id's rows may be summed first); a
    clip_by_value (a Minimum, then a Maximum) is not, and the analysis names its op."""
    from tests.support import models
    graph, _ = models.build(optimizer="adagrad", sparse=True, **model)
    found = analyse(graph).variable("emb").updates[0].gradient.nonlinear
    assert (found and graph.get_operation_by_name(found).type) == nonlinear


def test_partitioned_variable_pieces():
    a = analyse(graph_with(partitioner=tf1.fixed_size_partitioner(3)))
    parts = [v for v in a.trained if v.partition is not None]
    assert [p.name for p in parts] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    assert [p.shape for p in parts] == [(4, 3), (3, 3), (3, 3)]
    assert [p.partition.offset for p in parts] == [(0, 0), (4, 0), (7, 0)]
    assert all(p.partition.full_name == "emb" and p.partition.full_shape == (10, 3)
               and p.kind == "sparse" for p in parts)
    grads = {p.updates[0].gradient.values for p in parts}
    assert len(grads) == 3  # one IndexedSlices per piece


def test_two_optimizers():
    a = analyse(graph_with(two_optimizers=True))
    assert a.variable("w").updates[0].op_types == ("ResourceApplyAdam",)
    assert a.variable("emb").updates[0].gradient.values.startswith("gradients_1/")
    assert a.variable("shared").updates[0].op_types == ("ResourceApplyGradientDescent",)
    assert set(a.train_ops) == {"Adam", "GradientDescent"}


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_reads_besides_row_lookups_are_recorded(use_resource):
    """Route "sharded" can split a variable read by row lookups and moving averages (row
    by row) only: a moving average's shadow is recorded as one, a whole read after the
    step (a sum written into another variable) as another read; the lookups, the
    initialisers (the shadow's from the variable's value) and a Saver are neither."""
    plain = analyse(graph_with(use_resource=use_resource))
    assert plain.variable("emb").other_reads == () and plain.variable("emb").averages == ()
    with_ema = analyse(graph_with(use_resource=use_resource, ema=True))
    assert with_ema.variable("emb").other_reads == ()
    assert with_ema.variable("emb").averages == ("emb/ExponentialMovingAverage",)
    assert with_ema.variable("w").averages == ()  # dense: not recorded
    summed = analyse(graph_with(use_resource=use_resource, ema=True, total=True))
    assert summed.variable("emb").averages == ("emb/ExponentialMovingAverage",)
    reads = summed.variable("emb").other_reads
    assert len(reads) == 1 and reads[0].startswith("Assign"), reads


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_sparse_segment_sums_of_a_variable_are_row_lookups(use_resource):
    """embedding_lookup_sparse without weights sums rows of the whole variable by segment
    (SparseSegmentSum of its read, with a sparse gradient): a read of rows, as a gather
    is."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.sparse_placeholder(tf.int64, [4, 3], name="ids")
        emb = tf1.get_variable("emb", [10, 2], use_resource=use_resource)
        h = tf.nn.embedding_lookup_sparse(emb, ids, None, combiner="sum")
        tf1.train.AdagradOptimizer(0.1).minimize(tf.reduce_sum(h * h))
    types = {op.type for op in g.get_operations()}
    assert "SparseSegmentSum" in types
    emb = analyse(g).variable("emb")
    assert emb.kind == "sparse" and emb.other_reads == ()


def test_meta_graph_input_gives_the_same_analysis():
    g = graph_with()
    assert analyse(tf1.train.export_meta_graph(graph=g)) == analyse(g)


def test_no_update_ops_is_an_error():
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3])
        tf.reduce_sum(w)
    with pytest.raises(tfpar.TfparError, match="no optimizer update ops"):
        analyse(g)


def test_gradients_accumulated_over_runs_are_the_updates_gradient():
    """compute_gradients added into accumulators over several runs, then apply_gradients
    of their values (scaled): the accumulator's read is the raw gradient tfpar allreduces
    (or pushes), the scaling its post-processing; a variable that no gradient fills is
    not an accumulator, and applying from it is refused naming it."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3])
        w = tf1.get_variable("w", [3, 1])
        opt = tf1.train.GradientDescentOptimizer(0.1)
        (grad, _), = opt.compute_gradients(tf.reduce_mean(tf.matmul(x, w)), [w])
        accum = tf1.Variable(tf.zeros([3, 1]), trainable=False, name="accum")
        accum.assign_add(grad)
        opt.apply_gradients([(accum / 4.0, w)])
    info = analyse(g).variable("w")
    gradient = info.updates[0].gradient
    assert gradient.kind == "dense" and gradient.post_processed
    assert g.get_tensor_by_name(gradient.values).op.inputs[0].op.name == "accum"
    assert analyse(g).variable("accum").role == "optimizer_state"

    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3, 1])
        fake = tf1.Variable(tf.ones([3, 1]), trainable=False, name="fake")
        tf1.train.GradientDescentOptimizer(0.1).apply_gradients([(fake.read_value(), w)])
    with pytest.raises(tfpar.NotYetSupportedError, match="updates 'w' from the value of 'fake'"):
        analyse(g)


def test_gradients_fed_through_placeholders_are_the_updates_gradient():
    """Gradients fetched in one run and fed to apply_gradients in another: the fed
    placeholders are the raw gradients (an embedding's as the values and indices of
    IndexedSlices, a dense one as an array, clipped after the feed), while a fed learning
    rate is not, nor a placeholder a user's own assign writes into a variable."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int64, [None])
        emb = tf1.get_variable("emb", [10, 3])
        w = tf1.get_variable("w", [3, 1])
        loss = tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, ids), w))
        lr = tf1.placeholder(tf.float32, [], name="lr")
        opt = tf1.train.AdamOptimizer(lr)
        opt.compute_gradients(loss, [emb, w])
        rows = tf1.placeholder(tf.float32, [None, 3], name="rows")
        row_ids = tf1.placeholder(tf.int64, [None], name="row_ids")
        dense = tf1.placeholder(tf.float32, [3, 1], name="dense")
        fed = [tf.IndexedSlices(rows, row_ids, tf.constant([10, 3])), dense]
        clipped, _ = tf.clip_by_global_norm(fed, 1.0)
        opt.apply_gradients(zip(clipped, [emb, w]))
        emb.assign(tf1.placeholder(tf.float32, [10, 3], name="pretrained"))
    analysis = analyse(g)
    sparse = analysis.variable("emb").updates[0].gradient
    assert (sparse.kind, sparse.values, sparse.indices) == ("sparse", "rows:0", "row_ids:0")
    assert sparse.post_processed and sparse.row_sums  # the clipping's norm over the rows
    dense_gradient = analysis.variable("w").updates[0].gradient
    assert (dense_gradient.kind, dense_gradient.values) == ("dense", "dense:0")
    assert len(analysis.variable("emb").updates) == 1  # the pretrained assign is none


def test_unknown_update_op_is_named():
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [3, 2])
        loss = tf.reduce_sum(tf.square(w))
        (grad,) = tf.gradients(loss, [w])
        tf.raw_ops.ResourceStridedSliceAssign(ref=w.handle, begin=[0], end=[1], strides=[1],
                                              value=grad[0:1], name="my_update")
    with pytest.raises(tfpar.TfparError, match="my_update.*ResourceStridedSliceAssign"):
        analyse(g)


def test_table_lists_every_variable():
    a = analyse(graph_with())
    table = a.table()
    for v in a.variables:
        assert v.name in table


def test_rows_made_dense_by_their_ids_are_exact_post_processing():
    """An optimizer that densifies a sparse gradient (tf.convert_to_tensor of the
    IndexedSlices: an UnsortedSegmentSum by its ids, as BERT's AdamWeightDecayOptimizer's
    arithmetic does) post-processes the rows linearly: nothing inexact, no row sum; a
    global-norm clip before it still sums the rows; a segment sum by other ids is inexact."""
    def graph(clip=False, other_ids=False):
        g = tf.Graph()
        with g.as_default():
            emb = tf.compat.v1.get_variable("emb", [10, 3], use_resource=True)
            loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2, 2]))
            grad, = tf.gradients(loss, [emb])
            if clip:
                (grad,), _ = tf.clip_by_global_norm([grad], 1.0)
            dense = (tf.math.unsorted_segment_sum(grad.values, grad.indices[::-1], 10)
                     if other_ids else tf.convert_to_tensor(grad))
            emb.assign_sub(0.1 * dense)
        return analyse(g).variable("emb").updates[0].gradient

    g = graph()
    assert g.kind == "sparse" and g.inexact is None and g.row_sums == ()
    assert graph(clip=True).row_sums == ("global_norm/L2Loss:0",)
    assert "UnsortedSegmentSum" in graph(other_ids=True).inexact


@pytest.mark.parametrize("control_flow_v2", [True, False])
def test_an_update_in_a_cond_is_found_and_marked_conditional(control_flow_v2):
    """An optimizer applied inside tf.cond (a loss scale's "only where finite"), as TF2's
    If (the update in a branch function) or TF1's Switch and Merge: each variable's update,
    its raw gradient (not the cond's predicate, which reads every gradient) and slots are
    found, marked conditional; the plan keeps them off the servers (PS mode refused, the
    embedding on a replicated route in HYBRID with a note)."""
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources
    (tf.compat.v1.enable_control_flow_v2 if control_flow_v2
     else tf.compat.v1.disable_control_flow_v2)()
    try:
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 3])
            emb = tf.compat.v1.get_variable("emb", [10, 3], use_resource=True)
            w = tf.compat.v1.get_variable("w", [3, 3], use_resource=True)
            u = tf.compat.v1.get_variable("u", [3, 3], use_resource=True)
            h = tf.matmul(tf.matmul(x + tf.nn.embedding_lookup(emb, [1, 2, 2]), w), u)
            loss = tf.reduce_sum(h)
            opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
                tf.compat.v1.train.AdamOptimizer(0.1), loss_scale="dynamic")
            opt.minimize(loss)
        a = analyse(g)
    finally:
        tf.compat.v1.enable_control_flow_v2()
    ops = {op.name: op for op in g.get_operations()}
    for name, kind in (("emb", "sparse"), ("w", "dense"), ("u", "dense")):
        v = a.variable(name)
        assert v.role == "trained" and v.kind == kind and len(v.updates) == 1, name
        update = v.updates[0]
        assert update.conditional and set(update.slots) == {f"{name}/Adam", f"{name}/Adam_1"}
        assert ops[update.gradient.values.split(":")[0]].name.startswith("gradients/"), name
    assert a.variable("w").updates[0].gradient.values != a.variable("u").updates[0].gradient.values
    assert a.variable("current_loss_scale").role == "optimizer_state"
    layout = parse_resources("localhost:2")
    plan = make_plan(a, tfpar.Config(), layout)
    assert plan.variable("emb").route in ("allgather", "allreduce")
    assert any("is made in a tf.cond branch" in n for n in plan.notes)
    with pytest.raises(tfpar.TfparError, match="cannot put 'emb' on the parameter servers: "
                                               "its update .* is made in a tf.cond branch"):
        make_plan(a, tfpar.Config(run_mode="PS"), layout)


def test_syncreplicas_optimizer_is_refused_with_what_to_change():
    """TF's SyncReplicasOptimizer (a TF parameter-server script's) is named with the fix,
    not reported as an update tfpar cannot distribute."""
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.get_variable("w", [2], use_resource=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.AdamOptimizer(0.1), replicas_to_aggregate=2,
            total_num_replicas=2)
        opt.minimize(tf.reduce_sum(w * w), global_step=step)
    with pytest.raises(tfpar.TfparError, match=r"SyncReplicasOptimizer \(its token queue "
                                               r"'sync_token_q'\).*Train with the optimizer"):
        analyse(g)


def test_in_graph_towers_are_refused_with_one_process_a_gpu_as_the_fix():
    """TF's multi-GPU tutorial builds the model once per GPU and averages the towers'
    gradients (average_gradients): two raw gradients per update, which horovodrun's one
    process a GPU replaces; the error says so."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        towers = [opt.compute_gradients(tf.reduce_sum(tf.matmul(part, w)), [w])
                  for part in (x[:2], x[2:])]
        grads = [tf.expand_dims(gv[0][0], 0) for gv in towers]
        opt.apply_gradients([(tf.reduce_mean(tf.concat(grads, 0), 0), w)])
    with pytest.raises(tfpar.TfparError, match="several tensors.*In-graph towers.*horovodrun "
                                               r"-np <GPUs>"):
        analyse(g)


@pytest.mark.parametrize("optimizer", [lambda: tf1.train.AdamOptimizer(0.1),
                                       lambda: tf1.train.FtrlOptimizer(0.1),
                                       lambda: tf1.train.MomentumOptimizer(0.1, 0.9)])
def test_update_groups_are_the_runs_that_update_variables_together(optimizer):
    """One minimize() is one group, whatever its optimizer leaves dangling after its
    updates (Adam's reads of the values it assigned); two minimize() results run by turns
    (a GAN) are two; grouped by one tf.group that the script runs, one again; a read
    after the step (control dependency on the train op) does not split it. Groups are of
    updates: a fine-tuning script's head-only and whole-model minimize() put the head's
    two updates in two groups."""
    def groups(kind):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [4, 3])
            ids = tf1.placeholder(tf.int32, [4])
            emb = tf1.get_variable("emb", [10, 3], use_resource=True)
            w = tf1.get_variable("w", [3, 1], use_resource=True)
            d = tf1.get_variable("d", [1, 1], use_resource=True)
            fake = tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w)
            loss = tf.reduce_mean(tf.matmul(fake, d))
            if kind == "one":
                train = optimizer().minimize(loss)
                with tf.control_dependencies([train]):
                    tf.identity(loss)
            elif kind == "phases":  # fine-tuning: the head alone, then everything
                optimizer().minimize(loss, var_list=[d])
                optimizer().minimize(loss)
            else:
                g_train = optimizer().minimize(loss, var_list=[emb, w])
                d_train = optimizer().minimize(-loss, var_list=[d])
                if kind == "grouped":
                    tf.group(g_train, d_train)
        analysis = analyse(g)
        if kind == "phases":  # d's two updates are in the two groups
            assert len({u.group for u in analysis.variable("d").updates}) == 2
        return {frozenset(group) for group in analysis.update_groups}

    assert groups("one") == {frozenset({"emb", "w", "d"})}
    assert groups("turns") == {frozenset({"emb", "w"}), frozenset({"d"})}
    assert groups("grouped") == {frozenset({"emb", "w", "d"})}
    assert groups("phases") == {frozenset({"d"}), frozenset({"emb", "w", "d"})}
