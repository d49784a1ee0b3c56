"""`kvtier plan`: the restore-vs-recompute arithmetic on real hardware, before buying it.

`models` (shapes, KV bytes per token), `hardware` (presets, this-machine), `analysis`
(per context: restore vs recompute through `kvtier.tier.planner.Planner`, sessions per node,
pinned memory), `simulate` (a discrete-event replay of a multi-turn trace, each TTFT split
into queue / tier / compute; its records and tables in `simrecords`), `cli`.
"""

from kvtier.plan.analysis import ContextPlan, PlanResult, analyze
from kvtier.plan.hardware import HARDWARE, Hardware, resolve_hardware
from kvtier.plan.models import MODELS, ModelShape, resolve_model
from kvtier.plan.simulate import SimRecord, SimResult, simulate

__all__ = [
    "HARDWARE",
    "MODELS",
    "ContextPlan",
    "Hardware",
    "ModelShape",
    "PlanResult",
    "SimRecord",
    "SimResult",
    "analyze",
    "resolve_hardware",
    "resolve_model",
    "simulate",
]
