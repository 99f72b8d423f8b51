"""GPU assignment for pytest-xdist workers: each worker gets a disjoint slice of the GPUs, set in
CUDA_VISIBLE_DEVICES before anything initializes CUDA (the pytest plugin calls this at configure time)."""
from __future__ import annotations

import functools
import os
import socket
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


def limit_controller_threads(device: str) -> int | None:
    """In a process that drives ranks on GPUs (a test process, the benchmark), cap torch's intra-op threads at
    DPEP_CONTROLLER_THREADS (default 4; 0 keeps torch's default of one per core). Its CPU work there is the
    judge's and the oracle's host side, on tensors of a few hundred thousand elements at most, where more threads
    mostly spin: on one H100 with 16 cores, one benchmark run each, examples/s at 1 / 2 / 4 ranks went from
    51.0 / 30.7 / 21.9 (16 threads) to 56.1 / 45.8 / 33.0 (4), the ranks' gloo collectives from 5.7 / 8.4 ms to
    1.7 / 3.2 ms at 2 / 4 ranks (docs/gpu.md). Rank processes run 1 thread each already (world.py). Returns the
    count set, or None where nothing changed (CPU runs: the oracle's float64 truth uses the cores there)."""
    cap = controller_threads()
    if not drives_gpus(device) or cap <= 0:
        return None
    import torch
    n = min(torch.get_num_threads(), cap)
    torch.set_num_threads(n)
    return n


# Off until measured on a GPU (docs/gpu.md, fifth pass): the worker thread is tested bit for bit on the CPU only
ORACLE_THREAD_DEFAULT = "0"


def oracle_thread() -> bool:
    """DPEP_ORACLE_THREAD: 1 puts the oracle's float64 truth and its reference in a worker thread while the calling
    thread computes the decoys, where both run on CUDA (checks.oracle.reference, `Oracle.answer`); 0 (the default)
    keeps them in one thread. A ValueError naming it otherwise (the suite refuses it before it runs)."""
    raw = os.environ.get("DPEP_ORACLE_THREAD", ORACLE_THREAD_DEFAULT).strip()
    if raw not in ("0", "1"):
        raise ValueError(f"DPEP_ORACLE_THREAD={raw!r}: 1 (the oracle's truth and reference in a worker thread "
                         "beside its decoys, on CUDA) or 0 (one thread)")
    return raw == "1"


def controller_threads() -> int:
    """DPEP_CONTROLLER_THREADS as a number (default 4); a ValueError naming it otherwise (checked on every device:
    the suite refuses a broken setting before it runs, as it does a broken option)."""
    raw = os.environ.get("DPEP_CONTROLLER_THREADS", "4")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"DPEP_CONTROLLER_THREADS={raw!r}: a whole number (0: torch's default)") from None


def drives_gpus(device: str) -> bool:
    """Whether a run asked for `device` ('cpu' | 'cuda' | 'auto') puts its ranks on GPUs: 'auto' does where
    one is visible (read with nvidia-smi: nothing initializes CUDA here)."""
    return device == "cuda" or (device == "auto" and bool(visible_gpus()))


@functools.lru_cache(maxsize=None)
def mps_daemon() -> str | None:
    """The control socket of a running NVIDIA MPS control daemon, whose server this process's CUDA work and its
    rank processes' would share (`$CUDA_MPS_PIPE_DIRECTORY/control`, default /tmp/nvidia-mps), or None. Running
    means it accepts a connection: a socket file left by a daemon that quit does not count. Under MPS the kernels
    of several processes run on the GPU at once, instead of taking turns, so the oracle may compute beside the
    ranks (checks.judge.parity.overlaps_oracle; one H100, MoE block: 67.4 -> 81.8 examples/s at 1 rank, 45.9 ->
    69.7 at 4, docs/gpu.md). Read once per process. A listening daemon is taken to serve this process and its ranks
(started after it, same user): where it does not, the overlap costs speed, never a verdict."""
    path = os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control")
    if not os.path.exists(path):
        return None
    try:        # any OSError (no socket, nobody listening, no file handles left): no daemon to count on
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(path)
    except OSError:
        return None
    return path
