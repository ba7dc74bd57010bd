"""What a result was measured on: software versions, commit, model, hardware, server config.

Hardware is this (client) machine's; when the server runs elsewhere, its own configuration
comes from `/server_info` where the server exposes one.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

PACKAGES = ("meshserve", "numpy", "aiohttp", "matplotlib", "tqdm", "tokenizers",
            "transformers", "torch")


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state() -> dict | None:
    """The commit of the meshserve checkout this benchmark runs from, if it is one."""
    root = str(Path(__file__).resolve().parents[2])
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {"commit": commit, "dirty": bool(dirty)}


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_info() -> dict:
    mem_kib = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "logical_cores": os.cpu_count(),
        "memory_gib": round(int(mem_kib.split()[0]) / 2**20, 2) if mem_kib else None,
    }


def gpu_info() -> dict | None:
    """NVIDIA GPUs and their interconnect (`nvidia-smi topo -m`), when nvidia-smi exists."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
                  "--format=csv,noheader,nounits"])
    gpus = []
    for line in (query or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5:
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_mib": int(parts[2]),
                         "driver": parts[3], "pci_bus_id": parts[4]})
    return {"gpus": gpus, "topology": _run(["nvidia-smi", "topo", "-m"])}


_SECRET = re.compile(r"(api_?keys?|secret|password|credentials?)$", re.IGNORECASE)


def redact(obj: Any) -> Any:
    """Result files get shared: drop anything a server config calls a key or a secret."""
    if isinstance(obj, dict):
        return {k: "<redacted>" if _SECRET.search(str(k)) and v else redact(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


async def server_config(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """GET /server_info; other servers may not have it, which is not an error."""
    try:
        async with session.get(base_url.rstrip("/") + "/server_info") as resp:
            if resp.status == 200:
                info: dict[str, Any] = redact(await resp.json(content_type=None))
                return info
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return None


async def collect(session: aiohttp.ClientSession, base_url: str, model_entry: dict | None
                  ) -> dict:
    entry = model_entry or {}
    return {
        "versions": package_versions(),
        "git": git_state(),
        "model": {"id": entry.get("id"), "revision": entry.get("revision"),
                  "max_model_len": entry.get("max_model_len"), "owned_by": entry.get("owned_by")},
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "server": await server_config(session, base_url),
    }
