"""Training graphs written as the field's own scripts write them (issue 24's corpus).

Each builder returns (graph, Script): the single-device graph, its placeholders (batch on
axis 0, so one graph serves N workers and the single device), what a step fetches, the
data of each step and the `tfpar.Config` options the script's loss needs (a summed loss
sums gradients instead of averaging them). Sizes are tiny: the tests run them for real.

- `lm1b`: Parallax's LM1B example: a partitioned embedding, an LSTM with projection under
  `dynamic_rnn`, a sampled softmax over a partitioned weight and bias, `tf.gradients` of
  the loss scaled by the steps, the embedding's IndexedSlices scaled by the batch size,
  `clip_by_global_norm` over the LSTM's gradients only, Adagrad with an initial
  accumulator, an ExponentialMovingAverage of the LSTM's weights after the update.
- `skip_thoughts`: Parallax's skip-thoughts example: a GRU encoder and two GRU decoders
  (8 layers each: ~100 variables) over one shared word embedding, a shared logits layer,
  summed losses through `tf.compat.v1.losses`, `clip_by_norm` of every gradient, Adam.
- `nmt`: the TF NMT tutorial (Parallax's NMT example): encoder and decoder
  `embedding_lookup`s, an LSTM encoder, a decoder whose cell runs Luong attention (its
  weights read inside the decoder's while loop), a projection without bias, the loss
  summed over tokens and divided by the batch, `tf.gradients(...,
  colocate_gradients_with_ops=True)`, `clip_by_global_norm`, SGD.
- `ptb`: the TF1 PTB tutorial: a learning-rate variable set through
  `tf.compat.v1.assign(lr, new_lr)` between epochs, the LSTM's state carried from step to
  step through feeds, a sequence loss, `clip_by_global_norm`, SGD with the lr variable.
- `wide_deep`: a canned-estimator recommender: feature columns (hashed strings, identity
  ids, a crossed column, numeric, a multi-valued "tags" feature of 0-3 ids per example
  padded with -1, duplicates within an example included, summed in the linear part and
  weighted (`weighted_categorical_column`, combiner "sqrtn") in the DNN's embedding), a
  linear part trained by FTRL and a DNN by Adagrad,
  `train_op = tf.group(...)` then `assign_add(global_step, 1)` under its control, fetched.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

import tfpar  # noqa: F401  (selects Keras 2 for tf.compat.v1 layers and cells)

tf1 = tf.compat.v1


@dataclasses.dataclass
class Script:
    feeds: List[str]  # placeholder names, batch on axis 0
    train: object  # what one training step fetches (as the script fetches it)
    data: Callable[[int, int], List[Dict[str, np.ndarray]]]  # (steps, global batch)
    config: dict = dataclasses.field(default_factory=dict)  # tfpar.Config options it needs
    state: Dict[str, str] = dataclasses.field(default_factory=dict)  # fed from: final state
    lr: Optional[tuple] = None  # (lr variable, new_lr placeholder, lr_update): PTB's decay


def _ids(rng, shape, high):
    # Few distinct ids, so rows repeat within and across workers.
    return rng.randint(0, high, size=shape).astype(np.int32)


def lm1b(vocab=40, emb=6, state=8, steps=4, sampled=8, partitions=2):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.int32, [None, steps], name="x")
        y = tf1.placeholder(tf.int32, [None, steps], name="y")
        w = tf1.placeholder(tf.int32, [None, steps], name="w")
        init = tf1.random_uniform_initializer(-0.1, 0.1)
        part = tf1.fixed_size_partitioner(partitions)
        global_step = tf1.train.get_or_create_global_step()
        emb_v = tf1.get_variable("emb", [vocab, emb], initializer=init, partitioner=part)
        softmax_w = tf1.get_variable("softmax_w", [vocab, emb], initializer=init,
                                     partitioner=part)
        softmax_b = tf1.get_variable("softmax_b", [vocab], initializer=init, partitioner=part)
        inputs = tf1.nn.embedding_lookup(emb_v, x)
        cell = tf1.nn.rnn_cell.LSTMCell(state, num_proj=emb, initializer=init)
        outputs, _ = tf1.nn.dynamic_rnn(cell, inputs, dtype=tf.float32, scope="lstm")
        outputs = tf.reshape(outputs, [-1, emb])
        loss = tf1.nn.sampled_softmax_loss(
            softmax_w, softmax_b, tf.reshape(tf.cast(y, tf.int64), [-1, 1]), outputs,
            sampled, vocab, partition_strategy="div", seed=7)
        loss = tf.reduce_mean(loss * tf.reshape(tf.cast(w, tf.float32), [-1]))
        scaled_loss = loss * steps
        emb_vars = list(emb_v)
        lstm_vars = [v for v in tf1.trainable_variables() if v.op.name.startswith("lstm/")]
        softmax_vars = list(softmax_w) + list(softmax_b)
        all_vars = emb_vars + lstm_vars + softmax_vars
        grads = tf.gradients(scaled_loss, all_vars)
        emb_grads = [tf.IndexedSlices(g.values * 4.0, g.indices, g.dense_shape)
                     for g in grads[:len(emb_vars)]]
        lstm_grads = grads[len(emb_vars):len(emb_vars) + len(lstm_vars)]
        lstm_grads, _ = tf.clip_by_global_norm(lstm_grads, 10.0)
        softmax_grads = grads[len(emb_vars) + len(lstm_vars):]
        optimizer = tf1.train.AdagradOptimizer(0.2, initial_accumulator_value=1.0)
        train_op = optimizer.apply_gradients(
            list(zip(emb_grads + lstm_grads + softmax_grads, all_vars)), global_step=global_step)
        ema = tf1.train.ExponentialMovingAverage(decay=0.9)
        with tf.control_dependencies([train_op]):
            train_op = ema.apply(lstm_vars)

    def data(n_steps, batch):
        rng = np.random.RandomState(0)
        return [{"x:0": _ids(rng, (batch, steps), 12), "y:0": _ids(rng, (batch, steps), vocab),
                 "w:0": (rng.rand(batch, steps) > 0.2).astype(np.int32)}
                for _ in range(n_steps)]
    return graph, Script(["x:0", "y:0", "w:0"], train_op, data)


def skip_thoughts(vocab=30, emb=5, hidden=4, layers=8, length=3):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(2)
        names = ("encode", "decode_pre", "decode_post")
        ids = {k: tf1.placeholder(tf.int64, [None, length], name=f"{k}_ids") for k in names}
        masks = {k: tf1.placeholder(tf.int32, [None, length], name=f"{k}_mask") for k in names}
        init = tf1.random_uniform_initializer(-0.1, 0.1)
        word_emb = tf1.get_variable("word_embedding", [vocab, emb], initializer=init)
        embedded = {k: tf.nn.embedding_lookup(word_emb, ids[k]) for k in names}

        def gru_stack():
            return tf1.nn.rnn_cell.MultiRNNCell(
                [tf1.nn.rnn_cell.GRUCell(hidden, kernel_initializer=init)
                 for _ in range(layers)])
        with tf1.variable_scope("encoder"):
            length_e = tf.reduce_sum(masks["encode"], 1)
            _, states = tf1.nn.dynamic_rnn(gru_stack(), embedded["encode"],
                                           sequence_length=length_e, dtype=tf.float32)
            thought = states[-1]
        for k in ("decode_pre", "decode_post"):
            with tf1.variable_scope(k):
                # Teacher forcing: the decoder reads the sentence shifted right by one.
                shifted = tf.pad(embedded[k][:, :-1, :], [[0, 0], [1, 0], [0, 0]])
                outputs, _ = tf1.nn.dynamic_rnn(
                    gru_stack(), shifted, sequence_length=tf.reduce_sum(masks[k], 1),
                    initial_state=tuple([thought] * layers))
            logits = tf1.layers.dense(tf.reshape(outputs, [-1, hidden]), vocab, name="logits",
                                      reuse=tf1.AUTO_REUSE, kernel_initializer=init)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.reshape(ids[k], [-1]), logits=logits)
            weights = tf.cast(tf.reshape(masks[k], [-1]), tf.float32)
            tf1.losses.add_loss(tf.reduce_sum(losses * weights))  # average_*=False
        total_loss = tf1.losses.get_total_loss()
        global_step = tf1.train.get_or_create_global_step()
        optimizer = tf1.train.AdamOptimizer(0.01)
        grads = [(tf.clip_by_norm(g, 5.0), v) for g, v in optimizer.compute_gradients(total_loss)]
        train_op = optimizer.apply_gradients(grads, global_step=global_step)

    def data(n_steps, batch):
        rng = np.random.RandomState(1)
        out = []
        for _ in range(n_steps):
            step = {}
            for k in names:
                step[f"{k}_ids:0"] = _ids(rng, (batch, length), 10).astype(np.int64)
                lengths = rng.randint(1, length + 1, size=batch)
                step[f"{k}_mask:0"] = (np.arange(length)[None, :] < lengths[:, None]).astype(
                    np.int32)
            out.append(step)
        return out
    feeds = [f"{k}_{s}:0" for k in names for s in ("ids", "mask")]
    return graph, Script(feeds, train_op, data,
                         config={"average_dense": False, "average_sparse": False})


class _LuongCell(tf1.nn.rnn_cell.RNNCell):
    """An LSTM whose output attends to the encoder's outputs (Luong's "general" score and
    attention layer, as tf.contrib.seq2seq.AttentionWrapper with output_attention=True)."""

    def __init__(self, units, memory, initializer):
        super().__init__(name="attention_cell")
        self._cell = tf1.nn.rnn_cell.LSTMCell(units, initializer=initializer)
        self._memory, self._units, self._init = memory, units, initializer

    @property
    def state_size(self):
        return (self._cell.state_size, self._units)

    @property
    def output_size(self):
        return self._units

    def build(self, input_shape):
        self._w_score = self.add_weight("luong_memory", [self._units, self._units],
                                        initializer=self._init)
        self._w_attention = self.add_weight("attention_layer", [2 * self._units, self._units],
                                            initializer=self._init)
        self.built = True

    def call(self, inputs, state):
        lstm_state, attention = state
        out, lstm_state = self._cell(tf.concat([inputs, attention], 1), lstm_state)
        keys = tf.tensordot(self._memory, self._w_score, 1)  # [B, T, U]
        alignments = tf.nn.softmax(tf.reduce_sum(keys * out[:, None, :], 2))
        context = tf.reduce_sum(alignments[:, :, None] * self._memory, 1)
        attention = tf.tanh(tf.matmul(tf.concat([context, out], 1), self._w_attention))
        return attention, (lstm_state, attention)


def nmt(src_vocab=25, tgt_vocab=20, emb=5, units=6, src_len=4, tgt_len=3):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        src = tf1.placeholder(tf.int32, [None, src_len], name="source")
        src_lengths = tf1.placeholder(tf.int32, [None], name="source_length")
        tgt_in = tf1.placeholder(tf.int32, [None, tgt_len], name="target_input")
        tgt_out = tf1.placeholder(tf.int32, [None, tgt_len], name="target_output")
        tgt_lengths = tf1.placeholder(tf.int32, [None], name="target_length")
        init = tf1.random_uniform_initializer(-0.1, 0.1)
        with tf1.variable_scope("embeddings"):
            enc_emb = tf1.get_variable("embedding_encoder", [src_vocab, emb], initializer=init)
            dec_emb = tf1.get_variable("embedding_decoder", [tgt_vocab, emb], initializer=init)
        with tf1.variable_scope("encoder"):
            memory, enc_state = tf1.nn.dynamic_rnn(
                tf1.nn.rnn_cell.LSTMCell(units, initializer=init),
                tf1.nn.embedding_lookup(enc_emb, src), sequence_length=src_lengths,
                dtype=tf.float32)
        with tf1.variable_scope("decoder"):
            cell = _LuongCell(units, memory, init)
            batch = tf.shape(src)[0]
            start = (enc_state, tf.zeros([batch, units]))
            outputs, _ = tf1.nn.dynamic_rnn(cell, tf1.nn.embedding_lookup(dec_emb, tgt_in),
                                            sequence_length=tgt_lengths, initial_state=start)
            logits = tf1.layers.dense(outputs, tgt_vocab, use_bias=False,
                                      kernel_initializer=init, name="output_projection")
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tgt_out, logits=logits)
        mask = tf.sequence_mask(tgt_lengths, tgt_len, dtype=tf.float32)
        loss = tf.reduce_sum(crossent * mask) / tf.cast(batch, tf.float32)
        params = tf1.trainable_variables()
        gradients = tf1.gradients(loss, params, colocate_gradients_with_ops=True)
        clipped, _ = tf.clip_by_global_norm(gradients, 5.0)
        global_step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.GradientDescentOptimizer(0.5).apply_gradients(
            zip(clipped, params), global_step=global_step)

    def data(n_steps, b):
        rng = np.random.RandomState(2)
        return [{"source:0": _ids(rng, (b, src_len), 9),
                 "source_length:0": rng.randint(2, src_len + 1, size=b).astype(np.int32),
                 "target_input:0": _ids(rng, (b, tgt_len), 8),
                 "target_output:0": _ids(rng, (b, tgt_len), tgt_vocab),
                 "target_length:0": rng.randint(1, tgt_len + 1, size=b).astype(np.int32)}
                for _ in range(n_steps)]
    return graph, Script(["source:0", "source_length:0", "target_input:0", "target_output:0",
                          "target_length:0"], train_op, data)


def ptb(vocab=30, size=6, layers=2, steps=3):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(4)
        x = tf1.placeholder(tf.int32, [None, steps], name="input_data")
        y = tf1.placeholder(tf.int32, [None, steps], name="targets")
        init = tf1.random_uniform_initializer(-0.1, 0.1)
        with tf1.variable_scope("Model", initializer=init):
            cells = [tf1.nn.rnn_cell.BasicLSTMCell(size, forget_bias=0.0) for _ in range(layers)]
            cell = tf1.nn.rnn_cell.MultiRNNCell(cells)
            initial_state = tuple(
                tf1.nn.rnn_cell.LSTMStateTuple(
                    tf1.placeholder(tf.float32, [None, size], name=f"initial_c{i}"),
                    tf1.placeholder(tf.float32, [None, size], name=f"initial_h{i}"))
                for i in range(layers))
            embedding = tf1.get_variable("embedding", [vocab, size], dtype=tf.float32)
            inputs = tf1.nn.embedding_lookup(embedding, x)
            outputs, final_state = tf1.nn.dynamic_rnn(cell, inputs, initial_state=initial_state)
            output = tf.reshape(outputs, [-1, size])
            softmax_w = tf1.get_variable("softmax_w", [size, vocab], dtype=tf.float32)
            softmax_b = tf1.get_variable("softmax_b", [vocab], dtype=tf.float32)
            logits = tf1.nn.xw_plus_b(output, softmax_w, softmax_b)
            logits = tf.reshape(logits, [-1, steps, vocab])
            # contrib.seq2seq.sequence_loss(average_across_timesteps=False,
            # average_across_batch=True), then summed: the tutorial's cost.
            crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            cost = tf.reduce_sum(tf.reduce_mean(crossent, 0))
            lr = tf.Variable(0.0, trainable=False, name="lr")
            tvars = tf1.trainable_variables()
            grads, _ = tf.clip_by_global_norm(tf.gradients(cost, tvars), 5.0)
            optimizer = tf1.train.GradientDescentOptimizer(lr)
            train_op = optimizer.apply_gradients(
                zip(grads, tvars), global_step=tf1.train.get_or_create_global_step())
            new_lr = tf1.placeholder(tf.float32, shape=[], name="new_learning_rate")
            lr_update = tf1.assign(lr, new_lr)
    state = {}
    for i, (c, h) in enumerate(final_state):
        state[f"Model/initial_c{i}:0"] = c.name
        state[f"Model/initial_h{i}:0"] = h.name

    def data(n_steps, b):
        rng = np.random.RandomState(3)
        return [{"input_data:0": _ids(rng, (b, steps), 12),
                 "targets:0": _ids(rng, (b, steps), vocab)} for _ in range(n_steps)]
    return graph, Script(["input_data:0", "targets:0"] + sorted(state), {
        "cost": cost, "train_op": train_op, "final_state": final_state}, data, state=state,
        lr=(lr, new_lr, lr_update))


def wide_deep(buckets=20, users=15, emb=4, tags=12, tags_per_example=3):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(5)
        fc = tf.feature_column
        features = {
            "item": tf1.placeholder(tf.string, [None, 1], name="item"),
            "user": tf1.placeholder(tf.int64, [None, 1], name="user"),
            "age": tf1.placeholder(tf.float32, [None, 1], name="age"),
            # Multi-valued: feature columns drop the -1 padding (and the zero weights).
            "tags": tf1.placeholder(tf.int64, [None, tags_per_example], name="tags"),
            "tag_weight": tf1.placeholder(tf.float32, [None, tags_per_example],
                                          name="tag_weight"),
        }
        labels = tf1.placeholder(tf.float32, [None, 1], name="label")
        item = fc.categorical_column_with_hash_bucket("item", buckets)
        user = fc.categorical_column_with_identity("user", users)
        age = fc.numeric_column("age")
        crossed = fc.crossed_column(["item", user], 50)
        tag = fc.categorical_column_with_identity("tags", tags)
        weighted_tag = fc.weighted_categorical_column(tag, "tag_weight")
        with tf1.variable_scope("linear"):
            linear_logits = tf1.feature_column.linear_model(
                features, [item, user, crossed, age, tag])
        with tf1.variable_scope("dnn"):
            # Seeded initialisers: tf-keras's defaults draw per process, and the tests
            # compare every job with one single-device run from the same values.
            init = tf1.glorot_uniform_initializer(seed=6)
            embed = tf1.truncated_normal_initializer(stddev=0.5, seed=7)
            net = tf1.feature_column.input_layer(
                features, [fc.embedding_column(item, emb, initializer=embed),
                           fc.embedding_column(user, emb, initializer=embed),
                           fc.embedding_column(weighted_tag, emb, combiner="sqrtn",
                                               initializer=embed), age])
            net = tf1.layers.dense(net, 5, activation=tf.nn.relu, name="hiddenlayer_0",
                                   kernel_initializer=init)
            dnn_logits = tf1.layers.dense(net, 1, name="logits", kernel_initializer=init)
        logits = linear_logits + dnn_logits
        loss = tf1.losses.sigmoid_cross_entropy(labels, logits)
        global_step = tf1.train.get_or_create_global_step()
        linear_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "linear")
        dnn_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "dnn")
        linear_train = tf1.train.FtrlOptimizer(0.1).minimize(loss, var_list=linear_vars)
        dnn_train = tf1.train.AdagradOptimizer(0.05).minimize(loss, var_list=dnn_vars)
        train_op = tf.group(linear_train, dnn_train)
        with tf.control_dependencies([train_op]):
            train_op = tf1.assign_add(global_step, 1)  # the canned head's train_op

    def data(n_steps, b):
        rng = np.random.RandomState(4)
        words = np.array([f"item{i}".encode() for i in range(9)])
        steps = []
        for _ in range(n_steps):
            # 0 to tags_per_example tags an example (few distinct: repeats within one),
            # the unused places -1 with weight 0.
            tag_ids = rng.randint(0, tags // 2, size=(b, tags_per_example)).astype(np.int64)
            used = np.arange(tags_per_example) < rng.randint(0, tags_per_example + 1,
                                                              size=(b, 1))
            steps.append({"item:0": words[rng.randint(0, 9, size=(b, 1))],
                          "user:0": rng.randint(0, users, size=(b, 1)).astype(np.int64),
                          "age:0": rng.rand(b, 1).astype(np.float32),
                          "tags:0": np.where(used, tag_ids, -1),
                          "tag_weight:0": np.where(used, 0.5 + rng.rand(*used.shape),
                                                   0.0).astype(np.float32),
                          "label:0": (rng.rand(b, 1) > 0.5).astype(np.float32)})
        return steps
    return graph, Script(["item:0", "user:0", "age:0", "tags:0", "tag_weight:0", "label:0"],
                         train_op, data)


SCRIPTS = {"lm1b": lm1b, "skip_thoughts": skip_thoughts, "nmt": nmt, "ptb": ptb,
           "wide_deep": wide_deep}
