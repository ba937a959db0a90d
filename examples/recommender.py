"""A click-through-rate recommender as TensorFlow's canned wide-and-deep estimators build it:
several categorical features with skewed (Zipf) ids, one table large, a linear part
trained with FTRL and a deep part with Adagrad, all from `tf.feature_column`; trained
with tfpar.

    horovodrun -np 4 -H localhost:4 python examples/recommender.py --sparse-route auto

The data is generated (no download): each example draws a user, an item, the item's
category, an hour of the week and a device, each id Zipf-distributed over its vocabulary,
and a click that depends on them. Every vocabulary-sized variable (the linear weights and
the embeddings of each feature) is sparse; `--sparse-route` chooses how they travel, and
"auto" routes each by its measured density (the small tables to a dense allreduce, the
large ones to the parameter servers, an allgather or sharded rows).
"""
import argparse
import json
import time

import numpy as np
import tensorflow as tf

import tfpar

tf1 = tf.compat.v1
ON_OFF_AUTO = {"on": True, "off": False, "auto": "auto"}

# feature -> (vocabulary, embedding width, Zipf exponent); "item"'s vocabulary is --items.
FEATURES = {"user": (100_000, 16, 1.05), "item": (None, 32, 1.1), "category": (300, 8, 1.2),
            "hour": (168, 4, 0.0), "device": (12, 4, 1.5)}


def feature_ids(n, items, seed=0):
    """{feature: int64 ids [n]} drawn from each vocabulary with Zipf weights (exponent 0:
    uniform); an item's category follows from the item."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, (vocab, _, exponent) in FEATURES.items():
        vocab = vocab or items
        if name == "category":
            continue
        weights = 1.0 / np.arange(1, vocab + 1) ** exponent
        ranked = rng.choice(vocab, size=n, p=weights / weights.sum())
        out[name] = rng.permutation(vocab)[ranked].astype(np.int64)  # popular ids spread out
    out["category"] = (out["item"] * 2654435761 % FEATURES["category"][0]).astype(np.int64)
    return out


def build_graph(items=500_000, batch_size=512, examples=200_000, feed=False, seed=0,
                train_tables=True):
    """The single-device training graph; returns (graph, loss, train_op).

    feed: read every feature and the click from placeholders (`<feature>` [batch, 1]
    int64, `click` [batch, 1] float32) instead of the generated examples (for tests).
    train_tables: False keeps the linear part and the embeddings fixed (only the DNN's
    dense layers train): no sparse gradient to send, a floor for every route's step."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        if feed:
            features = {name: tf1.placeholder(tf.int64, [None, 1], name=name)
                        for name in FEATURES}
            click = tf1.placeholder(tf.float32, [None, 1], name="click")
        else:
            ids = feature_ids(examples, items, seed)
            # A click depends on the user and the item (and a little on the hour).
            score = ((ids["user"] * 7 + ids["item"] * 13) % 100 + ids["hour"] % 24) / 123.0
            clicks = tf.constant((score > 0.6).astype(np.float32)[:, None])
            columns = {name: tf.constant(v[:, None]) for name, v in ids.items()}
            rows = tfpar.shard(tf.data.Dataset.range(examples))          # tfpar line 1 of 2
            rows = rows.shuffle(50_000, seed=0).repeat().batch(batch_size, drop_remainder=True)
            at = tf1.data.make_one_shot_iterator(rows).get_next()
            features = {name: tf.gather(c, at) for name, c in columns.items()}
            click = tf.gather(clicks, at)
        fc = tf.feature_column
        categorical = {name: fc.categorical_column_with_identity(name, vocab or items)
                       for name, (vocab, _, _) in FEATURES.items()}
        with tf1.variable_scope("linear"):
            linear_logits = tf1.feature_column.linear_model(
                features, list(categorical.values()), trainable=train_tables)
        with tf1.variable_scope("dnn"):
            init = tf1.truncated_normal_initializer(stddev=0.05, seed=2)
            net = tf1.feature_column.input_layer(features, [
                fc.embedding_column(categorical[name], FEATURES[name][1], initializer=init,
                                    trainable=train_tables)
                for name in FEATURES])
            for i, units in enumerate((64, 32)):
                net = tf1.layers.dense(net, units, tf.nn.relu, name=f"hiddenlayer_{i}",
                                       kernel_initializer=tf1.glorot_uniform_initializer(seed=3))
            dnn_logits = tf1.layers.dense(net, 1, name="logits",
                                          kernel_initializer=tf1.glorot_uniform_initializer(seed=4))
        loss = tf1.losses.sigmoid_cross_entropy(click, linear_logits + dnn_logits)
        step = tf1.train.get_or_create_global_step()
        linear = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "linear")
        dnn = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "dnn")
        train_op = tf.group(*([tf1.train.FtrlOptimizer(0.05).minimize(loss, var_list=linear)]
                              if linear else []),
                            tf1.train.AdagradOptimizer(0.05).minimize(loss, var_list=dnn))
        with tf.control_dependencies([train_op]):
            train_op = tf1.assign_add(step, 1)  # as a canned estimator's head does
    return graph, loss, train_op


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--vocab", "--items", dest="items", type=int, default=500_000,
                   help="the item vocabulary (the large table)")
    p.add_argument("--batch-size", type=int, default=512, help="examples per worker per step")
    p.add_argument("--run-mode", default="HYBRID", help="HYBRID (default), AR or PS")
    p.add_argument("--sparse-route", default="auto",
                   choices=("ps", "allreduce", "allgather", "sharded", "auto"))
    p.add_argument("--partitions", type=int, default=None,
                   help="parts per sparse variable on the parameter servers")
    p.add_argument("--no-local-aggregation", action="store_true",
                   help="each worker's rows straight to the other hosts (--local-aggregation off)")
    p.add_argument("--local-aggregation", choices=("on", "off", "auto"),
                   help="sum a host's row gradients (and de-duplicate its lookups) before "
                        "they cross its link; auto: measured")
    p.add_argument("--search-routes", nargs="?", const="on", choices=("on", "force"),
                   help="with --sparse-route auto: time the most promising sets of routes "
                   "in the job and keep the fastest (tfpar.Config(search_routes=True); "
                   "remembered for the next run), or 'force': time them again")
    p.add_argument("--search-trials", type=int, default=5,
                   help="at most this many route trials (with --search-routes)")
    p.add_argument("--ids-ahead", action="store_true",
                   help="with --sparse-route sharded (and no local aggregation): read the "
                   "input a step ahead and send the next batch's ids to their owners "
                   "during this step (tfpar.Config(ids_ahead=True))")
    p.add_argument("--sharded-rows", choices=("auto", "modulo", "ranges"), default="auto",
                   help="tables on route sharded: row i on worker i %% N (modulo), or each "
                   "worker a range of rows; auto (the default): as the job measures the "
                   "ids where it measures them, else modulo (tfpar.Config(sharded_rows))")
    p.add_argument("--allreduce-by-allgather", choices=("on", "off", "auto"), default="auto",
                   help="where the allgather route runs (AR mode): the dense gradients in "
                   "it too, one collective a step; where only the sharded route runs "
                   "(without local aggregation), in its gradients' all-to-all "
                   "(tfpar.Config(allreduce_by_allgather); "
                   "auto, the default: where the links were measured and it pays)")
    p.add_argument("--freeze-tables", action="store_true",
                   help="train only the DNN's dense layers (the linear part and the "
                        "embeddings fixed): the step with no sparse gradient, a floor for "
                        "every route")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", help="write the timing and traffic summary here (worker 0)")
    args = p.parse_args()

    graph, loss, train_op = build_graph(args.items, args.batch_size,
                                        train_tables=not args.freeze_tables)
    config = tfpar.Config(run_mode=args.run_mode, partitions=args.partitions,
                          sparse_route=args.sparse_route if args.run_mode == "HYBRID" else "ps",
                          local_aggregation={"on": True, "off": False, "auto": "auto"}[
                              args.local_aggregation
                              or ("off" if args.no_local_aggregation else "on")],
                          search_routes={None: False, "on": True, "force": "force"}[
                              args.search_routes], search_trials=args.search_trials,
                          ids_ahead=args.ids_ahead, sharded_rows=args.sharded_rows,
                          allreduce_by_allgather=ON_OFF_AUTO[args.allreduce_by_allgather])
    with tfpar.get_runner(graph, config=config) as runner:              # tfpar line 2 of 2
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
                rate = args.log_every * args.batch_size * runner.num_workers / (now - last)
                print(f"step {step:5d}  loss {np.mean(losses[-args.log_every:]):.4f}  "
                      f"{rate:.0f} examples/s", flush=True)
                last = now
        timed = args.steps - args.warmup
        comm = runner.communication(mean_over_workers=True)  # waits for every worker
        elapsed = time.time() - start
        per_step = {k: (comm[k] - comm0[k]) / timed for k in comm if k != "steps"}
        summary = {"mode": runner.plan.mode, "workers": runner.num_workers,
                   "local_aggregation": runner.plan.local_aggregation,
                   "allreduce_by_allgather": runner.plan.allreduce_by_allgather,
                   "allreduce_by_alltoall": runner.plan.allreduce_by_alltoall,
                   "vocab": args.items, "step_time_s": elapsed / timed,
                   "words_per_s": timed * args.batch_size * runner.num_workers / elapsed,
                   "bytes_per_step": per_step,
                   "predicted_bytes_per_step": runner.plan.predicted_bytes_per_step,
                   "routes": {v.name: v.route for v in runner.plan.variables
                              if v.role == "trained"},
                   "routing": runner.plan.routing and runner.plan.routing.to_dict(),
                   "loss_first": float(np.mean(losses[:args.log_every])),
                   "loss_last": float(np.mean(losses[-args.log_every:]))}
        if runner.is_chief:
            print(f"done: {args.steps} steps on {runner.num_workers} workers; "
                  f"{summary['words_per_s']:.0f} examples/s; bytes per step per worker "
                  "(mean): " + ", ".join(f"{k} {v:,.0f}" for k, v in per_step.items()),
                  flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
