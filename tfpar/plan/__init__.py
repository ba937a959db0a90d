"""The decision layer, pure (no TensorFlow): what tfpar decides, as plain values.

- `config`: `Config`, the user's intent (never rewritten by tfpar).
- `graph_facts`: what the graph analysis found (variables, gradients, updates).
- `layout`: the job's hosts and workers (`resources=` parsed, checked against the job).
- `cost`, `mesh`, `routing`: the link and cost models, and routing by measured density.
- `planner`: `make_plan`, from the facts, the config, the layout and measurements.
- `plan`: `Plan`, the printable, serialisable result every transform consumes.
- `table`: plain-text tables.

Layers, lowest first (imports only go down; tests/test_layers.py checks it):
errors -> plan, partition (pure decisions) -> graph (reads a TensorFlow graph) ->
transform (rewrites it) -> runtime (the running job) -> testing, cli, the public API.
"""
import importlib as _importlib

# `from tfpar.plan import Plan` loads tfpar.plan.plan on first use: an eager import here
# would run the tiling planner (which reads tfpar.plan.mesh) inside this package's own
# initialisation, an import circle.
_LAZY = {"GradientPlan": "plan", "PartPlan": "plan", "Plan": "plan", "VariablePlan": "plan",
         "Config": "config"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(_importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
