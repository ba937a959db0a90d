"""Google BERT's TF1 training step (`optimization.py`'s `create_optimizer`) on a small
BERT-shaped model: word embeddings read by `tf.gather`, position embeddings sliced, a
layer norm, a dense layer, a pooler and a classifier; `tf.gradients` of every trainable
variable, `tf.clip_by_global_norm` at 1.0, the polynomial learning-rate decay with a
linear warm-up, and BERT's own `AdamWeightDecayOptimizer`: no TF optimizer kernel at
all, its m and v are non-trainable variables, and every update is an `assign` of
arithmetic on the gradient, so the word embeddings' IndexedSlices are made dense by the
optimizer itself (a dense update of a sparse variable); weight decay for all but the
layer norms and biases; the global step incremented by hand (after the update: see
`create_optimizer`).

usage: horovodrun -np N ... python bert_optimizer.py OUT_DIR
       python bert_optimizer.py OUT_DIR --single N   (one device, the N workers' batches
                                                      together, from the job's values)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>, route) or single.npz, for
HYBRID (the default routes), SHARDED (sparse_route="sharded" for every sparse variable),
AR, and UNCLIPPED (HYBRID without the clipping: the word embeddings' dense update can
take the dense allreduce).
"""
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, WIDTH, SEQ, CLASSES, BATCH, STEPS = 30, 8, 5, 3, 4, 4
MODES = {"HYBRID": ({"run_mode": "HYBRID"}, True),
         "SHARDED": ({"run_mode": "HYBRID", "sparse_route": "sharded"}, True),
         "AR": ({"run_mode": "AR"}, True),
         "UNCLIPPED": ({"run_mode": "HYBRID"}, False)}


class AdamWeightDecayOptimizer(tf1.train.Optimizer):
    """BERT's optimizer, as its optimization.py writes it: Adam with decoupled weight
    decay and no bias correction, built from assigns."""

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-6, exclude_from_weight_decay=None,
                 name="AdamWeightDecayOptimizer"):
        super().__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude_from_weight_decay = exclude_from_weight_decay

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        assignments = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            param_name = re.match("^(.*):\\d+$", param.name).group(1)
            m = tf1.get_variable(name=param_name + "/adam_m", shape=param.shape.as_list(),
                                 dtype=tf.float32, trainable=False,
                                 initializer=tf1.zeros_initializer())
            v = tf1.get_variable(name=param_name + "/adam_v", shape=param.shape.as_list(),
                                 dtype=tf.float32, trainable=False,
                                 initializer=tf1.zeros_initializer())
            next_m = tf.multiply(self.beta_1, m) + tf.multiply(1.0 - self.beta_1, grad)
            next_v = tf.multiply(self.beta_2, v) + tf.multiply(1.0 - self.beta_2,
                                                               tf.square(grad))
            update = next_m / (tf.sqrt(next_v) + self.epsilon)
            if self._do_use_weight_decay(param_name):
                update += self.weight_decay_rate * param
            next_param = param - self.learning_rate * update
            assignments.extend([param.assign(next_param), m.assign(next_m),
                                v.assign(next_v)])
        return tf.group(*assignments, name=name)

    def _do_use_weight_decay(self, param_name):
        if not self.weight_decay_rate:
            return False
        return not any(re.search(r, param_name) for r in self.exclude_from_weight_decay or [])


def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps, clip=True):
    """optimization.py's create_optimizer (without TPU)."""
    global_step = tf1.train.get_or_create_global_step()
    learning_rate = tf.constant(value=init_lr, shape=[], dtype=tf.float32)
    learning_rate = tf1.train.polynomial_decay(learning_rate, global_step, num_train_steps,
                                               end_learning_rate=0.0, power=1.0, cycle=False)
    global_steps_int = tf.cast(global_step, tf.int32)
    warmup_steps_int = tf.constant(num_warmup_steps, dtype=tf.int32)
    warmup_percent_done = tf.cast(global_steps_int, tf.float32) / tf.cast(warmup_steps_int,
                                                                          tf.float32)
    warmup_learning_rate = init_lr * warmup_percent_done
    is_warmup = tf.cast(global_steps_int < warmup_steps_int, tf.float32)
    learning_rate = (1.0 - is_warmup) * learning_rate + is_warmup * warmup_learning_rate
    optimizer = AdamWeightDecayOptimizer(
        learning_rate=learning_rate, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999,
        epsilon=1e-6, exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"])
    tvars = tf1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    if clip:
        grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)
    # BERT groups the increment with the update, unordered: it races with the learning
    # rate's reads of the step, on one device too (a CI run once took the increment
    # first in the job and not on one device). Ordered after the update, as TF's own
    # optimizers increment the step, so the runs compared are determinate.
    with tf.control_dependencies([train_op]):
        new_global_step = global_step + 1
    return tf.group(train_op, [global_step.assign(new_global_step)])


def build(clip=True):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(5)
        ids = tf1.placeholder(tf.int32, [None, SEQ], name="input_ids")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        init = tf1.truncated_normal_initializer(stddev=0.5)
        with tf1.variable_scope("bert"):
            with tf1.variable_scope("embeddings"):
                table = tf1.get_variable("word_embeddings", [VOCAB, WIDTH], initializer=init)
                x = tf.reshape(tf.gather(table, tf.reshape(ids, [-1])), [-1, SEQ, WIDTH])
                positions = tf1.get_variable("position_embeddings", [16, WIDTH],
                                             initializer=init)
                x += tf.slice(positions, [0, 0], [SEQ, -1])[None]
                with tf1.variable_scope("LayerNorm"):
                    mean, var = tf.nn.moments(x, [-1], keepdims=True)
                    gamma = tf1.get_variable("gamma", [WIDTH], initializer=tf1.ones_initializer())
                    beta = tf1.get_variable("beta", [WIDTH], initializer=tf1.zeros_initializer())
                    x = (x - mean) * tf.math.rsqrt(var + 1e-12) * gamma + beta
            with tf1.variable_scope("encoder"):
                x = tf1.layers.dense(x, WIDTH, activation=tf.tanh, kernel_initializer=init)
            with tf1.variable_scope("pooler"):
                pooled = tf1.layers.dense(x[:, 0], WIDTH, activation=tf.tanh,
                                          kernel_initializer=init)
        output_weights = tf1.get_variable("output_weights", [CLASSES, WIDTH], initializer=init)
        output_bias = tf1.get_variable("output_bias", [CLASSES],
                                       initializer=tf1.zeros_initializer())
        logits = tf.nn.bias_add(tf.matmul(pooled, output_weights, transpose_b=True), output_bias)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        one_hot = tf.one_hot(labels, depth=CLASSES, dtype=tf.float32)
        loss = tf.reduce_mean(-tf.reduce_sum(one_hot * log_probs, axis=-1))
        train_op = create_optimizer(loss, 0.05, num_train_steps=10, num_warmup_steps=2,
                                    clip=clip)
    return graph, dict(ids=ids, labels=labels, train_op=train_op)


def batch(step, n):
    """n workers' batches together; ids repeat within and across workers."""
    rng = np.random.RandomState(50 + step)
    return (rng.randint(0, VOCAB, size=(BATCH * n, SEQ)).astype(np.int32),
            rng.randint(0, CLASSES, size=BATCH * n).astype(np.int32))


def train(run, h, rank, n, together=1):
    """Worker `rank`'s steps of n workers (`together` workers' batches at once: one
    device's)."""
    for step in range(STEPS):
        ids, labels = batch(step, n * together)
        mine = slice(rank * BATCH, (rank + together) * BATCH)
        run(h["train_op"], {h["ids"]: ids[mine], h["labels"]: labels[mine]})


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, (config, clip) in MODES.items():
        graph, h = build(clip)
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        folder = os.path.join(out, mode)
        if single:
            final = one_device.single_device(
                graph, variables, os.path.join(folder, "rank0.npz"),
                lambda sess: train(sess.run, h, 0, 1, single))
            one_device.save(os.path.join(folder, "single.npz"), variables, final)
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            init = runner.run(variables)
            train(runner.run, h, runner.worker_id, runner.num_workers)
            final = runner.run(variables)
            route = runner.plan.variable("bert/embeddings/word_embeddings").route
            one_device.save(os.path.join(folder, f"rank{runner.worker_id}.npz"), variables,
                            final, init, route=route)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None)
