"""Measurements of this machine through the engine's own kernels, for the planner (see measure.py).

It runs in a process of its own (`python -m meshserve.calibration`, which `meshserve plan
--calibrate` starts) and hands the planner a JSON file, so `meshserve.plan` imports no torch.
"""
