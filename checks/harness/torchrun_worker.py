"""The rank side of a torchrun world: what each torchrun worker runs (checks.harness.torchrun_world drives it).

    DPEP_WORLD_KEY=<hex> python -m torch.distributed.run --nnodes N --nproc-per-node M \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id RUN --max-restarts 3 \\
        -m dpep_parity.checks.harness.torchrun_worker --driver DRIVER_HOST:PORT [--device cuda]

torchrun gives the rank, the world size and the rendezvous (env://); the worker connects back to the driver
(the pytest process or `dpep` command that listens on --driver) twice: a data connection on which it runs
the jobs the driver sends, exactly as a local pool's rank does (checks.harness.world.serve_jobs: the same collective
records, streamed as they happen), and a control connection served by a thread, which ends the process even
while its main thread is blocked in a collective: "restart" exits with RESTART_EXIT (torchrun's agent then
restarts the whole worker group, on every host, within its --max-restarts), "exit" or a lost driver exits 0
(the agents then finish: no process outlives the driver).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

RESTART_EXIT = 75      # the driver asked for a new worker group (after a hang): a failure to torchrun
CONTROL_WAIT_S = 60    # how long a dropped worker's main thread waits for the control thread's word


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpep_parity.checks.harness.torchrun_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", required=True, type=parse_address, help="HOST:PORT the driver listens on")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the process group's collectives")
    ap.add_argument("--generation", type=int, default=0, help=argparse.SUPPRESS)   # set by a re-execution
    a = ap.parse_args(argv)
    env = os.environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_size = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    generation = (a.generation, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    key = bytes.fromhex(env["DPEP_WORLD_KEY"])
    from dpep_parity.checks.harness import transport
    hello = (rank, size, socket.gethostname(), os.getpid(), generation, local_rank, local_size)
    # under the driver's own folder when the driver launched this agent (removed with it), else in the temp dir
    tmp = tempfile.mkdtemp(prefix=f"dpep-torchrun-rank{rank}-", dir=env.get("DPEP_WORLD_TMP_ROOT") or None)
    signal.signal(signal.SIGTERM, lambda *_: (shutil.rmtree(tmp, ignore_errors=True), os._exit(143)))
    os.environ["DPEP_WORLD_TMP"] = tmp   # rank-side files that must not outlive the world (as in a local pool)

    try:
        ctl = Client(a.driver, authkey=key)
    except OSError as e:    # no driver (it closed the world, or has not started): nothing to run, and exit 0 so
        print(f"dpep torchrun worker rank {rank}: driver {a.driver} unreachable ({e}); exiting", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)   # that the agent ends instead of restarting the group
        return 0
    ctl.send_bytes(transport.dumps(("hello", "control", *hello)))
    control = threading.Thread(target=_control, args=(ctl, tmp, argv if argv is not None else sys.argv[1:]),
                               daemon=True, name="dpep-control")
    control.start()
    conn = Client(a.driver, authkey=key)

    def send(msg):
        conn.send_bytes(transport.dumps(msg))
    send(("hello", "data", *hello))
    try:
        import warnings
        warnings.filterwarnings("ignore", category=FutureWarning)
        import torch
        torch.set_num_threads(int(env.get("DPEP_RANK_THREADS", "1")))   # as a local pool's ranks: same rounding
        import torch.distributed as dist
        backend = "nccl" if a.device == "cuda" else "gloo"
        if a.device == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=_store(rank, size, generation), rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(a.timeout, 30)))
        from dpep_parity.checks.harness.recorder import Recorder
        from dpep_parity.checks.harness.world import RankContext, serve_jobs
        rec = Recorder(send)
        rec.install()
        ctx = RankContext(rank, size, a.device, backend, {}, rec)
        send(("ready",))
    except BaseException:
        send(("failed", traceback.format_exc()))
        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    try:
        finished = serve_jobs(conn, ctx, send)
    except (EOFError, OSError):
        finished = False
    if not finished:
        # The driver dropped this worker (a hang elsewhere, or the driver's end): its control thread decides how
        # the process ends (re-executed into the next generation, or exit). The main thread, freed by a peer's
        # re-execution breaking its collective, must not end the process first: its rank would be missing from
        # the next generation, and every other worker would wait for it (seen under load in CI).
        control.join(CONTROL_WAIT_S)
        return 0
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _store(rank: int, size: int, generation: tuple[int, int]):
    """The rendezvous store torchrun gives its workers (MASTER_ADDR / MASTER_PORT, as env:// reads it), under a
    prefix of this worker generation (re-executions asked by the driver, restarts by the agent: torch's own
    env:// prefixes TORCHELASTIC_RESTART_COUNT alike): a new group must not meet the keys of the one it
    replaces."""
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, size, is_master=not agent_store and rank == 0,
                          timeout=timedelta(seconds=300))
    return dist.PrefixStore(f"dpep/generation{generation[0]}-attempt{generation[1]}", store)


def _control(ctl, tmp: str, argv: list[str]) -> None:
    """Wait for the driver's word (or its loss) and act at once, whatever the main thread does: "restart"
    re-executes this worker in place (a main thread blocked in a collective cannot be recovered otherwise;
    the process, its pid and its agent stay), "exit" or a lost driver ends it."""
    from dpep_parity.checks.harness import transport
    try:
        msg = transport.loads(ctl.recv_bytes())
    except (EOFError, OSError):
        msg = ("exit",)
    # a test seam: a control thread slower than the main thread (as under load) must still decide the end
    time.sleep(float(os.environ.get("DPEP_WORLD_TEST_CONTROL_DELAY_S", "0")))
    shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if msg and msg[0] == "restart":
        try:
            os.execv(sys.executable, [sys.executable, "-m", "dpep_parity.checks.harness.torchrun_worker", *argv,
                                      "--generation", str(msg[1])])
        except OSError:
            os._exit(RESTART_EXIT)     # then torchrun's agent restarts the group
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
