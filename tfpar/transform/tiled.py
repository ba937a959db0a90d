"""The tiled rewrite: dense layers whose weights the plan splits run on tiles (route "tiled").

For every weight with route "tiled" the user's graph has a forward `MatMul(x, W)`,
perhaps a bias added to it (a bias variable, tiled or not), TensorFlow's backward of
both, and the optimizer's update of W and its slots. The rewrite, per layer:

- makes each worker's tile of W and of its slots variables of their own (initial values:
  worker 0's whole initial value, sliced), in collection `TILES`, so they are neither
  broadcast nor initialised as whole variables (`whole` and `tile_of` gather and scatter
  them for checkpoints and fetches);
- computes the layer on tiles (`tiles.dense`, exact-adjoint collectives), from the
  worker's own rows x to its own rows of the output, and makes the layer's consumers
  read that;
- takes the backward from TensorFlow's gradient of the tiled layer, seeded with the
  gradient the user's graph computes for the layer's output, and makes the user's
  backward read the new gradient of x;
- updates the tiles with copies of the user's own update ops (same optimizer, same
  hyper-parameters), which replace the originals in the training step.

A layer whose output only a sparse softmax cross-entropy reads (a language model's output
projection) keeps its logits split (`tiles.logits_tiling`, over the vocabulary for a
column split): the per-row loss comes from the split softmax (`tiles.softmax_cross_entropy`)
and replaces the user's, whose gradient seeds the backward; no worker computes a whole
row of logits.

Split layers one after the other (a dense layer, element-wise ops such as its activation,
the next dense layer, nothing else reading what is between them) form a chain (`_chains`):
the activations between them stay split, converted once from the tiling the first layer
makes to the one the next needs (Megatron's columns-then-rows: not at all), and the
element-wise ops run on the tiles (copies of the user's). Every chain starts from and ends
in the batch split (each worker's own rows), so layers that tfpar does not split, and the
loss, see the tensors they saw; `layer_bytes` counts what a layer moves, from the
exchanges alone. A gradient the user post-processes before the update
(`clip_by_global_norm`, `clip_by_norm`, element-wise scaling by scalars) is post-processed
on the tile (`_on_tile`): a sum over the whole gradient is its tiles' sums summed.
Layers on inputs [T, B, K] (tensordot: Reshape, MatMul, Reshape) are split the same way.
A split bias must join a split weight's layer (else refused: nobody would train it).
Not yet: other post-processing of a tiled weight's gradient (sums over some axes, ops
that mix elements), weights read by more than one
matmul, chains that fork, chains across tensordot's Reshapes.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfpar.errors import NotYetSupportedError, TfparError
from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import Tiling
from tfpar.plan import Plan, VariablePlan
from tfpar.graph import initializers
from tfpar.graph.row_reads import training_ops
from tfpar.transform import collectives, surgery, tiles
from tfpar.transform.outside_uses import OutsideUses, initialisers
from tfpar.graph.naming import safe_name

TILES = "tfpar_tiles"  # the collection of the tile variables


@dataclasses.dataclass
class TiledRewrite:
    """What the rewrite made: {variable name: its tile variable}, the new update ops, and
    {original tensor or op name: its replacement} for the runner's fetches."""

    tiles: Dict[str, tf.Variable]
    updates: List[Tuple[int, tf.Operation]]  # (update group, a new update op)
    replaced: Dict[str, object] = dataclasses.field(default_factory=dict)


def _reads(var_op: tf.Operation) -> List[tf.Tensor]:
    out = []
    for c in var_op.outputs[0].consumers():
        if c.type == "Identity" or c.type == "ReadVariableOp":
            out.append(c.outputs[0])
    return out


def initial_value(var_op: tf.Operation) -> tf.Tensor:
    value = initializers.initial_value(var_op)
    if value is None:
        raise NotYetSupportedError(f"cannot find the initial value of {var_op.name!r} (its "
                                   "initialiser), which splitting it needs")
    return value


def new_tile(graph, var_op, tiling, shape, rank, name):
    """A variable holding this worker's tile of `var_op`, from worker 0's initial value."""
    import horovod.tensorflow as hvd
    with tf.control_dependencies(None), tf.compat.v1.name_scope(None):
        whole = hvd.broadcast(collectives.never_folded(initial_value(var_op)), 0,
                              name=f"{name}/initial")
        value = whole[tiling.tile_slices(shape, rank)]
        return tf.compat.v1.Variable(value, name=name, trainable=False, collections=[TILES],
                                     use_resource=var_op.type == "VarHandleOp")


def apply_tiling(graph: tf.Graph, plan: Plan, rank: int, counter=None) -> Optional[TiledRewrite]:
    """Rewrites `graph` in place for the plan's route "tiled" (module doc)."""
    weights = [v for v in plan.variables if v.route == "tiled" and v.slot_of is None
               and len(v.shape) == 2]
    if not any(v.route == "tiled" for v in plan.variables):
        return None
    n = plan.num_workers
    by_name = {v.name: v for v in plan.variables}
    made: Dict[str, tf.Variable] = {}
    updates: List[tf.Operation] = []
    for w in weights:
        if w.tiling.devices != n:
            raise TfparError(f"the plan splits {w.name!r} over {w.tiling.devices} devices "
                             f"({w.tiling}), but the job has {n} workers: plan for {n}")
    # The user's own writes and reads of the split variables outside the training step,
    # found before the rewrite (`outside_uses`).
    keep = initialisers(graph) | training_ops(
        graph.get_operation_by_name(op) for v in plan.variables for g in v.gradients
        for op in g.ops)
    outside = {v.name: OutsideUses(graph.get_operation_by_name(v.name), keep)
               for v in plan.variables if v.route == "tiled" and v.slot_of is None}
    replaced: Dict[str, object] = {}
    with graph.as_default():
        for chain in _chains(graph, plan):
            _rewrite_chain(graph, plan, chain, by_name, rank, n, counter, made, updates)
        for name, uses in outside.items():
            if uses and name in made:
                v = by_name[name]
                replaced.update(uses.rewire(made[name], v.tiling, tuple(v.shape), rank, n,
                                            f"tfpar/tiled/{safe_name(name)}/outside"))
        _forget_whole(graph, made)
    return TiledRewrite(made, updates, replaced)


@dataclasses.dataclass
class _Layer:
    """A split weight's layer as the user's graph has it."""

    w: VariablePlan
    matmul: tf.Operation  # the forward x @ W
    x: tf.Tensor
    batch: int  # this worker's rows
    bias: Optional[VariablePlan]  # a tiled bias added to the product, if any
    out: tf.Tensor  # the layer's output the consumers read (after the bias)
    dy: tf.Tensor  # the gradient the user's graph computes for the product
    dx: List[tf.Tensor]  # the user's dX = dY W^T, if it computes one
    # The layer's output read only by a sparse softmax cross-entropy (an LM's output
    # layer): that op, and the gradient the user's graph computes for its per-row loss.
    xent: Optional[tf.Operation] = None
    dloss: Optional[tf.Tensor] = None
    # The split layer this one's output feeds in a chain, and the element-wise ops between.
    next: Optional["_Layer"] = None
    path: Tuple[tf.Operation, ...] = ()


def _layer(graph, w: VariablePlan, by_name) -> _Layer:
    w_op = graph.get_operation_by_name(w.name)
    forward = [c for r in _reads(w_op) for c in r.consumers()
               if c.type == "MatMul" and c.inputs[1] is r and not c.get_attr("transpose_b")
               and not c.get_attr("transpose_a")]
    if len(forward) != 1:
        raise NotYetSupportedError(
            f"tiling {w.name!r}: it must be the second operand of exactly one matmul x @ W, "
            f"found {len(forward)}; leave it out of Config.tiling")
    matmul = forward[0]
    x = matmul.inputs[0]
    batch = x.shape.as_list()[0]
    if batch is None:
        raise TfparError(f"tiling {w.name!r}: its input {x.name} needs a static batch size "
                         "(give the placeholder or dataset a fixed batch)")
    if not w.gradients:
        raise TfparError(f"tiling {w.name!r}: it is not trained (no gradient)")
    raw = graph.get_tensor_by_name(w.gradients[0].values)
    if w.gradients[0].post_processed:
        _post_processing(graph, w, raw)  # refused here if the rewrite cannot follow it
    while raw.op.type == "Identity":  # gate_gradients' tuple (control_dependency)
        raw = raw.op.inputs[0]
    if not (raw.op.type == "MatMul" and raw.op.get_attr("transpose_a") and raw.op.inputs[0] is x):
        raise NotYetSupportedError(f"tiling {w.name!r}: its gradient is not TensorFlow's "
                                   f"x^T dY ({raw.op.type} {raw.name})")
    dy = raw.op.inputs[1]
    dx = [c.outputs[0] for c in dy.consumers() if c.type == "MatMul"
          and c.get_attr("transpose_b") and c.inputs[1] in _reads(w_op)]
    # TensorFlow builds dX also for a first layer, whose input needs none: used or not is
    # what its consumers past gate_gradients' identities say.
    dx = [t for t in dx if _used(t)]
    # A bias added to the product (after tensordot's Reshape back to [..., M], for
    # inputs of more than two dimensions), if its variable is in the plan.
    out, bias = _regrouped(matmul.outputs[0]), None
    adds = [c for c in out.consumers() if c.type in ("BiasAdd", "AddV2", "Add")]
    for add in adds:
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        source = other.op.inputs[0].op if other.op.type in ("Identity", "ReadVariableOp") \
            else None
        # A tiled bias joins the layer; any other stays where it was, added to the
        # layer's (batch-split) output by the user's own op.
        if (source is not None and source.name in by_name
                and by_name[source.name].route == "tiled" and len(by_name[source.name].shape) == 1):
            bias, out = by_name[source.name], add.outputs[0]
            break
    xent, dloss = _softmax_after(out)
    return _Layer(w, matmul, x, batch, bias, out, dy, dx, xent, dloss)


def _regrouped(t: tf.Tensor) -> tf.Tensor:
    """`t` past the Reshapes that alone read it and only regroup its rows (tensordot's
    [rows, M] -> [T, B, M]; the cross-entropy's [T, B, M] -> [rows, M]): row order, the
    last dimension and the size kept, shapes static."""
    if not t.shape.is_fully_defined() or t.shape.rank < 2:
        return t
    m, size = t.shape.as_list()[-1], t.shape.num_elements()
    while True:
        users = [c for c in t.consumers() if c.type != "Shape"]
        if len(users) != 1 or users[0].type != "Reshape":
            return t
        shape = users[0].outputs[0].shape
        if not shape.is_fully_defined() or shape.rank < 2 or shape.as_list()[-1] != m \
                or shape.num_elements() != size:
            return t
        t = users[0].outputs[0]


def _softmax_after(out: tf.Tensor):
    """(the sparse softmax cross-entropy that alone reads `out` (or its rows regrouped,
    for logits [T, B, vocab]), the gradient of its loss in the user's graph), or
    (None, None)."""
    out = _regrouped(out)
    users = out.consumers()
    if len(users) != 1 or users[0].type != "SparseSoftmaxCrossEntropyWithLogits" \
            or users[0].inputs[0] is not out:
        return None, None
    xent = users[0]
    # TensorFlow's gradient: ExpandDims(dloss) * backprop (behind PreventGradient in some
    # versions).
    backprop = [xent.outputs[1]] + [c.outputs[0] for c in xent.outputs[1].consumers()
                                    if c.type == "PreventGradient"]
    for b in backprop:
        for m in b.consumers():
            if m.type == "Mul":
                other = m.inputs[0] if m.inputs[1] is b else m.inputs[1]
                if other.op.type == "ExpandDims":
                    return xent, other.op.inputs[0]
    return None, None


def _used(t: tf.Tensor) -> bool:
    while len(t.consumers()) == 1 and t.consumers()[0].type == "Identity":
        t = t.consumers()[0].outputs[0]
    return bool(t.consumers())


# Element-wise ops the activations between two chained layers can go through on tiles:
# each input is another such tensor of the same shape, or a scalar.
_ELEMENT_WISE = frozenset({
    "Identity", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus",
    "Softsign", "Erf", "Exp", "Square", "Neg", "Cast", "Mul", "AddV2", "Add", "Sub",
    "RealDiv", "Maximum", "Minimum"})


def _descendants(t: tf.Tensor) -> set:
    seen, stack = set(), [t]
    while stack:
        for c in stack.pop().consumers():
            if c not in seen:
                seen.add(c)
                stack.extend(c.outputs)
    return seen


def _reaches(t: tf.Tensor, target: tf.Operation) -> bool:
    seen, stack = set(), [t.op]
    while stack:
        op = stack.pop()
        if op is target:
            return True
        for i in op.inputs:
            if i.op not in seen:
                seen.add(i.op)
                stack.append(i.op)
    return False


def _between(a: _Layer, b: _Layer) -> Optional[Tuple[tf.Operation, ...]]:
    """The element-wise ops from layer a's output to layer b's input when a feeds b alone
    (nothing else in the forward pass reads them: the user's backward of them, which only
    runs from b's gradient, does not count), else None."""
    if a.xent is not None or a.batch != b.batch or \
            [c.parts for c in a.w.tiling.cuts] != [c.parts for c in b.w.tiling.cuts]:
        return None
    shape = a.out.shape.as_list()
    path, stack = set(), [b.x]
    while stack:
        t = stack.pop()
        if t is a.out:
            continue
        if t.op.type not in _ELEMENT_WISE or t.shape.as_list() != shape:
            return None
        if t.op in path:
            continue
        path.add(t.op)
        for i in t.op.inputs:
            if i.shape.rank == 0 and not _reaches(i, a.out.op):
                continue  # a scalar (a constant factor, LeakyRelu's slope as a tensor)
            stack.append(i)
    backward, memo = _descendants(b.dy), {}

    def for_backward(op):  # the user's backward, or what only it reads (a Shape for a Mul)
        if op not in memo:
            memo[op] = False
            users = [c for o in op.outputs for c in o.consumers()]
            memo[op] = op in backward or (bool(users) and all(for_backward(c) for c in users))
        return memo[op]
    for t in [a.out] + [o for op in path for o in op.outputs]:
        for c in t.consumers():
            if c not in path and c is not b.matmul and not for_backward(c):
                return None
    return tuple(sorted(path, key=lambda op: op.name))


def _chains(graph: tf.Graph, plan: Plan) -> List[List[_Layer]]:
    """The plan's split layers in chains (module doc), each in forward order."""
    by_name = {v.name: v for v in plan.variables}
    layers = [_layer(graph, w, by_name) for w in plan.variables
              if w.route == "tiled" and w.slot_of is None and len(w.shape) == 2]
    # Every other split variable must be a layer's bias (or a slot of one): one the
    # rewrite did not take up would be trained by nobody.
    joined = {layer.bias.name for layer in layers if layer.bias is not None}
    for v in plan.variables:
        if v.route == "tiled" and v.slot_of is None and len(v.shape) != 2 \
                and v.name not in joined:
            raise NotYetSupportedError(
                f"tiling {v.name!r}: it is not the bias added to the product x @ W of a "
                "weight split with it; split its weight too, or leave it out of "
                "Config.tiling")
    fed = set()
    for a in layers:
        for b in layers:
            if b is not a and id(b) not in fed:
                path = _between(a, b)
                if path is not None:
                    a.next, a.path = b, path
                    fed.add(id(b))
                    break
    chains = []
    for head in layers:
        if id(head) in fed:
            continue
        chain = [head]
        while chain[-1].next is not None:
            chain.append(chain[-1].next)
        chains.append(chain)
    return chains


def _boundaries(chain: List[_Layer]) -> List[Tuple[Tiling, Tiling]]:
    """(the tiling each layer of a chain reads its input in, the one it leaves its output
    in): the chain's ends in the batch split (a language model's output layer ends in its
    logits' split), an activation inside in the tiling the next layer reads it in."""
    x = tiles.batch_split([c.parts for c in chain[0].w.tiling.cuts])
    rows, out = x, []
    for layer in chain:
        if layer.next is not None:
            y = tiles.forms(layer.next.w.tiling)[0]
        elif layer.xent is not None:
            y = tiles.logits_tiling(tiles.forms(layer.w.tiling)[1])
        else:
            y = rows
        out.append((x, y))
        x = y
    return out


def chains(graph: tf.Graph, plan: Plan) -> List[List[str]]:
    """The plan's split weights in chains of layers whose activations stay split between
    them (each chain in forward order; a lone layer is a chain of one)."""
    return [[layer.w.name for layer in chain] for chain in _chains(graph, plan)]


def layer_bytes(w: Tiling, shape, batch: int, bias: Optional[Tiling] = None,
                input_gradient: bool = True, itemsize: int = 4,
                softmax: bool = False, x_from: Optional[Tiling] = None,
                y_to: Optional[Tiling] = None) -> float:
    """Bytes per worker per step (sent plus received, the mean over workers) that the
    rewrite's layer moves: X from the tiling it arrives in (`x_from`; default the batch
    split) into the form `w` needs and its adjoint (when dX is computed), the product into
    the tiling its consumer reads (`y_to`; default the batch split, with `softmax` the
    logits' split, then the split softmax's exchanges) and its adjoint, the gradient of
    replicated tiles summed, and the bias likewise. Pure: what the plan shows before the
    job runs, and what `communication()["tiled"]` measures."""
    k, m = shape
    n = w.devices
    rows = tiles.batch_split([c.parts for c in w.cuts])
    need_x, made_y = tiles.forms(w)
    x = x_from if x_from is not None else rows
    y = y_to if y_to is not None else (tiles.logits_tiling(made_y) if softmax else rows)
    elements = (redistribution.moved(x, need_x, (batch, k)) * (2 if input_gradient else 1)
                + 2 * redistribution.moved(made_y, y, (batch, m))
                + redistribution.moved(tiles.summed(w), w, (k, m)))
    if bias is not None:
        elements += (2 * redistribution.moved(bias, tiles.bias_tiling(y), (m,))
                     + redistribution.moved(tiles.summed(bias), bias, (m,)))
    moved = elements * itemsize
    if softmax:
        moved += tiles.softmax_moved_bytes(y, batch, rows, itemsize)
    return 2.0 * moved / n


def predicted_bytes(graph: tf.Graph, plan: Plan) -> Dict[str, float]:
    """{split weight: `layer_bytes` of its layer in `graph`, in its chain} for the plan's
    tiled weights (biases count with their layer). Raises for a weight the rewrite cannot
    split."""
    out = {}
    for chain in _chains(graph, plan):
        for i, (layer, (x_from, y_to)) in enumerate(zip(chain, _boundaries(chain))):
            w = layer.w
            out[w.name] = layer_bytes(w.tiling, tuple(w.shape), layer.batch * plan.num_workers,
                                      layer.bias.tiling if layer.bias else None,
                                      bool(layer.dx) or i > 0, tf.as_dtype(w.dtype).size,
                                      layer.xent is not None, x_from, y_to)
    return out


def _rewrite_chain(graph, plan, chain: List[_Layer], by_name, rank, n, counter, made,
                   updates):
    first = chain[0]
    global_batch = first.batch * n
    x = first.x
    reads = []  # per layer: (its weight's tile read, its bias's or None, its scope)
    for layer, (x_tiling, y_tiling) in zip(chain, _boundaries(chain)):
        w, bias = layer.w, layer.bias
        w_op = graph.get_operation_by_name(w.name)
        shape = tuple(w.shape)
        scale = 1.0 / n if w.reduction != "sum" else 1.0
        scope = f"tfpar/tiled/{safe_name(w.name)}"
        with tf.compat.v1.name_scope(scope + "/"):
            w_tile = new_tile(graph, w_op, w.tiling, shape, rank, f"{scope}/tile")
            made[w.name] = w_tile
            w_read = w_tile.value() if hasattr(w_tile, "value") else tf.identity(w_tile)
            w_used = tiles.replicated(w_read, w.tiling, shape, rank, scale, counter, "W")
            b_read = b_used = b_tiling = None
            if bias is not None:
                b_tiling = bias.tiling
                b_var = new_tile(graph, graph.get_operation_by_name(bias.name), b_tiling,
                                  tuple(bias.shape), rank, f"{scope}/bias_tile")
                made[bias.name] = b_var
                b_read = b_var.value()
                b_used = tiles.replicated(b_read, b_tiling, tuple(bias.shape), rank, scale,
                                          counter, "b")
            reads.append((w_read, b_read, scope))
            y = tiles.dense(x, x_tiling, global_batch, w_used, w.tiling, shape, y_tiling,
                            rank, b_used, b_tiling, counter, name="layer")
            if layer.next is not None:  # the activation, on tiles, into the next layer
                copies = surgery.clone_ops(layer.path, {layer.out: y}, "then/",  # in scope
                                           lambda op, ins: op.device)
                nx = layer.next.x
                x = copies[nx.op].outputs[nx.value_index] if nx.op in copies else y
            elif layer.xent is not None:  # an LM's output layer: no worker holds a row
                rows = tiles.batch_split([c.parts for c in w.tiling.cuts])
                y = tiles.softmax_cross_entropy(y, y_tiling, global_batch, shape[1],
                                                layer.xent.inputs[1], rows, rank, counter)
                surgery.replace_uses(layer.xent.outputs[0], y)
                seed = layer.dloss
            else:  # (regrouped as the user's product was, for inputs [T, B, K])
                surgery.replace_uses(layer.out, y if y.shape == layer.out.shape
                                     else tf.reshape(y, layer.out.shape))
                seed = layer.dy
    wrt = [t for w_read, b_read, _ in reads for t in (w_read, b_read) if t is not None]
    with tf.compat.v1.name_scope(reads[-1][2] + "/"):
        # dX only where the user's graph computes it (not for a first layer's input).
        grads = tf.gradients(y, ([first.x] if first.dx else []) + wrt, grad_ys=seed)
        grads = grads if first.dx else [None] + grads
        # Gated as the optimizer's GATE_OP gates them: a reference variable's read aliases
        # its buffer, so the in-place update of W must wait for dX = dY W^T.
        present = [g for g in grads if g is not None]
        gated = iter(tf.tuple(present, name="gate"))
        grads = [next(gated) if g is not None else None for g in grads]
    if first.dx and grads[0] is not None:
        old = first.dx[0]
        # Past gate_gradients' identity, whose control input would still run the old
        # backward (and read the whole weight, which no longer exists).
        while len(old.consumers()) == 1 and old.consumers()[0].type == "Identity":
            old = old.consumers()[0].outputs[0]
        surgery.replace_uses(old, grads[0])
    new_grads = iter(grads[1:])
    for layer, (_, b_read, scope) in zip(chain, reads):
        w_op = graph.get_operation_by_name(layer.w.name)
        _replace_update(graph, layer.w, w_op, made[layer.w.name], next(new_grads), by_name,
                        rank, scope, made, updates)
        if b_read is not None:
            bias = layer.bias
            _replace_update(graph, bias, graph.get_operation_by_name(bias.name),
                            made[bias.name], next(new_grads), by_name, rank, scope + "/bias",
                            made, updates)


# Element-wise ops: the post-processing of a gradient (clip_by_global_norm's scaling,
# clip_by_norm's, a constant factor) that a tile goes through, where every operand from
# outside the post-processing is a scalar (checked in `_post_processing`).
_TILE_WISE = frozenset({"Identity", "Mul", "RealDiv", "Div", "Cast", "Neg", "Maximum",
                        "Minimum", "ClipByValue", "Square", "Sqrt", "Rsqrt", "AddV2", "Add",
                        "Sub", "Greater", "GreaterEqual", "Less", "LessEqual", "Select",
                        "SelectV2", "OnesLike", "ZerosLike"})


def _sums_whole(op: tf.Operation) -> bool:
    """Whether `op` sums its input over every axis (clip_by_norm's squared norm)."""
    if op.type != "Sum" or op.inputs[0].shape.rank is None:
        return False
    axes = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    return axes is not None and {int(a) % rank for a in np.ravel(axes)} == set(range(rank))


def _post_processing(graph, v: VariablePlan, raw: tf.Tensor):
    """(the ops from `v`'s raw gradient to what its update reads, the `L2Loss`es of the
    whole gradient that a global norm sums), refusing what a tile cannot go through.

    Element-wise ops follow a tile as they are; a sum over every axis (the squared norm
    that clip_by_norm divides by) becomes its tile's sum summed over the workers."""
    final = graph.get_tensor_by_name(v.gradients[0].final_values or v.gradients[0].values)
    ahead, stack = set(), [raw.op]
    while stack:
        op = stack.pop()
        if op.type == "L2Loss":
            continue  # a global norm's term: what it feeds is the norm, not this gradient
        for t in op.outputs:
            for c in t.consumers():
                if c not in ahead:
                    ahead.add(c)
                    stack.append(c)
    behind, stack = {final.op}, [final.op]
    while stack:
        for t in stack.pop().inputs:
            if t.op not in behind and t.op in ahead:
                behind.add(t.op)
                stack.append(t.op)
    path = [op for op in ahead & behind]
    norms = []
    for t in [raw] + [o for op in path for o in op.outputs]:
        for c in t.consumers():
            if c in behind:
                continue
            if c.type == "L2Loss":  # clip_by_global_norm's term of this gradient
                norms.append(c)
            elif c.name not in v.gradients[0].ops:
                raise NotYetSupportedError(
                    f"tiling {v.name!r}: its gradient is read by {c.type} {c.name!r}, which "
                    f"needs the whole gradient ({_FOLLOWED} are followed on tiles)")
    odd = [op for op in path if op.type not in _TILE_WISE and not _sums_whole(op)]
    if odd:
        raise NotYetSupportedError(
            f"tiling {v.name!r}: its gradient goes through {odd[0].type} {odd[0].name!r} "
            f"before the update; {_FOLLOWED} are followed on tiles")
    members = set(path)
    for op in path:
        for t in op.inputs[:1] if _sums_whole(op) else op.inputs:
            if t is raw or t.op in members:
                continue
            if not t.shape.is_fully_defined() or t.shape.num_elements() != 1:
                # A whole-shaped operand would not fit (or would broadcast into) a tile.
                raise NotYetSupportedError(
                    f"tiling {v.name!r}: its gradient's post-processing {op.type} "
                    f"{op.name!r} also reads {t.name!r} of shape {t.shape}; only scalars "
                    f"beside the gradient are followed on tiles ({_FOLLOWED})")
    return path, norms, final


_FOLLOWED = ("global-norm clipping, clipping by the gradient's own norm and element-wise "
             "scaling")


def _replicas(tiling: Tiling) -> int:
    n = 1
    for c in tiling.cuts:
        n *= c.parts if c.dim is None else 1
    return n


def _on_tile(graph, v: VariablePlan, grad: tf.Tensor, rank: int, scope: str):
    """(the tensor `v`'s update reads, its value for the tile's gradient `grad`): the
    user's post-processing of the whole gradient applied to the tile. A sum over the
    whole gradient (a global norm's `L2Loss` term, clip_by_norm's squared norm) becomes
    the sum over the workers of their tiles' sums (each tile once), one scalar Horovod
    allreduce (not in communication())."""
    raw = graph.get_tensor_by_name(v.gradients[0].values)
    if not v.gradients[0].post_processed:
        return raw, grad
    path, norms, final = _post_processing(graph, v, raw)
    copies = surgery.clone_ops(path, {raw: grad}, f"{scope}/post/", lambda op, ins: op.device)

    def on_tile(t: tf.Tensor) -> tf.Tensor:
        return grad if t is raw else copies[t.op].outputs[t.value_index]

    replicas = float(_replicas(v.tiling))
    with tf.compat.v1.name_scope(f"{scope}/post/"):
        for i, op in enumerate(sorted((op for op in path if _sums_whole(op)),
                                      key=lambda o: o.name)):
            mine = copies[op].outputs[0]
            share = mine / replicas
            surgery.replace_uses(mine, _sum_over_workers(share, f"{safe_name(scope)}_sum_{i}"),
                                 keep=[share.op])
        for i, l2 in enumerate(norms):
            # The L2Loss of the tensor it reads (the raw gradient, or one scaled first).
            mine = tf.nn.l2_loss(on_tile(l2.inputs[0])) / replicas
            surgery.replace_uses(l2.outputs[0], _sum_over_workers(
                mine, f"{safe_name(scope)}_norm_{i}"))
    return final, on_tile(final) if path else grad


def _sum_over_workers(x: tf.Tensor, name: str) -> tf.Tensor:
    """`x` (a small tensor) summed over every worker, in x's shape."""
    import horovod.tensorflow as hvd
    flat = tf.reshape(x, [-1])
    total = hvd.allreduce(collectives.never_folded(flat), op=hvd.Sum, name=name)
    return tf.reshape(total, tf.shape(x) if not x.shape.is_fully_defined() else x.shape)


def _replace_update(graph, v: VariablePlan, var_op, tile, grad, by_name, rank, scope, made,
                    updates):
    """A copy of the user's update of `v` on its tile, its slots' tiles and `grad`."""
    read, grad = _on_tile(graph, v, grad, rank, scope)
    apply = [c for c in read.consumers() if c.name in v.gradients[0].ops]
    if len(apply) != 1:
        raise NotYetSupportedError(f"tiling {v.name!r}: expected one update op reading its "
                                   f"gradient, found {[c.name for c in apply]}")
    apply = apply[0]
    inputs = {var_op.outputs[0]: surgery.variable_input(tile), read: grad}
    for t in apply.inputs:
        slot = t.op
        if slot is var_op or slot.type not in ("VariableV2", "VarHandleOp"):
            continue
        plan_slot = by_name.get(slot.name)
        if plan_slot is None or plan_slot.slot_of != v.name:
            continue  # shared optimizer state (Adam's beta powers)
        slot_tile = new_tile(graph, slot, v.tiling, tuple(v.shape), rank,
                              f"{scope}/{safe_name(slot.name.rsplit('/', 1)[-1])}_tile")
        made[slot.name] = slot_tile
        inputs[slot.outputs[0]] = surgery.variable_input(slot_tile)
    new = surgery.clone_ops([apply], inputs, f"{scope}/update/",
                            lambda op, ins: op.device)[apply]
    for op in graph.get_operations():
        if apply in op.control_inputs:
            surgery.replace_control_inputs(op, [apply], new)
    updates.append((v.gradients[0].group, new))


def _forget_whole(graph: tf.Graph, made: Dict[str, tf.Variable]):
    """The whole variables that tiles replace leave the collections (not initialised,
    broadcast or trained; their memory is never allocated)."""
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
        ref = graph.get_collection_ref(key)
        ref[:] = [v for v in ref if v.op.name not in made]
