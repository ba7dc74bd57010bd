"""The thread async scheduling runs steps on (`--async-scheduling`, engine/llm_engine.py).

It takes the CUDA device the engine's thread has: the current device is per thread, and kernels
launched from a thread on another device (Triton's among them) would run in the wrong place."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def make_step_thread() -> ThreadPoolExecutor:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ThreadPoolExecutor(1, "meshserve-step", initializer=torch.cuda.set_device,
                                  initargs=(torch.cuda.current_device(),))
    return ThreadPoolExecutor(1, "meshserve-step")
