"""Capacity planner: memory, time and goodput of TP x PP x DP layouts, from arithmetic and
(optionally) constants measured on this machine. Imports nothing from the engine."""
from .catalog import GPUS, MODELS, get_gpu, get_model
from .planner import PlanConfig, PlanResult, plan

__all__ = ["GPUS", "MODELS", "PlanConfig", "PlanResult", "get_gpu", "get_model", "plan"]
