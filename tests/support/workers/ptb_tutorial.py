"""TensorFlow's PTB tutorial (tutorials/rnn/ptb: ptb_word_lm.py and reader.py) as written,
its `tf.train.Supervisor` loop ported to tfpar by one line.

The script's own parts, kept as the tutorial has them: `reader.ptb_producer` (the corpus a
constant, a `range_input_producer` queue of step numbers, strided slices); the Train model
and the Valid and Test models that reuse its variables (`variable_scope(reuse=True)`),
each with its own queue; the embedding under `tf.device("/cpu:0")`; two LSTM layers
unrolled by hand over `num_steps` (`BasicLSTMCell`, `MultiRNNCell`); the cost summed over
time steps of the batch's mean (`sequence_loss`'s averaging, written out); the learning
rate a variable set between epochs by `assign_lr` (`lr_update` with a feed); global-norm
clipping of `tf.gradients`; summaries of the losses and the learning rate; and
`run_epoch`: the LSTM state fetched from `model.initial_state` (the `zero_state` tensors,
not placeholders) and fed back into them at every step, fetches as a dict.

The port: `tf.compat.v1.train.Supervisor(logdir=...)` and `sv.managed_session()` become
`tfpar.MonitoredTrainingSession(checkpoint_dir=...)` (it starts the queue runners and
saves on close as the Supervisor does), and each worker's corpus is its own part.

usage: horovodrun -np N ... python ptb_tutorial.py OUT_DIR
       python ptb_tutorial.py OUT_DIR --single N   (the tutorial on one device on the N
           workers' corpora together, batch N x 2, from the job's initial values, in
           TF's own MonitoredTrainingSession: the port's loop as TF runs it. The
           Supervisor takes the same batches, but its summary thread takes its first
           one at a moment of its own)
Writes OUT_DIR/<mode>/rank<r>.npz or single.npz (init/, final/), and the perplexities
beside them (perplexities_rank<r>.npz, perplexities_single.npz).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402
from tests.support.workers.queues import ptb_producer  # noqa: E402  (reader.py's, as written)

tf1 = tf.compat.v1
MODES = {"HYBRID": {}, "AR": {"run_mode": "AR"}, "SHARDED": {"sparse_route": "sharded"}}


class Config:  # the tutorial's SmallConfig, smaller
    init_scale = 0.1
    learning_rate = 1.0
    max_grad_norm = 5
    num_layers = 2
    num_steps = 3
    hidden_size = 8
    max_epoch = 1
    max_max_epoch = 2
    keep_prob = 1.0
    lr_decay = 0.5
    batch_size = 2
    vocab_size = 40


def corpus(part, length):
    """Part `part` of a corpus of ids (Zipf over the vocabulary), `length` ids."""
    rng = np.random.RandomState(100 + part)
    weights = 1.0 / np.arange(1, Config.vocab_size + 1)
    return rng.choice(Config.vocab_size, size=length, p=weights / weights.sum()).astype(np.int32)


def parts_of(worker):
    """Worker `worker`'s (train, valid, test) corpora: 62, 26 and 26 ids, multiples of
    its batches (2, 2 and 1 rows), so that the workers' corpora together reshape into
    their rows one under the other, as each worker's batches are in the global one."""
    return tuple(corpus(3 * worker + k, 62 if k == 0 else 26) for k in range(3))


class PTBInput:
    def __init__(self, config, data, name=None):
        self.batch_size = batch_size = config.batch_size
        self.num_steps = num_steps = config.num_steps
        self.epoch_size = ((len(data) // batch_size) - 1) // num_steps
        self.input_data, self.targets = ptb_producer(data, batch_size, num_steps, name=name)


class PTBModel:
    def __init__(self, is_training, config, input_):
        self.input = input_
        self.batch_size = input_.batch_size
        self.num_steps = input_.num_steps
        size, vocab_size = config.hidden_size, config.vocab_size
        with tf.device("/cpu:0"):
            embedding = tf1.get_variable("embedding", [vocab_size, size], dtype=tf.float32)
            inputs = tf.nn.embedding_lookup(embedding, input_.input_data)
        output, state = self._build_rnn_graph(inputs, config, is_training)
        softmax_w = tf1.get_variable("softmax_w", [size, vocab_size], dtype=tf.float32)
        softmax_b = tf1.get_variable("softmax_b", [vocab_size], dtype=tf.float32)
        logits = tf1.nn.xw_plus_b(output, softmax_w, softmax_b)
        logits = tf.reshape(logits, [self.batch_size, self.num_steps, vocab_size])
        # contrib.seq2seq.sequence_loss(average_across_timesteps=False,
        # average_across_batch=True) with weights of ones
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=input_.targets,
                                                                  logits=logits)
        self.cost = tf.reduce_sum(tf.reduce_mean(crossent, 0))
        self.final_state = state
        if not is_training:
            return
        self.lr = tf.Variable(0.0, trainable=False)
        tvars = tf1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(tf.gradients(self.cost, tvars), config.max_grad_norm)
        optimizer = tf1.train.GradientDescentOptimizer(self.lr)
        self.train_op = optimizer.apply_gradients(
            zip(grads, tvars), global_step=tf1.train.get_or_create_global_step())
        self.new_lr = tf1.placeholder(tf.float32, shape=[], name="new_learning_rate")
        self.lr_update = tf1.assign(self.lr, self.new_lr)

    def assign_lr(self, session, lr_value):
        session.run(self.lr_update, feed_dict={self.new_lr: lr_value})

    def _build_rnn_graph(self, inputs, config, is_training):
        def make_cell():
            return tf1.nn.rnn_cell.BasicLSTMCell(config.hidden_size, forget_bias=0.0,
                                                 state_is_tuple=True, reuse=not is_training)
        cell = tf1.nn.rnn_cell.MultiRNNCell([make_cell() for _ in range(config.num_layers)],
                                            state_is_tuple=True)
        self.initial_state = cell.zero_state(config.batch_size, tf.float32)
        state = self.initial_state
        outputs = []
        with tf1.variable_scope("RNN"):
            for time_step in range(self.num_steps):
                if time_step > 0:
                    tf1.get_variable_scope().reuse_variables()
                (cell_output, state) = cell(inputs[:, time_step, :], state)
                outputs.append(cell_output)
        output = tf.reshape(tf.concat(outputs, 1), [-1, config.hidden_size])
        return output, state


def run_epoch(session, model, eval_op=None):
    """The tutorial's: returns the epoch's perplexity."""
    costs, iters = 0.0, 0
    state = session.run(model.initial_state)
    fetches = {"cost": model.cost, "final_state": model.final_state}
    if eval_op is not None:
        fetches["eval_op"] = eval_op
    for _ in range(model.input.epoch_size):
        feed_dict = {}
        for i, (c, h) in enumerate(model.initial_state):
            feed_dict[c] = state[i].c
            feed_dict[h] = state[i].h
        vals = session.run(fetches, feed_dict)
        costs += vals["cost"]
        state = vals["final_state"]
        iters += model.input.num_steps
    return np.exp(costs / iters)


def build(parts):
    """The tutorial's main() graph on the corpora `parts` (one worker's, or all together)."""
    config = Config()
    config.batch_size = Config.batch_size * len(parts)
    eval_config = Config()
    eval_config.batch_size = len(parts)
    eval_config.num_steps = 1
    train_data, valid_data, test_data = (np.concatenate([p[k] for p in parts])
                                         for k in range(3))
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(11)
        initializer = tf1.random_uniform_initializer(-config.init_scale, config.init_scale)
        with tf1.name_scope("Train"):
            train_input = PTBInput(config=config, data=train_data, name="TrainInput")
            with tf1.variable_scope("Model", reuse=None, initializer=initializer):
                m = PTBModel(is_training=True, config=config, input_=train_input)
            tf1.summary.scalar("Training Loss", m.cost)
            tf1.summary.scalar("Learning Rate", m.lr)
        with tf1.name_scope("Valid"):
            valid_input = PTBInput(config=config, data=valid_data, name="ValidInput")
            with tf1.variable_scope("Model", reuse=True, initializer=initializer):
                mvalid = PTBModel(is_training=False, config=config, input_=valid_input)
            tf1.summary.scalar("Validation Loss", mvalid.cost)
        with tf1.name_scope("Test"):
            test_input = PTBInput(config=eval_config, data=test_data, name="TestInput")
            with tf1.variable_scope("Model", reuse=True, initializer=initializer):
                mtest = PTBModel(is_training=False, config=eval_config, input_=test_input)
    return graph, config, m, mvalid, mtest


def train(session, config, m, mvalid, mtest):
    """The tutorial's loop inside its managed session: (train, valid, test perplexities)."""
    train_ppl, valid_ppl = [], []
    for i in range(config.max_max_epoch):
        lr_decay = config.lr_decay ** max(i + 1 - config.max_epoch, 0.0)
        m.assign_lr(session, config.learning_rate * lr_decay)
        train_ppl.append(run_epoch(session, m, eval_op=m.train_op))
        valid_ppl.append(run_epoch(session, mvalid))
    return train_ppl, valid_ppl, run_epoch(session, mtest)


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, tfpar_config in MODES.items():
        folder = os.path.join(out, mode)
        if single:
            parts = [parts_of(w) for w in range(single)]
            graph, config, m, mvalid, mtest = build(parts)
            job = np.load(os.path.join(folder, "rank0.npz"))
            with graph.as_default():
                variables = tf1.global_variables()

                def init_fn(sess):  # the job's initial values (worker 0's)
                    for v in variables:
                        if f"init/{v.op.name}" in job.files:
                            v.load(job[f"init/{v.op.name}"], sess)
                scaffold = tf1.train.Scaffold(init_fn=lambda _, sess: init_fn(sess))
                with tf1.train.MonitoredTrainingSession(
                        checkpoint_dir=os.path.join(folder, "single_logdir"),
                        scaffold=scaffold) as session:
                    ppl = train(session, config, m, mvalid, mtest)
                    final = session.run(variables)
            one_device.save(os.path.join(folder, "single.npz"), variables, final)
            _save_perplexities(os.path.join(folder, "perplexities_single.npz"), ppl)
            continue
        import tfpar
        rank = int(os.environ["HOROVOD_RANK"])
        parts = [parts_of(rank)]
        graph, config, m, mvalid, mtest = build(parts)
        with graph.as_default():
            variables = tf1.global_variables()
            # The port: Supervisor(logdir) and sv.managed_session() ->
            with tfpar.MonitoredTrainingSession(
                    checkpoint_dir=os.path.join(folder, "logdir"),
                    tfpar_config=tfpar.Config(**tfpar_config)) as session:
                init = session.run(variables)
                ppl = train(session, config, m, mvalid, mtest)
                final = session.run(variables)
        one_device.save(os.path.join(folder, f"rank{rank}.npz"), variables, final, init)
        _save_perplexities(os.path.join(folder, f"perplexities_rank{rank}.npz"), ppl)


def _save_perplexities(path, ppl):
    np.savez(path, train_ppl=ppl[0], valid_ppl=ppl[1], test_ppl=ppl[2])


if __name__ == "__main__":
    one_device.command_line(main)
