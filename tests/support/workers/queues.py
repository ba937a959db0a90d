"""TF1's queue-based input, as the PTB tutorial's reader builds it: `ptb_producer`'s
`tf.compat.v1.train.range_input_producer` picks each step's slice of the worker's own
data (its rows of the batch), and queue runners fill it. An embedding, a dense layer and
a softmax over the vocabulary, Adagrad, a global step.

Each worker starts the queue runners as a TF1 script does: through
`tfpar.MonitoredTrainingSession` (HYBRID and SHARDED, which starts them itself, with a
`StopAtStepHook`), or by `tf.compat.v1.train.start_queue_runners(sess=runner)` on a
plain runner (AR and PS), which then saves with the script's own
`saver.save(runner, path)`.

usage: horovodrun -np N ... python queues.py OUT_DIR
       python queues.py OUT_DIR --single N   (one device, the N workers' rows together,
                                              from the job's initial values)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>) or single.npz; AR and PS
also OUT_DIR/<mode>/saved (the Saver's checkpoint, written by worker 0).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, WIDTH, BATCH, NUM_STEPS, STEPS = 20, 4, 2, 3, 4
MODES = {"HYBRID": ({"run_mode": "HYBRID"}, True),
         "SHARDED": ({"run_mode": "HYBRID", "sparse_route": "sharded"}, True),
         "AR": ({"run_mode": "AR"}, False),
         "PS": ({"run_mode": "PS"}, False)}


def ptb_producer(raw_data, batch_size, num_steps, name=None):
    """The PTB tutorial's reader.ptb_producer, as written there."""
    with tf1.name_scope(name, "PTBProducer", [raw_data, batch_size, num_steps]):
        raw_data = tf.convert_to_tensor(raw_data, name="raw_data", dtype=tf.int32)
        data_len = tf.size(raw_data)
        batch_len = data_len // batch_size
        data = tf.reshape(raw_data[0: batch_size * batch_len], [batch_size, batch_len])
        epoch_size = (batch_len - 1) // num_steps
        assertion = tf1.assert_positive(epoch_size, message="epoch_size == 0")
        with tf.control_dependencies([assertion]):
            epoch_size = tf.identity(epoch_size, name="epoch_size")
        i = tf1.train.range_input_producer(epoch_size, shuffle=False).dequeue()
        x = tf.strided_slice(data, [0, i * num_steps], [batch_size, (i + 1) * num_steps])
        x.set_shape([batch_size, num_steps])
        y = tf.strided_slice(data, [0, i * num_steps + 1],
                             [batch_size, (i + 1) * num_steps + 1])
        y.set_shape([batch_size, num_steps])
        return x, y


def rows(n):
    """The whole batch's rows of word ids, [n * BATCH, length]: worker r reads rows
    r * BATCH ... (r + 1) * BATCH (its own data), one device all of them."""
    length = NUM_STEPS * (STEPS + 1) + 1
    return np.random.RandomState(9).randint(0, VOCAB, size=(n * BATCH, length)).astype(np.int32)


def build(raw_data, batch_size):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(4)
        x, y = ptb_producer(raw_data, batch_size, NUM_STEPS)
        emb = tf1.get_variable("emb", [VOCAB, WIDTH])
        h = tf1.layers.dense(tf.nn.embedding_lookup(emb, x), VOCAB, name="softmax")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=h))
        step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.AdagradOptimizer(0.5).minimize(loss, global_step=step)
        saver = tf1.train.Saver()
    return graph, train_op, saver


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, (config, monitored) in MODES.items():
        if single:
            graph, train_op, _ = build(rows(single).reshape(-1), BATCH * single)
            variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)

            def train(sess):
                coord = tf1.train.Coordinator()
                threads = tf1.train.start_queue_runners(sess=sess, coord=coord)
                for _ in range(STEPS):
                    sess.run(train_op)
                coord.request_stop()
                coord.join(threads)
            final = one_device.single_device(graph, variables,
                                             os.path.join(out, mode, "rank0.npz"), train)
            one_device.save(os.path.join(out, mode, "single.npz"), variables, final)
            continue
        import tfpar
        import horovod.tensorflow as hvd
        hvd.init()
        rank, n = hvd.rank(), hvd.size()
        mine = rows(n)[rank * BATCH:(rank + 1) * BATCH].reshape(-1)
        graph, train_op, saver = build(mine, BATCH)
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        if monitored:
            with graph.as_default():
                session = tfpar.MonitoredTrainingSession(
                    hooks=[tf1.train.StopAtStepHook(last_step=STEPS)],
                    tfpar_config=tfpar.Config(**config))
            runner = session.runner
            init = runner.run(variables)
            with session:
                while not session.should_stop():
                    session.run(train_op)
                final = runner.run(variables)
        else:
            with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
                init = runner.run(variables)
                coord = tf1.train.Coordinator()
                threads = tf1.train.start_queue_runners(sess=runner, coord=coord)
                for _ in range(STEPS):
                    runner.run(train_op)
                final = runner.run(variables)
                if rank == 0:
                    with graph.as_default():
                        saver.save(runner, os.path.join(out, mode, "saved"))
                coord.request_stop()
                coord.join(threads)
        one_device.save(os.path.join(out, mode, f"rank{rank}.npz"), variables, final, init)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None)
