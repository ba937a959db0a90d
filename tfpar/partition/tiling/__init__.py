"""Tilings of large dense layers across devices (SoyBean, with FlexFlow-style simulation).

- `cuts` (value types): `Cut` and `Tiling`, a tensor's k-cut tiling, and what converting
  between tilings costs.
- `dataflow`: the matmuls, bias adds and bias gradients of a training step.
- `min_sum`, `planner`: the exact joint solver and SoyBean's recursion; `plan_tiling`.
- `simulate`: step-time simulation and MCMC over strategies.
- `extract` (needs TensorFlow): the dataflow of a real graph.

Everything here but `extract` imports without TensorFlow.
"""
from tfpar.partition.tiling.cuts import Cut, Tiling
from tfpar.partition.tiling.dataflow import Dataflow, mlp
from tfpar.partition.tiling.planner import TilingPlan, plan_tiling

__all__ = ["Cut", "Dataflow", "Tiling", "TilingPlan", "mlp", "plan_tiling"]
