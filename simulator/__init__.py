"""The discrete-event simulator: processes on one SimPy environment (one replica or a cluster behind a router) over the policies/ scheduler and cost models."""

from __future__ import annotations

import importlib
from typing import Any

# The package's names, each imported from its module when first asked for (PEP 562): a module
# that needs one light piece (the hardware profile, the cost model a policy prices its steps
# with, the cluster's settings) does not start the engine and SimPy with it, as a run on the
# real engine or on vLLM, which builds its policy choice through those pieces, would.
_EXPORTS = {
    "StepShape": "simulator.cost_model", "stage_time": "simulator.cost_model",
    "step_time": "simulator.cost_model", "window_gpu_times": "simulator.cost_model",
    "window_shapes": "simulator.cost_model", "simulate": "simulator.engine",
    "HardwareSpec": "simulator.hardware", "check_parallelism": "simulator.hardware",
    "blocks_per_engine": "simulator.memory", "num_gpu_blocks": "simulator.memory",
    "SimResult": "simulator.outcome", "OverheadSpec": "simulator.overhead",
    "scale_overhead": "simulator.overhead",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simulator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
