"""A world made of torchrun workers on one or more hosts, driven from this process (`--world torchrun`).

torch.distributed's own elastic launcher starts, places and restarts the ranks: each host runs one torchrun
agent (`python -m torch.distributed.run ... -m dpep_parity.checks.harness.torchrun_worker --driver HOST:PORT`,
c10d rendezvous), and its workers connect back to this process, which listens on --world-driver. On this
side a TorchrunWorld is a checks.harness.world.World: the same `run(job)`, collective records, hang and deadlock
diagnosis, deadlines; diagnoses also say on which host and process each rank runs.

After a hang the world asks every worker to exit with checks.harness.torchrun_worker.RESTART_EXIT (a control
connection reaches a worker blocked in a collective); each agent then restarts its worker group (torchrun's
--max-restarts) and the new generation joins on next use. Closing asks the workers to finish; the agents
then exit on their own. With `agents > 0` this process also launches that many agents on this host (the
localhost form the tests use) and ends them, and their workers, when it closes or exits.

Why a connection of our own rather than torchrun's store: the driver must stream every rank's collective
records as they happen and reach a rank that is blocked, which neither the rendezvous store nor the agent's
API offers; what torchrun does offer (placement, rendezvous, restarts) is used as it is.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from dpep_parity.checks.harness import transport
from dpep_parity.checks.harness.torchrun_worker import parse_address
from dpep_parity.checks.harness.world import (
    _LIVE,
    World,
    WorldFailure,
    WorldKind,
    WorldOptions,
    WorldSettings,
)

MAX_RESTARTS = 100      # worker-group restarts a launched agent allows (one per diagnosed hang)
ACCEPT_SLICE_S = 0.5


class TorchrunWorld(World):
    def __init__(self, settings: WorldSettings, device: str = "cpu", deadline_s: float = 120.0,
                 quiet_s: float = 1.5, start_timeout_s: float | None = None):
        if device == "auto":
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.settings = settings
        self.size = settings.size or 0          # learned from the workers when agents are started by hand
        self.device, self.deadline_s, self.quiet_s = device, deadline_s, quiet_s
        self.start_timeout_s = start_timeout_s or max(deadline_s, 120.0)
        self.backend, self.rank_device = ("nccl", "cuda") if device == "cuda" else ("gloo", "cpu")
        self.rank_env: dict[str, str] = {}
        self._conns: list[Connection] = []
        self._ctl: list[Connection] = []
        self._where: list[tuple] = []           # per rank: (host, pid, generation)
        self._procs = []                        # no local rank processes: the agents own them
        self._agents: list[subprocess.Popen] = []
        self._logs: Path | None = None          # launched agents' logs and their workers' temp folders
        self._server: socket.socket | None = None
        key = os.environ.get("DPEP_WORLD_KEY")
        self._key = bytes.fromhex(key) if key else secrets.token_bytes(16)
        self.starts = 0
        self._restarts = 0                      # worker re-executions asked for (after hangs)
        self.generation: int | None = None

    # ---------------- lifecycle ----------------
    @property
    def alive(self) -> bool:
        return bool(self._conns) and all(not c.closed for c in self._conns)

    @property
    def driver_address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2] if self._server else parse_address(self.settings.options.driver)

    def start(self) -> TorchrunWorld:
        if self.alive:
            return self
        self._drop_connections()
        if self._server is None:
            host, port = parse_address(self.settings.options.driver)
            self._server = socket.create_server((host, port), backlog=256)
            self._server.settimeout(ACCEPT_SLICE_S)
        if self.settings.options.agents and not any(a.poll() is None for a in self._agents):
            self._launch_agents()
        self._join(time.monotonic() + self.start_timeout_s)
        self.starts += 1
        _LIVE.add(self)
        return self

    def _launch_agents(self) -> None:
        """`agents` torchrun agents on this host, each in a session of its own (ended as a whole on close)."""
        self._reap_agents()
        if self._logs is None or not self._logs.exists():
            self._logs = Path(tempfile.mkdtemp(prefix="dpep-torchrun-"))
        s = self.settings.options
        rdzv = socket.create_server(("127.0.0.1", 0))   # a free port for the c10d store (closed before use)
        rdzv_port = rdzv.getsockname()[1]
        rdzv.close()
        host, port = self.driver_address
        env = dict(os.environ, DPEP_WORLD_KEY=self._key.hex(), DPEP_WORLD_TMP_ROOT=str(self._logs),
                   PYTHONPATH=os.pathsep.join([_import_root(), *filter(None, [os.environ.get("PYTHONPATH")])]))
        run_id = f"dpep-{os.getpid()}-{secrets.token_hex(3)}"
        for i in range(s.agents):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(s.agents),
                   "--nproc-per-node", str(s.nproc), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}", "--max-restarts", str(MAX_RESTARTS),
                   "--monitor-interval", "0.2", "-m", "dpep_parity.checks.harness.torchrun_worker",
                   "--driver", f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}",
                   "--device", self.device, "--timeout", str(self.deadline_s)]
            log = open(self._logs / f"agent{i}.log", "ab")
            self._agents.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()

    def _join(self, deadline: float) -> None:
        """Accept the workers' connections until every rank has a worker with its process group (ready).

        After a restart the agents may go through more than one worker generation before they settle (an agent
        restarted for another agent's failure restarts again when that one re-rendezvouses): a worker whose
        connection ends, or that fails to create its process group, is dropped and its rank waited for
        again, and a newer worker of a rank replaces an older one."""
        joined: dict[int, dict] = {}          # rank -> {"pid", "where", "data", "ctl", "ready"}
        last_failure = ""
        while True:
            if self.size and len(joined) == self.size and all(j["ready"] and j["ctl"] is not None for j in joined.values()):
                break
            if time.monotonic() > deadline:
                ready = sum(j["ready"] for j in joined.values())
                self._adopt(joined)
                self._fail_start(f"{ready} of {self.size or '?'} torchrun workers were ready within "
                                 f"{self.start_timeout_s:.0f}s{last_failure}")
            if self._agents and all(a.poll() is not None for a in self._agents):
                self._adopt(joined)
                self._fail_start(f"every torchrun agent launched here has exited{last_failure}")
            self._accept_one(joined)
            for rank, j in list(joined.items()):
                c = j["data"]
                if c is None or j["ready"] or not c.poll(0):
                    continue
                try:
                    msg = transport.loads(c.recv_bytes())
                except (EOFError, OSError):
                    msg = ("failed", "its connection ended")
                if msg[0] == "ready":
                    j["ready"] = True
                else:
                    last_failure = f"; last failure: rank {rank} (pid {j['pid']}): {str(msg[1]).strip()[-600:]}"
                    _close_entry(joined.pop(rank))
        self._adopt(joined)

    def _accept_one(self, joined: dict[int, dict]) -> None:
        try:
            sock, _ = self._server.accept()
        except TimeoutError:
            return
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self._key)   # the handshake multiprocessing's Listener.accept does
            answer_challenge(conn, self._key)
            _, role, rank, size, host, pid, gen, *_ = transport.loads(conn.recv_bytes())
        except Exception:   # a stray or unauthenticated connection: not a worker of ours
            conn.close()
            return
        if not self.size:
            self.size = size
        if size != self.size:
            conn.close()
            self._fail_start(f"a worker of a {size}-rank world joined this {self.size}-rank world (rank {rank} "
                             f"on {host}): are two torchrun jobs pointed at this driver?")
        j = joined.get(rank)
        if j is not None and j["pid"] != pid:     # a newer worker of this rank: the older one is gone
            _close_entry(j)
            j = None
        if j is None:
            j = joined[rank] = {"pid": pid, "where": (host, pid, gen), "data": None, "ctl": None, "ready": False}
        j["data" if role == "data" else "ctl"] = conn

    def _adopt(self, joined: dict[int, dict]) -> None:
        ranks = sorted(joined)
        self._conns = [joined[r]["data"] for r in ranks if joined[r]["data"] is not None]
        self._ctl = [joined[r]["ctl"] for r in ranks if joined[r]["ctl"] is not None]
        self._where = [joined[r]["where"] for r in ranks]
        # (re-executions, TORCHELASTIC_RESTART_COUNT): the driver's count of re-executions orders generations;
        # an agent restarted for another agent's failure keeps its own restart count
        self.generation = max((g for _, _, g in self._where), default=None)

    def _fail_start(self, why: str):
        placement = self.placement()
        self.close()
        raise WorldFailure("died", f"torchrun world: {why}{placement}{self._agent_logs()}")

    def close(self, kill: bool = False):
        """kill=False (the end, or after a worker died): every worker finishes and the agents end (launched
        ones are ended here if they do not; the next start() launches new ones, agents started by hand must be
        started again). kill=True (after a hang): every worker re-executes itself in place and the next
        start() takes the new generation."""
        if kill:
            # every worker re-executes itself in place (same process, same agent: torchrun sees no failure) and
            # joins a new process group under a fresh store prefix; a worker that crashes instead is restarted
            # by its agent (--max-restarts), and joins all the same
            self._restarts += 1
            for c in self._ctl:
                _send(c, ("restart", self._restarts))
            self._drop_connections()
            return
        for c in self._conns:
            _send(c, None)                 # a worker idle in its job loop finishes cleanly
        end = time.monotonic() + 3
        for c in self._ctl:                # the control thread then ends a worker that was not idle
            if not c.poll(max(0.0, end - time.monotonic())):
                _send(c, ("exit",))
        self._drop_connections()
        self._end_agents()
        if self._logs is not None:   # diagnoses quote the agents' logs before this
            shutil.rmtree(self._logs, ignore_errors=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        _LIVE.discard(self)

    def _drop_connections(self):
        for c in (*self._conns, *self._ctl):
            c.close()
        self._conns, self._ctl = [], []

    def _end_agents(self, grace_s: float = 5.0):
        """Launched agents end when their workers have; past the grace, SIGTERM (the agent stops its workers),
        then SIGKILL to the agent's session, then to the workers it may have left."""
        end = time.monotonic() + grace_s
        for a in self._agents:
            try:
                a.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        signalled = False
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [a for a in self._agents if a.poll() is None]
            signalled |= bool(alive)
            for a in alive:
                _killpg(a.pid, sig)
            for a in alive:
                try:
                    a.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if signalled:   # workers run in sessions of their own: an agent ended by force may have left them
            for host, pid, _ in self._where:
                if host == socket.gethostname():
                    _killpg(pid, signal.SIGKILL)
        self._reap_agents()

    def _reap_agents(self):
        self._agents = [a for a in self._agents if a.poll() is None]

    def pids(self) -> list[int]:
        return [pid for _, pid, _ in self._where]

    def agent_pids(self) -> list[int]:
        return [a.pid for a in self._agents]

    # ---------------- what World.run asks ----------------
    def _discard(self, hung: bool, died: bool) -> None:
        """A hang (every worker alive): the workers re-execute in place. A dead worker: the whole world is torn
        down (its agent would restart only its own group), and relaunched on next use."""
        self.close(kill=hung and not died)

    def _dead_ranks(self) -> list[int]:
        return []       # a remote worker's end shows as its connection's end, which run() handles

    def _exit_status(self, r: int) -> str:
        host, pid, _ = self._where[r] if r < len(self._where) else ("?", "?", "?")
        return f"connection lost: pid {pid} on {host}"

    def placement(self) -> str:
        if not self._where:
            return ""
        return "\nplacement (torchrun): " + "; ".join(f"rank {r} on {h} pid {p}" for r, (h, p, _)
                                                      in enumerate(self._where)) + \
            f" (worker generation {self.generation[0] if self.generation else 0})"

    def _agent_logs(self, lines: int = 15) -> str:
        out = []
        for f in sorted(self._logs.glob("agent*.log")) if self._logs is not None else ():
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                out.append(f"--- {f.name} (last {len(tail)} lines):\n" + "\n".join(tail))
        return ("\n" + "\n".join(out)) if out else ""


def _close_entry(j: dict) -> None:
    for c in (j["data"], j["ctl"]):
        if c is not None:
            c.close()


def _send(conn: Connection, msg) -> None:
    try:
        conn.send_bytes(transport.dumps(msg))
    except (OSError, ValueError):
        pass


def _killpg(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _import_root() -> str:
    """The folder from which `import dpep_parity` finds this copy (a checkout's parent of dpep_parity/)."""
    import dpep_parity
    return str(Path(dpep_parity.__file__).resolve().parent.parent)


_SHARED: dict[str, TorchrunWorld] = {}


def shared_world(settings: WorldSettings, size: int, device: str, deadline_s: float) -> TorchrunWorld:
    """The one torchrun world of this process (per device), started on first use (`size`: the size asked for,
    which agents started by hand may not have)."""
    w = _SHARED.get(device)
    if w is None or w.settings != settings:
        if w is not None:
            w.close()
        w = _SHARED[device] = TorchrunWorld(settings, device, deadline_s)
    w.deadline_s = deadline_s
    return w.start()     # the caller (checks.harness.world.get_world) checks its size


@dataclass(frozen=True)
class TorchrunOptions(WorldOptions):
    """This process listens on `driver` for the workers and launches `agents` agents of `nproc` workers here
    itself (0: they are started by hand, on any hosts)."""
    driver: str = "127.0.0.1:0"
    agents: int = 0
    nproc: int = 1


def _int(text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return -1


class TorchrunKind(WorldKind):
    """`--world torchrun`: the workers of torchrun agents on one or more hosts (this module's TorchrunWorld)."""
    name = "torchrun"
    Options = TorchrunOptions

    def addoptions(self, group) -> None:
        env = os.environ
        group.addoption("--world-driver", default=env.get("DPEP_WORLD_DRIVER", "127.0.0.1:0"),
                        help="torchrun: HOST:PORT this process listens on for the workers (their --driver)")
        group.addoption("--world-agents", type=int, default=env.get("DPEP_WORLD_AGENTS", "0"),
                        help="torchrun: launch this many agents on this host (0: the agents are started by hand)")
        group.addoption("--world-nproc", type=int, default=env.get("DPEP_WORLD_NPROC", "1"),
                        help="torchrun: workers per launched agent")

    def options_from(self, getoption) -> TorchrunOptions:
        if getoption is None:
            env = os.environ
            return TorchrunOptions(env.get("DPEP_WORLD_DRIVER", "127.0.0.1:0"),
                                   _int(env.get("DPEP_WORLD_AGENTS", "0")), _int(env.get("DPEP_WORLD_NPROC", "1")))
        return TorchrunOptions(getoption("--world-driver"), getoption("--world-agents"), getoption("--world-nproc"))

    def size(self, settings: WorldSettings) -> int | None:
        """The world's size when this process launches its agents (else learned as workers join)."""
        return settings.options.agents * settings.options.nproc if settings.options.agents else None

    def problems(self, settings: WorldSettings, world_sizes: list[int], test_processes: int) -> list[str]:
        out = []
        host, _, port = settings.options.driver.rpartition(":")
        if not host or not port.isdigit():
            out.append(f"--world-driver: {settings.options.driver!r} is not HOST:PORT (e.g. 0.0.0.0:29600)")
        if settings.options.agents < 0 or settings.options.nproc < 1:
            out.append(f"--world-agents {settings.options.agents} / --world-nproc {settings.options.nproc}: need agents >= 0, "
                       "nproc >= 1")
        if not settings.options.agents and not os.environ.get("DPEP_WORLD_KEY"):
            out.append("--world torchrun with agents started by hand: set DPEP_WORLD_KEY (the same hex secret "
                       "on this host and in every agent's environment) so that workers can authenticate")
        if not settings.options.agents and settings.options.driver.rpartition(":")[2] == "0":
            out.append("--world torchrun with agents started by hand: give --world-driver a fixed port, the one "
                       "the agents' --driver names")
        size = self.size(settings)
        if size and world_sizes and set(world_sizes) != {size}:
            out.append(f"--world-sizes {','.join(map(str, world_sizes))}: a torchrun world of {settings.options.agents} "
                       f"agent(s) x {settings.options.nproc} worker(s) has {size} ranks; run with --world-sizes {size}")
        if not settings.options.agents and test_processes > 0:
            out.append("--world torchrun with agents started by hand serves one test process: run with "
                       "-p no:xdist (or -n 0)")
        return out

    def world(self, settings: WorldSettings, size: int, device: str, deadline_s: float) -> World | None:
        if self.size(settings) in (None, size):
            w = shared_world(settings, size, device, deadline_s)
            if w.size == size:
                return w
        if size not in _LOCAL_NOTED:
            # the sign-off's matrix mixes world sizes (its 1-rank baseline): those run on local pools, said
            # once; the property suite refuses such sizes before collecting (problems)
            _LOCAL_NOTED.add(size)
            print(f"dpep: a world of {size} rank(s) runs on a local pool: the torchrun world has another size",
                  file=sys.stderr)
        return None


_LOCAL_NOTED: set[int] = set()
KIND = TorchrunKind()
