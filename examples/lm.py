"""A word-level language model with large sparse embeddings, trained with tfpar HYBRID.

    horovodrun -np 2 -H localhost:2 python examples/lm.py [--vocab 100000] [--text file.txt]

A neural probabilistic language model (Bengio et al. 2003): the previous `--context` words
are looked up in an input embedding of the whole vocabulary, a dense layer mixes them, and
a sampled softmax over the vocabulary predicts the next word. Both the input embedding and
the softmax weights receive sparse gradients (only the rows a batch touches), so HYBRID
puts them on parameter servers and allreduces only the dense layer; the same graph runs
with `--run-mode AR` (Horovod allgather for the sparse ones) or `--run-mode PS`.

Data: generated text whose word frequencies follow Zipf's law and in which half the words
follow from the previous one (so there is something to learn), or your own text file
(`--text`; words split on whitespace, the `--vocab` most frequent kept).
"""
import argparse
import collections
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

tf1 = tf.compat.v1
ON_OFF_AUTO = {"on": True, "off": False, "auto": "auto"}
tf1.disable_eager_execution()


def zipf_text(vocab, n_tokens=200_000, exponent=1.1, follow=0.5, seed=0):
    """Word ids: unigram frequencies ~ 1/rank^exponent; with probability `follow` a word is
    a fixed function of the one before it."""
    rng = np.random.RandomState(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** exponent
    words = rng.choice(vocab, size=n_tokens, p=p / p.sum()).astype(np.int32)
    successor = rng.permutation(vocab).astype(np.int32)
    follows = rng.rand(n_tokens) < follow
    for i in range(1, n_tokens):
        if follows[i]:
            words[i] = successor[words[i - 1]]
    return words


def read_text(path, vocab):
    """Word ids of a text file: the vocab-1 most frequent words, the rest as id 0 (<unk>)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        tokens = f.read().lower().split()
    if len(tokens) < 2:
        raise SystemExit(f"{path}: need at least two words of text")
    common = [w for w, _ in collections.Counter(tokens).most_common(vocab - 1)]
    ids = {w: i + 1 for i, w in enumerate(common)}
    return np.array([ids.get(w, 0) for w in tokens], np.int32)


def build_graph(words=None, vocab=100_000, context=4, emb_dim=64, hidden=128, batch_size=128,
                num_sampled=64, lr=0.2, partitions=None, wrap_optimizer=None,
                min_partitions=None, max_partitions=None, feed=False, sampled=True,
                device=None, train_tables=True):
    """The single-device training graph; returns (graph, loss, train_op).

    words: the text as word ids (default: generated Zipf text of `vocab` words).
    The vocabulary-sized variables are made inside `tfpar.partitioner`, so tfpar searches
    how many parts to split them into (or takes `tfpar.Config(partitions=...)`).
    num_sampled: classes the sampled softmax draws per step (at most vocab - 1).
    partitions: split them with TensorFlow's own partitioner instead (fixed pieces).
    wrap_optimizer: a function applied to the optimizer (for baselines such as Horovod's
    DistributedOptimizer); tfpar needs none.
    feed: read the context words and targets from placeholders `previous` [batch, context]
    and `target` [batch, 1] instead of the generated text (for tests).
    sampled: sampled softmax (sparse softmax weights); False: a full softmax (dense).
    device: a device function for every op (TensorFlow's `replica_device_setter`, for the
    classic parameter-server baseline); tfpar needs none.
    train_tables: False keeps the vocabulary-sized variables fixed (only the dense layer
    trains): no sparse gradient to send, a floor for every sparse route's step time.
    """
    if words is None and not feed:
        words = zipf_text(vocab)
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device):
        tf1.set_random_seed(1)
        if feed:
            previous = tf1.placeholder(tf.int64, [None, context], name="previous")
            target = tf1.placeholder(tf.int64, [None, 1], name="target")
        else:
            text = tf.constant(words, name="text")
            starts = tf.data.Dataset.range(len(words) - context)
            starts = tfpar.shard(starts)                         # tfpar line 1 of 2
            starts = starts.shuffle(100_000, seed=0).repeat().batch(batch_size,
                                                                    drop_remainder=True)
            start = tf1.data.make_one_shot_iterator(starts).get_next()
            window = tf.gather(text, start[:, None] + tf.range(context + 1, dtype=tf.int64))
            previous, target = window[:, :context], window[:, context:]

        partitioner = tf1.fixed_size_partitioner(partitions) if partitions else None
        init = tf1.random_uniform_initializer(-0.05, 0.05)
        marks = tfpar.partitioner(min_partitions, max_partitions)
        with marks:
            embedding = tf1.get_variable("embedding", [vocab, emb_dim], initializer=init,
                                         partitioner=partitioner, trainable=train_tables)
        x = tf.reshape(tf1.nn.embedding_lookup(embedding, previous, partition_strategy="div"),
                       [-1, context * emb_dim])
        w = tf1.get_variable("hidden/kernel", [context * emb_dim, hidden],
                             initializer=tf1.glorot_uniform_initializer())
        b = tf1.get_variable("hidden/bias", [hidden], initializer=tf1.zeros_initializer())
        h = tf.tanh(tf.matmul(x, w) + b)
        if sampled:
            with marks:
                softmax_w = tf1.get_variable("softmax/weights", [vocab, hidden],
                                             initializer=init, partitioner=partitioner,
                                             trainable=train_tables)
                softmax_b = tf1.get_variable("softmax/bias", [vocab], partitioner=partitioner,
                                             initializer=tf1.zeros_initializer(),
                                             trainable=train_tables)
            losses = tf1.nn.sampled_softmax_loss(
                softmax_w, softmax_b, target, h, min(num_sampled, vocab - 1), vocab,
                partition_strategy="div", seed=1)
        else:
            softmax_w = tf1.get_variable("softmax/weights", [hidden, vocab], initializer=init,
                                         trainable=train_tables)
            softmax_b = tf1.get_variable("softmax/bias", [vocab], trainable=train_tables,
                                         initializer=tf1.zeros_initializer())
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=target[:, 0], logits=tf.matmul(h, softmax_w) + softmax_b)
        loss = tf.reduce_mean(losses, name="loss")
        step = tf1.train.get_or_create_global_step()
        optimizer = tf1.train.AdagradOptimizer(lr)
        if wrap_optimizer is not None:
            optimizer = wrap_optimizer(optimizer)
        train_op = optimizer.minimize(loss, global_step=step)
    return graph, loss, train_op


def session_config(threads=None):
    config = tf1.ConfigProto()
    if threads:
        config.intra_op_parallelism_threads = threads
    return config


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--text", help="a text file to train on (default: generated Zipf text)")
    p.add_argument("--batch-size", type=int, default=128, help="words per worker per step")
    p.add_argument("--context", type=int, default=4)
    p.add_argument("--run-mode", default="HYBRID", help="HYBRID (default), AR or PS")
    p.add_argument("--partitions", type=int, help="parts per vocabulary-sized variable on the "
                   "parameter servers (default: searched by tfpar, then remembered)")
    p.add_argument("--min-partitions", type=int, help="lower bound of the search")
    p.add_argument("--max-partitions", type=int, help="upper bound of the search")
    p.add_argument("--search-trials", type=int, default=5)
    p.add_argument("--search-again", action="store_true", help="forget the remembered count")
    p.add_argument("--no-local-aggregation", action="store_true")
    p.add_argument("--local-aggregation", choices=("on", "off", "auto"),
                   help="on (default), off, or auto: measured in the job (the rows a host's "
                   "workers share, the links), on where it pays")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="train the parameter servers' variables asynchronously "
                   "(tfpar.Config(sync=False))")
    p.add_argument("--sparse-route", default="ps",
                   choices=("ps", "allreduce", "allgather", "sharded", "auto"),
                   help="HYBRID: the vocabulary-sized variables on the parameter servers "
                   "(default), through a dense allreduce or Horovod's allgather, their rows "
                   "sharded over the workers (all-to-all), or routed by their measured "
                   "density")
    p.add_argument("--sharded-rows", choices=("auto", "modulo", "ranges"), default="auto",
                   help="with --sparse-route sharded: row i on worker i %% N (modulo), or "
                   "each worker a range of rows; auto (the default): as the job measures "
                   "the ids where it measures them, else modulo (tfpar.Config(sharded_rows))")
    p.add_argument("--ps-rows", choices=("auto", "modulo", "ranges"), default="auto",
                   help="the parameter servers' parts: row i in part i %% P (modulo), or "
                   "each part a range of rows; auto (the default): as the job measures "
                   "the ids where it measures them, else modulo (tfpar.Config(ps_rows))")
    p.add_argument("--search-routes", nargs="?", const="on", choices=("on", "force"),
                   help="with --sparse-route auto: time the most promising sets of routes "
                   "in the job and keep the fastest (tfpar.Config(search_routes=True); "
                   "remembered for the next run), or 'force': time them again")
    p.add_argument("--ids-ahead", action="store_true",
                   help="with --sparse-route sharded (and no local aggregation): read the "
                   "input a step ahead and send the next batch's ids to their owners "
                   "during this step (tfpar.Config(ids_ahead=True))")
    p.add_argument("--allreduce-by-allgather", choices=("on", "off", "auto"), default="auto",
                   help="where the allgather route runs (AR mode): the dense gradients in "
                   "it too, one collective a step; where only the sharded route runs "
                   "(without local aggregation), in its gradients' all-to-all "
                   "(tfpar.Config(allreduce_by_allgather); "
                   "auto, the default: where the links were measured and it pays)")
    p.add_argument("--freeze-tables", action="store_true",
                   help="train only the dense layer (the embedding and softmax rows fixed): "
                        "the step with no sparse gradient, a floor for every sparse route")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--threads", type=int, help="TensorFlow intra-op threads per worker "
                   "(default: TensorFlow's choice, one per core)")
    p.add_argument("--json", help="write the timing and traffic summary here (worker 0)")
    args = p.parse_args()
    words = read_text(args.text, args.vocab) if args.text else zipf_text(args.vocab)
    graph, loss, train_op = build_graph(words, args.vocab, args.context,
                                        batch_size=args.batch_size,
                                        min_partitions=args.min_partitions,
                                        max_partitions=args.max_partitions,
                                        train_tables=not args.freeze_tables)
    config = tfpar.Config(run_mode=args.run_mode, partitions=args.partitions,
                          local_aggregation={"on": True, "off": False, "auto": "auto"}[
                              args.local_aggregation or ("off" if args.no_local_aggregation
                                                         else "on")],
                          sparse_route=args.sparse_route, sync=not args.asynchronous,
                          sharded_rows=args.sharded_rows, ps_rows=args.ps_rows,
                          search_routes={None: False, "on": True, "force": "force"}[
                              args.search_routes],
                          session_config=session_config(args.threads),
                          search_trials=args.search_trials, ids_ahead=args.ids_ahead,
                          allreduce_by_allgather=ON_OFF_AUTO[args.allreduce_by_allgather],
                          search_partitions="force" if args.search_again else "auto")

    with tfpar.get_runner(graph, config=config) as runner:     # tfpar line 2 of 2
        if runner.is_chief:
            print(runner.plan, flush=True)
        losses, last = [], time.time()
        for step in range(1, args.steps + 1):
            if step == args.warmup + 1:
                start, comm0 = time.time(), runner.communication(mean_over_workers=True)
            loss_v, _ = runner.run([loss, train_op])
            losses.append(loss_v)
            if step % args.log_every == 0 and runner.is_chief:
                now = time.time()
                words_s = args.log_every * args.batch_size * runner.num_workers / (now - last)
                print(f"step {step:5d}  loss {np.mean(losses[-args.log_every:]):.4f}  "
                      f"{words_s:.0f} words/s", flush=True)
                last = now
        timed = args.steps - args.warmup
        comm = runner.communication(mean_over_workers=True)  # waits for every worker, so
        elapsed = time.time() - start  # a worker that ran ahead (sync=False) waits for the rest
        per_step = {k: (comm[k] - comm0[k]) / timed for k in comm if k != "steps"}
        summary = {"mode": runner.plan.mode, "sync": runner.plan.sync,
                   "local_aggregation": runner.plan.local_aggregation,
                   "allreduce_by_allgather": runner.plan.allreduce_by_allgather,
                   "allreduce_by_alltoall": runner.plan.allreduce_by_alltoall,
                   "workers": runner.num_workers, "vocab": args.vocab,
                   "step_time_s": elapsed / timed,
                   "words_per_s": timed * args.batch_size * runner.num_workers / elapsed,
                   "bytes_per_step": per_step, "predicted_bytes_per_step":
                   runner.plan.predicted_bytes_per_step,
                   "routes": {v.name: v.route for v in runner.plan.variables
                              if v.role == "trained"},
                   "tilings": {v.name: str(v.tiling) for v in runner.plan.variables
                               if v.role == "trained" and v.tiling is not None},
                   "routing": runner.plan.routing and runner.plan.routing.to_dict(),
                   "loss_first": float(np.mean(losses[:args.log_every])),
                   "loss_last": float(np.mean(losses[-args.log_every:]))}
        if runner.is_chief:
            print(f"done: {args.steps} steps on {runner.num_workers} workers; "
                  f"{summary['words_per_s']:.0f} words/s; bytes per step per worker (mean): "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in per_step.items()), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
