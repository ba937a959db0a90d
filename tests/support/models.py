"""Small single-device training graphs shared by the tests and their reference runs."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

IN, HIDDEN, OUT = 6, 8, 3
VOCAB, EMB = 20, 4
PS_VOCAB, SHARED_VOCAB = 23, 11  # rows that 2 and 3 parts split unevenly
OPTIMIZERS = {
    "sgd": lambda s: tf1.train.GradientDescentOptimizer(0.1 * s),
    "momentum": lambda s: tf1.train.MomentumOptimizer(0.05 * s, 0.9),
    "adam": lambda s: tf1.train.AdamOptimizer(0.01 * s),
    "adagrad": lambda s: tf1.train.AdagradOptimizer(0.1 * s),
    "ftrl": lambda s: tf1.train.FtrlOptimizer(0.1 * s, l1_regularization_strength=0.001,
                                              l2_regularization_strength=0.001),
    "rmsprop": lambda s: tf1.train.RMSPropOptimizer(0.01 * s, momentum=0.9, centered=True),
    "adadelta": lambda s: tf1.train.AdadeltaOptimizer(1.0 * s),
    "proximal_adagrad": lambda s: tf1.train.ProximalAdagradOptimizer(
        0.1 * s, l1_regularization_strength=0.001, l2_regularization_strength=0.001),
    "proximal_sgd": lambda s: tf1.train.ProximalGradientDescentOptimizer(
        0.1 * s, l1_regularization_strength=0.001, l2_regularization_strength=0.001),
    "adagrad_da": lambda s: tf1.train.AdagradDAOptimizer(
        0.1 * s, tf1.train.get_or_create_global_step(), l1_regularization_strength=0.001,
        l2_regularization_strength=0.001),
}


def mlp_with_embedding(vocab: int) -> dict:
    """In the default graph: placeholders x [batch, 3], ids [batch] (int64), y [batch, 1],
    an embedding `emb` [vocab, 3] added to x, a relu layer `w1` and a linear one `w2`,
    the mean squared error `loss` (the real-script workers' model)."""
    tf1.set_random_seed(3)
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    ids = tf1.placeholder(tf.int64, [None], name="ids")
    y = tf1.placeholder(tf.float32, [None, 1], name="y")
    emb = tf1.get_variable("emb", [vocab, 3])
    w1 = tf1.get_variable("w1", [3, 4])
    w2 = tf1.get_variable("w2", [4, 1])
    h = tf.nn.relu(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w1))
    loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y))
    return dict(x=x, ids=ids, y=y, emb=emb, w1=w1, w2=w2, loss=loss)


def _batch_norm(hidden, kind, training=True):
    """`hidden` through a batch norm in training mode (see build's batch_norm)."""
    if kind in ("cond", "moments_cond", "cond_tf2"):
        v2 = tf1.control_flow_v2_enabled()
        if kind == "cond_tf2":
            tf1.enable_control_flow_v2()
        else:
            tf1.disable_control_flow_v2()
        try:
            training = tf1.placeholder_with_default(True, [], name="training")
            return _batch_norm(hidden, "moments" if kind == "moments_cond" else True,
                               training)
        finally:
            (tf1.enable_control_flow_v2 if v2 else tf1.disable_control_flow_v2)()
    if kind == "moments":
        return tf1.layers.batch_normalization(hidden, training=training, momentum=0.9,
                                              name="bn")
    grid = tf.reshape(hidden, [-1, 2, 1, HIDDEN // 2])
    grid = tf1.layers.batch_normalization(grid, training=training, fused=True, momentum=0.9,
                                          name="bn")
    return tf.reshape(grid, [-1, HIDDEN])


def build(optimizer="sgd", reduce="mean", clip=None, sparse=False, use_resource=True,
          init_seed=None, batch=None, emb_partitions=None, shared_embedding=False,
          scale_sparse=False, clip_by_norm=None, second_update=False, ema=False,
          decoder=False, batch_norm=False, clip_values=None, partition_strategy="div"):
    """An MLP (optionally with an embedding input) and its training step.

    emb_partitions: make the embedding (PS_VOCAB rows) a partitioned variable of that many
    pieces (the user's own partitioner). shared_embedding: add a second embedding
    (SHARED_VOCAB rows) read by two lookups of the same ids.
    Returns (graph, handles) where handles has x, y, ids (or None), loss, train_op.
    `init_seed` seeds the random initialisers (different seeds per worker show the broadcast).
    A summed loss gets a 16x smaller learning rate, so it trains instead of diverging.
    Post-processing as real scripts do it: clip: tf.clip_by_global_norm over all gradients
    (handles["norm"] is the raw global norm); scale_sparse: every IndexedSlices gradient's
    values times a tensor computed in the graph (from the global step); clip_by_norm:
    tf.clip_by_norm of every sparse gradient; clip_values: tf.clip_by_value of every sparse
    gradient's values to [-clip_values, clip_values] (row by row: a duplicate id's rows
    are clipped one by one, before the update sums them). second_update: a second optimizer also
    trains `shared` (two updates of one variable); "late_read": its reads of `shared` and
    `w2` come 0.5 s late on workers other than the chief. ema: an ExponentialMovingAverage
    of every trained variable, applied after the training step. decoder: a seq2seq-style
    decoder loop (`tf.while_loop`) whose body reads an attention weight and a decoder
    kernel. batch_norm: the hidden activation, as a [batch, 2, 1, HIDDEN/2] grid, through
    tf.compat.v1.layers.batch_normalization in training mode (fused; its moving averages
    updated by UPDATE_OPS before the step, as TF1 scripts do); "moments": the hidden
    activation [batch, HIDDEN] itself (non-fused: tf.nn.moments over the batch); "cond",
    "moments_cond": the same with training=<a bool tensor that defaults to True>, built
    with TF1's control flow (as under disable_v2_behavior: Switch and Merge ops);
    "cond_tf2": the fused one so, with TF2's control flow (an If op and its functions).
    """
    g = tf.Graph()
    with g.as_default():
        if init_seed is not None:
            tf1.set_random_seed(init_seed)
        x = tf1.placeholder(tf.float32, [batch, IN], name="x")
        y = tf1.placeholder(tf.float32, [batch, OUT], name="y")
        h = x
        ids = None
        if sparse or emb_partitions:
            ids = tf1.placeholder(tf.int32, [batch], name="ids")
            partitioner = (tf1.fixed_size_partitioner(emb_partitions) if emb_partitions
                           else None)
            emb = tf1.get_variable("emb", [PS_VOCAB if emb_partitions else VOCAB, IN],
                                   use_resource=use_resource, partitioner=partitioner,
                                   initializer=tf1.random_normal_initializer(stddev=0.5))
            h = h + tf1.nn.embedding_lookup(emb, ids, partition_strategy=partition_strategy)
        if shared_embedding:
            shared = tf1.get_variable("shared", [SHARED_VOCAB, IN], use_resource=use_resource,
                                      initializer=tf1.random_normal_initializer(stddev=0.5))
            h = (h + tf.nn.embedding_lookup(shared, ids % SHARED_VOCAB)
                 - 0.5 * tf.nn.embedding_lookup(shared, (ids * 3 + 1) % SHARED_VOCAB))
        if decoder:
            attention_g = tf1.get_variable("attention_g", [IN, IN], use_resource=use_resource)
            kernel = tf1.get_variable("decoder/kernel", [IN, IN], use_resource=use_resource)
            memory = h

            def step_fn(t, state, total):
                scores = tf.nn.softmax(tf.matmul(state, attention_g) * memory, axis=1)
                state = tf.tanh(tf.matmul(state + scores * memory, kernel))
                return t + 1, state, total + state

            _, _, h = tf.while_loop(lambda t, *_: t < 3, step_fn, [0, h, tf.zeros_like(h)])
        w1 = tf1.get_variable("w1", [IN, HIDDEN], use_resource=use_resource)
        b1 = tf1.get_variable("b1", [HIDDEN], use_resource=use_resource,
                              initializer=tf1.random_normal_initializer(stddev=0.1))
        w2 = tf1.get_variable("w2", [HIDDEN, OUT], use_resource=use_resource)
        hidden = tf.tanh(tf.matmul(h, w1) + b1)
        if batch_norm:
            hidden = _batch_norm(hidden, batch_norm)
        out = tf.matmul(hidden, w2)
        per_example = tf.reduce_sum(tf.square(out - y), axis=1)
        loss = tf.identity(tf.reduce_mean(per_example) if reduce == "mean"
                           else tf.reduce_sum(per_example), name="loss")
        opt = OPTIMIZERS[optimizer](1.0 if reduce == "mean" else 1.0 / 16)
        step = tf1.train.get_or_create_global_step()
        grads_and_vars = opt.compute_gradients(loss)
        norm = None
        if scale_sparse:
            factor = 1.5 + 0.25 * tf.cast(step, tf.float32)
            grads_and_vars = [(tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
                               if isinstance(g, tf.IndexedSlices) else g, v)
                              for g, v in grads_and_vars]
        if clip_values is not None:
            grads_and_vars = [(tf.IndexedSlices(tf.clip_by_value(g.values, -clip_values,
                                                                 clip_values),
                                                g.indices, g.dense_shape)
                               if isinstance(g, tf.IndexedSlices) else g, v)
                              for g, v in grads_and_vars]
        if clip_by_norm is not None:
            grads_and_vars = [(tf.clip_by_norm(g, clip_by_norm)
                               if isinstance(g, tf.IndexedSlices) else g, v)
                              for g, v in grads_and_vars]
        if clip is not None:
            grads, variables = zip(*grads_and_vars)
            grads, norm = tf.clip_by_global_norm(grads, clip)
            grads_and_vars = list(zip(grads, variables))
        if second_update:
            # Both updates run after every read of the step (as in a script that computes
            # all gradients first), so the single-device result does not depend on a race.
            aux_ids = (ids + 2) % SHARED_VOCAB
            factor = 1.0
            if second_update == "late_read":  # reads of `shared` and `w2` after a delay
                aux_ids = _late_on_other_workers(aux_ids)
                with tf.control_dependencies([aux_ids]):
                    factor = 1.0 + 0.1 * tf.reduce_mean(tf.identity(w2))
            aux = tf.reduce_mean(tf.square(tf.nn.embedding_lookup(shared, aux_ids) * factor))
            opt2 = tf1.train.AdagradOptimizer(0.05)
            aux_grads = opt2.compute_gradients(aux, var_list=[shared])
            reads = [getattr(g, "values", g) for g, _ in grads_and_vars + aux_grads] + [loss]
            with tf.control_dependencies(reads):
                first = opt.apply_gradients(grads_and_vars, global_step=step)
            with tf.control_dependencies([first]):  # two unlocked updates of one variable
                train_op = opt2.apply_gradients(aux_grads)  # would race on one device too
        else:
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                train_op = opt.apply_gradients(grads_and_vars, global_step=step)
        if ema:
            averages = tf1.train.ExponentialMovingAverage(0.9)
            with tf.control_dependencies([train_op]):
                train_op = averages.apply(tf1.trainable_variables())
    return g, dict(x=x, y=y, ids=ids, loss=loss, train_op=train_op, norm=norm)


def _late_on_other_workers(t: tf.Tensor, seconds: float = 0.5) -> tf.Tensor:
    """`t`, available `seconds` late on every worker but the chief: what reads it reads
    late. (A user's script can be that slow anywhere; this makes the order certain.)"""
    import os
    import time

    def late(value):
        if int(os.environ.get("HOROVOD_RANK", "0")) != 0:
            time.sleep(seconds)
        return value

    out = tf1.py_func(late, [t], t.dtype, stateful=True)
    out.set_shape(t.shape)
    return out


def worker_session_config():
    """The session config of the test workers: few threads, as the suite shares 2 cores."""
    return tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def worker_scenarios(path):
    """Per scenario of a worker's JSON file: (scenario, graph, handles, session config).
    Each worker builds its graph with its own initial values: the runner must broadcast
    worker 0's."""
    import json
    import os
    with open(path) as f:
        scenarios = json.load(f)
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    for sc in scenarios:
        graph, h = build(init_seed=100 + rank, **sc["model"])
        yield sc, graph, h, worker_session_config()


def batches(steps, global_batch, seed=0, vocab=None):
    """Deterministic data: per step (x, y, ids) for the whole (concatenated) batch.

    Without `vocab`, ids are few (half of VOCAB): duplicates within and across workers.
    With it, ids cover the whole vocabulary, and every fifth is id 3 (duplicated within
    and across workers).
    """
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        x = rng.randn(global_batch, IN).astype(np.float32)
        y = rng.randn(global_batch, OUT).astype(np.float32)
        if vocab:
            ids = rng.randint(0, vocab, size=global_batch).astype(np.int32)
            ids[::5] = 3
        else:
            ids = rng.randint(0, VOCAB // 2, size=global_batch).astype(np.int32)
        out.append((x, y, ids))
    return out


def eval_batch(global_batch, vocab=None):
    """One batch (x, y, ids) that no training step reads, for evaluation after training."""
    return batches(1, global_batch, seed=5, vocab=vocab)[0]


def feed(handles, x, y, ids):
    fd = {handles["x"]: x, handles["y"]: y}
    if handles["ids"] is not None:
        fd[handles["ids"]] = ids
    return fd


def initialise(sess, graph) -> None:
    """Initialises every global variable of `graph` in a plain session, the trained ones
    first: a TF1 moving average's shadow of a reference variable is initialised from the
    variable once that is initialised, and in the same run that read races the variable's
    own initialiser (rarely: 'Attempting to use uninitialized value')."""
    trained = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    first = {id(v) for v in trained}
    sess.run(tf.compat.v1.variables_initializer(trained))
    sess.run(tf.compat.v1.variables_initializer([
        v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        if id(v) not in first]))


def variable_values(sess, graph):
    """{variable op name: value} for every global variable (slots and step included)."""
    variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


def build_from_input(global_ids, global_y, workers=1, rank=0, optimizer="adagrad",
                     clip=None):
    """An embedding model whose batch comes from tf.data (a one-shot iterator), as a
    training script's does: step t's batch is rows [rank b, (rank + 1) b) of global batch
    t (b = the global batch / workers), so the workers' batches side by side are the
    single-device one (workers=1). global_ids: [steps, B, K] ids (K lookups an example);
    global_y: [steps, B]. Two tables are looked up with the same ids (an embedding and a
    bias per id, as a sampled softmax's weights and biases). Returns (graph, loss,
    train_op); the input ends after the last batch."""
    b = global_ids.shape[1] // workers
    ids = global_ids[:, rank * b:(rank + 1) * b]
    y = global_y[:, rank * b:(rank + 1) * b].astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        batch_ids, batch_y = tf1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((ids, y))).get_next()
        init = tf1.random_uniform_initializer(-0.5, 0.5, seed=3)
        emb = tf1.get_variable("emb", [PS_VOCAB, EMB], initializer=init)
        bias = tf1.get_variable("bias", [PS_VOCAB], initializer=init)
        w = tf1.get_variable("w", [EMB, 1], initializer=init)
        rows = tf.reduce_sum(tf.nn.embedding_lookup(emb, batch_ids), 1)
        pred = tf.squeeze(tf.matmul(rows, w), 1) + tf.reduce_sum(
            tf.gather(bias, batch_ids), 1)
        loss = tf.reduce_mean(tf.square(pred - batch_y))
        opt = OPTIMIZERS[optimizer](1.0)
        grads = opt.compute_gradients(loss)
        if clip:
            clipped, _ = tf.clip_by_global_norm([g for g, _ in grads], clip)
            grads = list(zip(clipped, [v for _, v in grads]))
        train_op = opt.apply_gradients(grads, global_step=tf1.train.get_or_create_global_step())
    return graph, loss, train_op


def input_batches(steps, global_batch, lookups=3, seed=0):
    """(ids [steps, global_batch, lookups] with duplicates within and across examples, y)."""
    rng = np.random.RandomState(seed)
    ids = rng.zipf(1.5, size=(steps, global_batch, lookups)) % PS_VOCAB
    return ids.astype(np.int64), rng.randn(steps, global_batch)
