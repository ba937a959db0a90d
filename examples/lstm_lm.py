"""An LSTM language model as the field writes them, trained with tfpar, with checkpoints.

    horovodrun -np 2 -H localhost:2 python examples/lstm_lm.py --checkpoint-dir /tmp/lm
    (kill it, run the same command again: it resumes from the latest checkpoint;
    tensorboard --logdir /tmp/lm shows the loss and the step rate)

The model of TensorFlow's PTB tutorial and of Parallax's LM example, unchanged for tfpar:
a partitioned word embedding, dropout, an LSTM with a projection layer
(`tf.compat.v1.nn.rnn_cell.LSTMCell(num_proj=...)` run by `dynamic_rnn`, i.e. inside a
`tf.while_loop`), a `tf.compat.v1.layers.dense` layer, a sampled softmax over a
partitioned softmax weight and bias, the loss scaled by the number of steps, every
gradient clipped by their global norm (the embedding's included), Adagrad, and an
exponential moving average of the LSTM's weights for evaluation. Its training loop is
TF1's `MonitoredTrainingSession` with hooks; the two tfpar lines are marked. `--tf1` builds
it as a TF1 script would after
`tf.compat.v1.disable_v2_behavior()` (reference variables, v1 control flow).

Data: generated text whose word frequencies follow Zipf's law (see examples/lm.py), or
your own text file (`--text`; the `--vocab` most frequent words kept).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402  (before any layer is built: it selects Keras 2 for tf.compat.v1)

tf1 = tf.compat.v1


def build_graph(words=None, vocab=10_000, emb_dim=64, hidden=128, proj=64, num_steps=8,
                batch_size=32, num_sampled=64, lr=0.5, clip=1.0, partitions=2, keep_prob=0.9,
                ema_decay=0.99, feed=False, seed=1):
    """The single-device training graph; returns (graph, handles).

    handles: inputs, targets (placeholders when `feed`), keep_prob (a placeholder with
    default `keep_prob`), loss, norm (the raw global gradient norm), train_op, ema (the
    ExponentialMovingAverage).
    """
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(seed)
        if feed:
            inputs = tf1.placeholder(tf.int32, [None, num_steps], name="inputs")
            targets = tf1.placeholder(tf.int32, [None, num_steps], name="targets")
        else:
            text = tf.constant(words, name="text")
            starts = tf.data.Dataset.range(len(words) - num_steps - 1)
            starts = tfpar.shard(starts)                               # tfpar line 1 of 2
            starts = starts.shuffle(50_000, seed=0).repeat().batch(batch_size,
                                                                   drop_remainder=True)
            start = tf1.data.make_one_shot_iterator(starts).get_next()
            window = tf.gather(text, start[:, None] + tf.range(num_steps + 1, dtype=tf.int64))
            inputs, targets = window[:, :-1], window[:, 1:]
        keep = tf1.placeholder_with_default(keep_prob, [], name="keep_prob")

        init = tf1.random_uniform_initializer(-0.1, 0.1)
        partitioner = tf1.fixed_size_partitioner(partitions) if partitions > 1 else None
        embedding = tf1.get_variable("embedding", [vocab, emb_dim], initializer=init,
                                     partitioner=partitioner)
        x = tf1.nn.embedding_lookup(embedding, inputs)
        x = tf1.nn.dropout(x, keep_prob=keep, seed=seed)
        cell = tf1.nn.rnn_cell.LSTMCell(hidden, num_proj=proj, initializer=init)
        outputs, _ = tf1.nn.dynamic_rnn(cell, x, dtype=tf.float32, scope="rnn")
        h = tf.reshape(outputs, [-1, proj])
        h = tf1.layers.dense(h, proj, activation=tf.tanh, kernel_initializer=init,
                             name="output_dense")
        softmax_w = tf1.get_variable("softmax/weights", [vocab, proj], initializer=init,
                                     partitioner=partitioner)
        softmax_b = tf1.get_variable("softmax/bias", [vocab], partitioner=partitioner,
                                     initializer=tf1.zeros_initializer())
        losses = tf1.nn.sampled_softmax_loss(
            softmax_w, softmax_b, tf.reshape(tf.cast(targets, tf.int64), [-1, 1]), h,
            min(num_sampled, vocab - 1), vocab, partition_strategy="div", seed=seed)
        # Summed over the steps, averaged over the batch, as the PTB tutorial's loss.
        loss = tf.identity(tf.reduce_mean(losses) * float(num_steps), name="loss")

        step = tf1.train.get_or_create_global_step()
        tvars = tf1.trainable_variables()
        grads, norm = tf.clip_by_global_norm(tf.gradients(loss, tvars), clip)
        optimizer = tf1.train.AdagradOptimizer(lr)
        train = optimizer.apply_gradients(zip(grads, tvars), global_step=step)
        ema = tf1.train.ExponentialMovingAverage(ema_decay)
        with tf.control_dependencies([train]):
            train_op = ema.apply([v for v in tvars if v.op.name.startswith("rnn/")])
    return graph, dict(inputs=inputs, targets=targets, keep_prob=keep, loss=loss, norm=norm,
                       train_op=train_op, ema=ema)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=32, help="sequences per worker per step")
    parser.add_argument("--num-steps", type=int, default=8, help="words per sequence")
    parser.add_argument("--text", help="a text file to train on (default: generated text)")
    parser.add_argument("--run-mode", default="HYBRID", choices=["HYBRID", "AR", "PS"])
    parser.add_argument("--checkpoint-dir", help="save here, and resume from here if a "
                        "checkpoint is there")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=20, help="a progress line every N steps")
    parser.add_argument("--tf1", action="store_true",
                        help="tf.compat.v1.disable_v2_behavior() first, as TF1 scripts do")
    args = parser.parse_args()
    if args.tf1:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()

    if __package__:  # imported as examples.lstm_lm
        from .lm import read_text, zipf_text
    else:  # run as a script: its folder is on the path
        from lm import read_text, zipf_text
    words = read_text(args.text, args.vocab) if args.text else zipf_text(args.vocab)
    graph, h = build_graph(words, vocab=args.vocab, num_steps=args.num_steps,
                           batch_size=args.batch)
    config = tfpar.Config(run_mode=args.run_mode)
    with graph.as_default():
        step = tf1.train.get_global_step()
        tf1.summary.scalar("loss_per_step", h["loss"])  # TensorBoard: the chief's loss
        hooks = [tf1.train.StopAtStepHook(last_step=args.steps)]
        progress = Progress(h["loss"], step, every=args.log_every, examples_per_step=args.batch * int(
            os.environ.get("HOROVOD_SIZE", "1")))
        # tfpar line 2 of 2: TF's MonitoredTrainingSession, distributed. It restores the
        # latest checkpoint of checkpoint_dir (made if missing), saves every save_every
        # steps and at the end, and writes summaries for TensorBoard there.
        with tfpar.MonitoredTrainingSession(
                checkpoint_dir=args.checkpoint_dir, hooks=hooks, chief_only_hooks=[progress],
                tfpar_config=config,
                save_checkpoint_steps=args.save_every, save_summaries_steps=20) as sess:
            if sess.resumed_from and sess.is_chief:
                print(f"resumed from {sess.resumed_from} at step {sess.resumed_at}", flush=True)
            while not sess.should_stop():
                sess.run(h["train_op"])


class Progress(tf1.train.SessionRunHook):
    """The chief's progress line every `every` steps: loss, steps/s, examples/s."""

    def __init__(self, loss, step, every, examples_per_step):
        self.loss, self.step, self.examples, self.every = loss, step, examples_per_step, every
        self.start = self.first = None

    def before_run(self, run_context):
        return tf1.train.SessionRunArgs([self.loss, self.step])

    def after_run(self, run_context, run_values):
        loss, step = run_values.results
        if self.start is None:
            self.start, self.first = time.time(), step
        if step % self.every == 0 and step > self.first:
            rate = (step - self.first) / (time.time() - self.start)
            print(f"step {step}: loss {loss:.3f} ({rate:.1f} steps/s, "
                  f"{rate * self.examples:.0f} examples/s)", flush=True)

if __name__ == "__main__":
    main()
