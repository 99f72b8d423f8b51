"""GPU assignment for pytest-xdist workers: each worker gets a disjoint slice of the GPUs, set in
CUDA_VISIBLE_DEVICES before anything initializes CUDA (the pytest plugin calls this at configure time)."""
from __future__ import annotations

import os
import subprocess


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:   # nvidia-smi does not initialize CUDA in this process
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return [l.strip() for l in out.stdout.splitlines() if l.strip()]
    except (OSError, subprocess.TimeoutExpired):
        return []


def worker_slice(gpus: list[str], worker_index: int, workers: int) -> list[str]:
    """Disjoint round-robin slices; with fewer GPUs than workers, workers share one GPU (gloo worlds)."""
    if not gpus:
        return []
    if workers <= len(gpus):
        per = len(gpus) // workers
        return gpus[worker_index * per:(worker_index + 1) * per]
    return [gpus[worker_index % len(gpus)]]


def assign_worker_gpus(worker: str, workers: int) -> list[str]:
    idx = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    mine = worker_slice(visible_gpus(), idx, workers)
    if mine:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return mine
