"""Pipeline and hybrid parallelism across clusters: a model split into stages (`training.stages`),
one Ray actor per stage replica, micro-batches under GPipe or 1F1B, activations crossing the
WAN compressed and counted per link."""

from training.pipeline.driver import StagePool, run_pipeline
from training.pipeline.schedule import Schedule, bubble_fraction
from training.pipeline.spec import PipelineReport, PipelineSpec
from training.pipeline.split import Placement, balance, place

__all__ = [
    "PipelineReport",
    "PipelineSpec",
    "Placement",
    "Schedule",
    "StagePool",
    "balance",
    "bubble_fraction",
    "place",
    "run_pipeline",
]
