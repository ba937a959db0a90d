"""The only place tfpar touches private TensorFlow APIs.

Rewrites need to rewire existing ops and change constants in place, which TensorFlow's
public API cannot do; a parameter server's process needs TensorFlow's server alone
(`server_only`). Keeping every private call here means a TensorFlow upgrade breaks one
small module, and its tests say so.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Callable, Dict, Iterable, List, Tuple


class _TensorFlow:
    """`tensorflow`, imported on first use: `server_only` must run before it is."""

    def __getattr__(self, name):
        import tensorflow
        return getattr(tensorflow, name)


tf = _TensorFlow()


def server_only() -> Tuple[type, type, type]:
    """TensorFlow's gRPC server: (`tf.distribute.Server`, `tf.train.ClusterSpec`,
    `tf.compat.v1.ConfigProto`), loaded without TensorFlow's API (its package's
    `__init__` imports every API module and Keras: 2.5 s of a core against 0.4 s for the
    server's modules, which every parameter server's start paid). The server and every
    kernel are the same C++ library's. Only for a process that needs nothing else: in one
    that has not imported `tensorflow`, the package is registered without its API, which
    it then never gets."""
    if "tensorflow" not in sys.modules:
        spec = importlib.util.find_spec("tensorflow")
        package = types.ModuleType("tensorflow")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["tensorflow"] = package
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.training import server_lib
    return server_lib.Server, server_lib.ClusterSpec, config_pb2.ConfigProto


def replace_uses(old: tf.Tensor, new: tf.Tensor, keep: Iterable[tf.Operation] = ()) -> int:
    """Makes every consumer of `old` (except the ops in `keep`) read `new`; returns how many."""
    keep = set(keep)
    count = 0
    for consumer in list(old.consumers()):
        if consumer in keep:
            continue
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer._update_input(i, new)  # pylint: disable=protected-access
                count += 1
    return count


@contextlib.contextmanager
def in_context_of(op: tf.Operation):
    """Ops created inside are in `op`'s control-flow context (a TF1 cond or while loop),
    as if built beside it."""
    graph = op.graph
    # pylint: disable=protected-access
    outer = graph._get_control_flow_context()
    graph._set_control_flow_context(op._get_control_flow_context())
    try:
        yield
    finally:
        graph._set_control_flow_context(outer)


def replace_input(op: tf.Operation, index: int, new: tf.Tensor) -> None:
    """Makes input `index` of `op` read `new`."""
    op._update_input(index, new)  # pylint: disable=protected-access


def set_device(op: tf.Operation, device: str) -> None:
    """Places an existing op."""
    op._set_device(device)  # pylint: disable=protected-access


def set_container(op: tf.Operation, container: str) -> None:
    """Puts the resource `op` makes (a variable) in `container` of its device."""
    from tensorflow.core.framework import attr_value_pb2
    op._set_attr("container", attr_value_pb2.AttrValue(  # pylint: disable=protected-access
        s=container.encode()))


def place_apart(op: tf.Operation, device: str) -> None:
    """Places an existing op on `device` and drops its colocation with other ops (TF1's
    cond colocates a variable's Switch with the variable, which may stay elsewhere)."""
    if "_class" in op.node_def.attr:
        op._clear_attr("_class")  # pylint: disable=protected-access
    op._set_device(device)  # pylint: disable=protected-access


def drop_colocation(graph: tf.Graph, names: Iterable[str]) -> int:
    """Removes every op's colocation with the ops `names` (e.g. variables the PS rewrite
    moved: `colocate_gradients_with_ops` and `embedding_lookup` colocate ops with their
    variable, which would pin them to a device the rewrite no longer uses); returns how
    many ops changed. Each op keeps its own device and its other colocations."""
    gone = {f"loc:@{n}".encode() for n in names}
    changed = 0
    for op in graph.get_operations():
        attr = op.node_def.attr.get("_class")
        if attr is None or not gone.intersection(attr.list.s):
            continue
        kept = [c for c in attr.list.s if c not in gone]
        if kept:
            op._set_attr("_class", tf.compat.v1.AttrValue(  # pylint: disable=protected-access
                list=tf.compat.v1.AttrValue.ListValue(s=kept)))
        else:
            op._clear_attr("_class")  # pylint: disable=protected-access
        changed += 1
    return changed


def replace_control_inputs(op: tf.Operation, old: Iterable[tf.Operation],
                           new: tf.Operation) -> bool:
    """Makes `op` wait for `new` instead of any op in `old`, and for what those waited for
    (their own control inputs outside `old`); returns whether it changed."""
    old = set(old)
    current = list(op.control_inputs)
    if not any(c in old for c in current):
        return False
    kept, stack, seen = [], list(current), set()
    while stack:
        c = stack.pop(0)
        if c in seen:
            continue
        seen.add(c)
        if c in old:
            stack.extend(c.control_inputs)
        else:
            kept.append(c)
    op._remove_all_control_inputs()  # pylint: disable=protected-access
    op._add_control_inputs(list(dict.fromkeys(kept + [new])))  # pylint: disable=protected-access
    return True


def add_control_inputs(op: tf.Operation, deps: Iterable[tf.Operation]) -> None:
    op._add_control_inputs([d for d in deps if d not in op.control_inputs])  # pylint: disable=protected-access


def clone_ops(ops: Iterable[tf.Operation], inputs: Dict[tf.Tensor, tf.Tensor], scope: str,
              device_of: Callable[[tf.Operation, List[tf.Tensor]], str], strip_prefix: str = "",
              keep_control: Callable[[tf.Operation], bool] = lambda op: True
              ) -> Dict[tf.Operation, tf.Operation]:
    """Copies a set of ops (types, attributes, wiring among themselves) under name `scope`.

    Inputs from outside the set are taken from `inputs` when listed there, else shared with
    the originals. Colocation attributes are dropped: `device_of(op, new_inputs)` places
    each copy. Control inputs from outside the set are kept where `keep_control` says so.
    Returns {original: copy}.
    """
    ops = list(ops)
    members = set(ops)
    order, seen = [], set()

    def visit(op):
        if op in seen:
            return
        seen.add(op)
        for dep in [t.op for t in op.inputs] + list(op.control_inputs):
            if dep in members:
                visit(dep)
        order.append(op)

    for op in sorted(ops, key=lambda o: o.name):
        visit(op)
    graph = ops[0].graph if ops else None
    copies: Dict[tf.Operation, tf.Operation] = {}
    for op in order:
        new_inputs = [copies[t.op].outputs[t.value_index] if t.op in copies
                      else inputs.get(t, t) for t in op.inputs]
        attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
        suffix = (op.name[len(strip_prefix):] if strip_prefix and op.name.startswith(strip_prefix)
                  else op.name.rsplit("/", 1)[-1])
        new = graph._create_op_internal(  # pylint: disable=protected-access
            op.type, new_inputs, [o.dtype for o in op.outputs], name=scope + suffix,
            attrs=attrs, op_def=op.op_def, compute_device=False)
        new._set_device(device_of(op, new_inputs))  # pylint: disable=protected-access
        deps = [copies.get(c, c) for c in op.control_inputs if c in copies or keep_control(c)]
        if deps:
            new._add_control_inputs(deps)  # pylint: disable=protected-access
        copies[op] = new
    return copies


def variable_input(var) -> tf.Tensor:
    """What an update op reads to write `var`: a resource variable's handle, or a
    reference variable's ref tensor (which only a private method returns)."""
    if var.op.type == "VarHandleOp":
        return var.handle
    return var._ref()  # pylint: disable=protected-access


def fetch_target(var):
    """What a session fetches for a `tf.Variable` that is the result of an assignment
    (`assign(v, x)` on a resource variable returns one): its value read after the
    assignment. None for an ordinary variable (fetched as its value)."""
    element = getattr(var, "_graph_element", None)  # what Session.run itself fetches
    if not isinstance(element, tf.Tensor) or var.op.type in ("VarHandleOp", "VariableV2"):
        return None
    return element


def session_base() -> type:
    """TensorFlow's session interface, for a session-like wrapper that Saver accepts."""
    from tensorflow.python.client import session  # pylint: disable=import-outside-toplevel
    return session.SessionInterface


def default_session(session):
    """A context in which `session` is the default session (`tensor.eval()`, `op.run()`,
    `tf.compat.v1.get_default_session()`), as `Session.as_default()` makes one."""
    from tensorflow.python.framework import stack  # pylint: disable=import-outside-toplevel
    return stack.default_session(session)


# Stateful random ops: each kernel draws the next numbers of its seed's sequence per run.
_RANDOM = ("RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
           "ParameterizedTruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
           "RandomGammaV2", "RandomPoisson", "RandomPoissonV2")


def with_own_draws(ops: List[tf.Operation], scope: str) -> List[tf.Operation]:
    """`ops` (initialisers, say), with the stateful random ops they read and every op
    between copied under `scope`: running the copies draws the same numbers as the first
    run of the originals would (a copy is a new kernel with the same seeds) and leaves the
    originals' draws untouched. So a user's later run of the originals (a script's
    `global_variables_initializer()`) draws what it draws in a plain session."""
    region = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in region or op.type in ("VarHandleOp", "VariableV2", "Placeholder"):
            continue
        region.add(op)
        stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    random = [op for op in region if op.type in _RANDOM]
    if not random:
        return list(ops)
    moved, stack = set(), list(random)
    consumers: Dict[tf.Operation, List[tf.Operation]] = {}
    for op in region:
        for dep in [t.op for t in op.inputs] + list(op.control_inputs):
            consumers.setdefault(dep, []).append(op)
    while stack:
        op = stack.pop()
        if op not in moved:
            moved.add(op)
            stack.extend(consumers.get(op, ()))
    copies = clone_ops(moved, {}, scope, lambda op, inputs: op.device)
    return [copies.get(op, op) for op in ops]


def copy_op(op: tf.Operation, graph: tf.Graph, inputs: List[tf.Tensor],
            control_inputs: Iterable[tf.Operation]) -> tf.Operation:
    """A copy of `op` (of another graph) in `graph`: same type, attributes and device,
    reading `inputs` and waiting for `control_inputs` (of `graph`), named as `op` (made
    unique there). Colocations are dropped: the ops they name may live elsewhere there."""
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    new = graph._create_op_internal(  # pylint: disable=protected-access
        op.type, list(inputs), [o.dtype for o in op.outputs], name=op.name, attrs=attrs,
        op_def=op.op_def, compute_device=False)
    new._set_device(op.device)  # pylint: disable=protected-access
    controls = list(dict.fromkeys(control_inputs))
    if controls:
        new._add_control_inputs(controls)  # pylint: disable=protected-access
    return new
