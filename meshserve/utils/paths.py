"""Where meshserve keeps files between runs: one rule for every cache (converted models, weight
revisions, compiled kernels, the planner's calibration)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MESHSERVE_CACHE_DIR, else $XDG_CACHE_HOME/meshserve, else ~/.cache/meshserve (created)."""
    env = os.environ.get("MESHSERVE_CACHE_DIR")
    if env:
        d = Path(env).expanduser()
    else:
        d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshserve"
    d.mkdir(parents=True, exist_ok=True)
    return d
