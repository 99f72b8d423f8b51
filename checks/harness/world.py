"""Multi-rank execution: a pool of N rank processes, started once and reused for many examples.

- gloo on CPU; NCCL when every rank has its own GPU; gloo with CUDA tensors on a shared GPU otherwise.
- `file://` rendezvous in a per-world temporary file (fixed TCP ports collide under pytest-xdist).
- Every collective is recorded per rank (checks.harness.recorder) and streamed to the parent, which runs a
  wait-for analysis while waiting: a rank that finished (or failed) while others wait for it in a
  collective, or ranks blocked in collectives none of which can complete, is a hang, diagnosed at once
  (after a short quiet period) with the rank, the collective and where every other rank is. A deadline
  backs this up for hangs outside collectives. After a hang the world is killed, no process left, and
  restarted on next use.
- Ranks of a CPU world are forked from multiprocessing's forkserver, which imported the rank side once (this
  module, torch.distributed, the unit job and the spec target: BASE_PRELOAD) and any modules the world's target
  names to preload (`preload_modules`: SGLang's imports, about 10 s a rank); so a world's start, or its
  restart after a hang, costs a fork and a process group, not the imports again (docs/harness.md,
  "Recovering from a hang"; a spawned 4-rank world took 3.2 s to start here, a forked one 0.06 s). CUDA
  worlds (CUDA must not be initialised before a fork), and every world under DPEP_WORLD_PRELOAD=off, are
  spawned.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

from dpep_parity.checks.harness import transport
from dpep_parity.checks.harness.recorder import Record, mismatches
from dpep_parity.registry import Registry


class WorldFailure(AssertionError):
    """Ranks did not finish an example together; the message is the diagnosis."""

    def __init__(self, kind: str, message: str, records: dict[int, list[Record]] | None = None):
        super().__init__(message)
        self.kind = kind          # "hang" | "rank-error" | "deadline" | "died" | "harness"
        self.records = records or {}


@dataclass
class RankResult:
    rank: int
    value: Any
    records: list[Record]
    seconds: float


@dataclass
class _RankState:
    records: list[Record] = field(default_factory=list)
    waiting: Record | None = None      # collective entered, not exited
    finished: bool = False
    error: str | None = None
    harness: bool = False              # the error is a HarnessFault: the target's glue, not the system
    value: Any = None
    seconds: float = 0.0
    died: bool = False
    setup: str | None = None            # the set-up phase the rank is in (recorder.setup_phase), if any

    def issued_on(self, group: tuple[int, ...]) -> int:
        return sum(1 for r in self.records if r.group == group)


def backend_for(world_size: int, gpus: int) -> tuple[str, str]:
    """(backend, rank device) of a world of `world_size` ranks in a process that sees `gpus` GPUs.
    NCCL only with one GPU per rank (NCCL refuses two ranks on one GPU); otherwise gloo with CUDA tensors,
    ranks placed round-robin on the GPUs (rank % gpus), several ranks sharing a GPU; gloo on CPU if none."""
    if gpus <= 0:
        return "gloo", "cpu"
    return ("nccl", "cuda") if gpus >= world_size else ("gloo", "cuda")


def choose_backend(world_size: int, device: str) -> tuple[str, str]:
    """(backend, device) for a world: `device` is 'cpu', 'cuda' (CUDA required) or 'auto' (CUDA if any)."""
    if device == "cpu":
        return "gloo", "cpu"
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        if device == "auto":
            return "gloo", "cpu"
        raise RuntimeError(f"device {device!r} asked for but no CUDA device is visible")
    return backend_for(world_size, n)


def describe_backends(world_sizes, gpus: int) -> str:
    """One line for the pytest header: the backend each world size gets with `gpus` GPUs per process."""
    parts = []
    for ws in world_sizes:
        backend, dev = backend_for(ws, gpus)
        where = ("CPU" if dev == "cpu" else "one GPU per rank" if backend == "nccl"
                 else f"{ws} ranks on {gpus} shared GPU{'s' if gpus > 1 else ''}")
        parts.append(f"{ws} rank{'s' if ws > 1 else ''}: {backend} ({where})")
    return "; ".join(parts)


AFTER_ERROR_S = 10.0    # how long the other ranks get once one has raised (World.__init__)


def setup_deadline_default() -> float:
    """Seconds a rank's set-up may take (joining the world; a phase marked by recorder.setup_phase: imports, a
    model build, an engine's parallel state), apart from the example's collective deadline: a slow import on a
    loaded machine is not a hang, and a short collective deadline stays usable. DPEP_SETUP_DEADLINE overrides
    the default of 600 s."""
    try:
        return float(os.environ.get("DPEP_SETUP_DEADLINE", "600"))
    except ValueError:
        raise ValueError(f"DPEP_SETUP_DEADLINE={os.environ['DPEP_SETUP_DEADLINE']!r} is not a number of seconds") from None


class World:
    """N rank processes. `run(job)` sends the same job to every rank and returns their results."""
    after_error_s = AFTER_ERROR_S   # see __init__ (the default of worlds that define their own __init__)
    setup_deadline_s: float | None = None   # likewise

    def setup_limit(self) -> float:
        """This world's set-up deadline in seconds (setup_deadline_default() unless given)."""
        return setup_deadline_default() if self.setup_deadline_s is None else self.setup_deadline_s

    def __init__(self, size: int, device: str = "cpu", deadline_s: float = 120.0, quiet_s: float = 1.5,
                 rank_env: dict[str, str] | None = None, after_error_s: float = AFTER_ERROR_S,
                 setup_deadline_s: float | None = None):
        self.size = size
        self.device = device
        self.deadline_s = deadline_s
        self.setup_deadline_s = setup_deadline_s       # None: setup_deadline_default() (read at each use)
        self.quiet_s = quiet_s
        # Once a rank has raised, the example's verdict is that error whatever the others do: they get this
        # long to finish or raise too, then the world ends them. A rank left waiting on the one that raised,
        # outside any collective the recorder sees (SGLang's own transports), would otherwise hold the
        # example until its deadline (minutes) for no further evidence. A liveness budget, not a tolerance.
        self.after_error_s = after_error_s
        self.rank_env = rank_env or {}
        self.preload: set[str] = set()      # modules the ranks import: see _rank_context (grows, never shrinks)
        self.forked = False                 # this start's ranks came from the forkserver (else spawned)
        self.backend, self.rank_device = choose_backend(size, device)
        self._procs: list[mp.Process] = []
        self._conns: list = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.starts = 0
        self.start_seconds: list[float] = []    # each start, until every rank joined its process group

    # ---------------- lifecycle ----------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "World":
        if self.alive:
            return self
        self.close()
        t0 = time.monotonic()
        ctx = _rank_context(self.rank_device, self.preload)
        self.forked = ctx.get_start_method() == "forkserver"
        self._tmp = tempfile.TemporaryDirectory(prefix="dpep-world-")
        init = os.path.join(self._tmp.name, "rendezvous")
        # a forked rank starts from the forkserver's environment, a spawned one from this process's at its
        # start: both get this process's environment now (a test's or a user's variables), then rank_env
        env = {**os.environ, **self.rank_env}
        for rank in range(self.size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_rank_main, name=f"dpep-rank{rank}",
                            args=(rank, self.size, init, child, self.backend, self.rank_device,
                                  env, self.deadline_s), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        joined_by = time.monotonic() + self.setup_limit()
        for rank, c in enumerate(self._conns):   # wait for every rank's process group: set-up, its own deadline
            if not c.poll(max(0.0, joined_by - time.monotonic())):
                self.close()
                raise WorldFailure("died", f"rank {rank} did not join the world within its set-up deadline of "
                                   f"{self.setup_limit():.0f}s (DPEP_SETUP_DEADLINE)")
            try:
                msg = transport.loads(c.recv_bytes())
            except (EOFError, OSError):
                msg = ("failed", f"process exited with code {self._procs[rank].exitcode} before joining")
            if msg[0] != "ready":
                self.close()
                raise WorldFailure("died", f"rank {rank} failed to start:\n{msg[1]}")
        self.starts += 1
        self.start_seconds.append(time.monotonic() - t0)
        _LIVE.add(self)
        return self

    def close(self, kill: bool = False):
        """Stop every rank: ask politely (shared 3 s grace), then kill. `kill`: ranks are known to be
        stuck (a diagnosed hang), so skip the grace."""
        if not kill:
            for c in self._conns:
                try:
                    c.send_bytes(transport.dumps(None))
                except (OSError, BrokenPipeError):
                    pass
            end = time.monotonic() + 3
            for p in self._procs:
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        _LIVE.discard(self)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ---------------- running examples ----------------
    def run(self, job: Any, deadline_s: float | None = None,
            meanwhile: Callable[[], None] | None = None) -> list[RankResult]:
        """Run `job` (a picklable callable taking a RankContext) on every rank. `meanwhile`: work of this
        process to do while the ranks compute (the oracle's answer for the same example), before their results
        are collected; its time is not on the example's deadline. Should it raise, the ranks are ended (their
        job's results would be lost anyway) and the error goes to the caller."""
        self.start()
        payload = transport.dumps(job)
        for c in self._conns:
            c.send_bytes(payload)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                self._discard(hung=True, died=False)
                raise
        states = [_RankState() for _ in range(self.size)]
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        setup_since = None       # while some rank is in a set-up phase: when that began (not on the deadline)
        last_event = time.monotonic()
        first_error = None
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        while not all(s.finished for s in states):
            ready = wait(self._conns, timeout=0.2)
            for c in ready:
                r = conn_rank[id(c)]
                try:
                    msg = transport.loads(c.recv_bytes())
                except (EOFError, OSError):
                    states[r].finished = states[r].died = True
                    states[r].error = states[r].error or f"rank {r} process died ({self._exit_status(r)})"
                    continue
                last_event = time.monotonic()
                _apply(states[r], msg)
            now = time.monotonic()
            for r in self._dead_ranks():
                if not states[r].finished:
                    states[r].finished = states[r].died = True
                    states[r].error = f"rank {r} process died ({self._exit_status(r)})"
            if all(s.finished for s in states):
                break
            hang = diagnose(states, quiet=now - last_event >= self.quiet_s)
            if hang:
                self._fail("hang", hang, states)
            if first_error is None and any(s.error for s in states):
                first_error = now
            if first_error is not None and now - first_error > self.after_error_s:
                raised = ", ".join(str(r) for r, s in enumerate(states) if s.error)
                self._fail("rank-error", f"rank(s) {raised} raised and the others did not finish within "
                           f"{self.after_error_s:.0f}s of it (waiting on it outside a recorded collective, or "
                           "still computing)\n" + where_is_everyone(states), states)
            in_setup = [(r, s.setup) for r, s in enumerate(states) if s.setup and not s.finished]
            if in_setup and setup_since is None:
                setup_since = now
            elif not in_setup and setup_since is not None:
                deadline += now - setup_since           # set-up time is not the example's
                setup_since = None
            if setup_since is not None and now - setup_since > self.setup_limit():
                self._fail("deadline", f"set-up exceeded its {self.setup_limit():.0f}s deadline "
                           "(DPEP_SETUP_DEADLINE): " + ", ".join(f"rank {r} in {w}" for r, w in in_setup)
                           + "\n" + where_is_everyone(states), states)
            if setup_since is None and now > deadline:
                self._fail("deadline", f"example exceeded its {deadline_s or self.deadline_s:.0f}s deadline\n"
                           + where_is_everyone(states), states)
        errors = [(r, s.error) for r, s in enumerate(states) if s.error]
        if errors:
            msg = "\n".join(f"--- rank {r} raised:\n{e}" for r, e in errors)
            # a collective mismatch often kills gloo ranks: name it from the records
            mismatch = "\n".join(mismatches({r: s.records for r, s in enumerate(states)}))
            placement = self.placement()
            if any(s.died for s in states) or self._dead_ranks():
                self._discard(hung=False, died=True)
            raise WorldFailure("harness" if any(s.harness for s in states) else "rank-error", msg + ("\n" + mismatch if mismatch else "") + placement,
                               {r: s.records for r, s in enumerate(states)})
        return [RankResult(r, s.value, s.records, s.seconds) for r, s in enumerate(states)]

    def _fail(self, kind: str, message: str, states: list[_RankState]):
        records = {r: s.records for r, s in enumerate(states)}
        if any(s.error for s in states):
            # a rank raised and left the others waiting: the error is the cause
            kind = "harness" if any(s.harness for s in states) else "rank-error"
        errors = "".join(f"\n--- rank {r} raised:\n{s.error}" for r, s in enumerate(states) if s.error)
        placement = self.placement()
        # ranks blocked in collectives cannot be recovered: kill, restart on next use
        self._discard(hung=True, died=any(s.died for s in states))
        raise WorldFailure(kind, message + errors + placement, records)

    # ---------------- what a world of another kind (checks.harness.torchrun_world) redefines ----------------
    def _discard(self, hung: bool, died: bool) -> None:
        """After a failed example: ranks that hang are killed at once, others asked to stop first; the
        world restarts on next use."""
        self.close(kill=hung)

    def _dead_ranks(self) -> list[int]:
        """Ranks whose process is known to have ended (a remote world learns it from the connection)."""
        return [r for r, p in enumerate(self._procs) if not p.is_alive()]

    def _exit_status(self, r: int) -> str:
        return f"exit code {self._procs[r].exitcode}" if r < len(self._procs) else "connection lost"

    def placement(self) -> str:
        """Where each rank runs, appended to a diagnosis (every rank of a local world is on this host)."""
        return ""


def _apply(state: _RankState, msg):
    kind = msg[0]
    if kind == "enter":
        state.records.append(msg[1])
        state.waiting = msg[1]
    elif kind == "exit":
        state.waiting = None
    elif kind == "setup":
        state.setup = msg[1]
    elif kind == "done":
        state.finished, state.value, state.seconds = True, msg[1], msg[2]
        state.waiting = None
    elif kind == "error":
        state.finished, state.error = True, msg[1]
        state.harness = len(msg) > 2 and bool(msg[2])
        state.waiting = None


def diagnose(states: list[_RankState], quiet: bool = True) -> str | None:
    """A hang explained by the records, or None.

    A rank waiting for a member that already finished without issuing that collective is certain at once
    (a finished rank's records are complete: its pipe is ordered). A mismatch or a deadlock is judged only
    after a quiet period, when no exit message can still be in flight."""
    waiting = [(r, s.waiting) for r, s in enumerate(states) if s.waiting is not None and not s.finished]
    if not waiting:
        return None
    lines = []
    for r, rec in waiting:
        for m in rec.group:
            sm = states[m]
            n = sm.issued_on(rec.group)
            if sm.finished and n < rec.gseq:
                what = "failed" if sm.error else "finished the example"
                lines.append(f"HANG: rank {r} waits in {rec.short()}, but rank {m} {what} after issuing "
                             f"{n} collective(s) on that group: rank {m} skipped it")
            elif quiet and n >= rec.gseq:
                other = [x for x in sm.records if x.group == rec.group][rec.gseq - 1]
                if other.signature() != rec.signature():
                    lines.append(f"MISMATCH: rank {r} is in {rec.short()} while rank {m} issued {other.short()}")
    if lines:
        return "\n".join(dict.fromkeys(lines)) + "\n" + where_is_everyone(states)
    # every unfinished rank is blocked, and no blocked collective has all its members in it: deadlock
    unfinished = [r for r, s in enumerate(states) if not s.finished]
    if quiet and all(states[r].waiting is not None for r in unfinished):
        def complete(rec):
            return all(states[m].issued_on(rec.group) >= rec.gseq for m in rec.group)
        if not any(complete(states[r].waiting) for r in unfinished):
            return "DEADLOCK: every running rank is blocked in a collective that cannot complete\n" + \
                where_is_everyone(states)
    return None


def where_is_everyone(states: list[_RankState]) -> str:
    out = []
    for r, s in enumerate(states):
        if s.error:
            where = "raised an error"
        elif s.finished:
            where = f"finished after {len(s.records)} collective(s)"
        elif s.setup and s.waiting is None:
            where = f"in set-up ({s.setup})"
        elif s.waiting is not None:
            where = f"blocked in {s.waiting.short()}"
        else:
            last = s.records[-1].short() if s.records else "none"
            where = f"computing (last collective: {last})"
        out.append(f"  rank {r}: {where}")
    return "where every rank is:\n" + "\n".join(out)


# ---------------- rank side ----------------
@dataclass
class RankContext:
    rank: int
    world_size: int
    device: str
    backend: str
    cache: dict            # survives across examples: built modules, groups
    recorder: Any

    def group(self, ranks: tuple[int, ...], name: str):
        """The process group for `ranks`, created once. Every rank must call this in the same order."""
        import torch.distributed as dist
        key = ("group", tuple(ranks))
        if key not in self.cache:
            pg = dist.new_group(list(ranks)) if len(ranks) < self.world_size else dist.group.WORLD
            self.cache[key] = pg
        pg = self.cache[key]
        if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
            self.recorder.name_group(pg, name)
        return pg


def _rank_main(rank, size, init_file, conn, backend, device, env, timeout_s):
    from dpep_parity.checks.harness import transport

    def send(msg):
        conn.send_bytes(transport.dumps(msg))
    try:
        os.environ.clear()          # exactly the starting process's environment (see World.start)
        os.environ.update(env)
        if os.environ.get("DPEP_RANK_LOG"):   # audit trail: every rank process that starts says so (tests of
            with open(os.environ["DPEP_RANK_LOG"], "a") as f:     # bad input check that none started)
                f.write(f"{os.getpid()} rank {rank} of {size}\n")
        # the world's own temporary folder, removed by the parent when the world closes (even after a kill):
        # where rank-side code keeps files that must not outlive the world
        os.environ["DPEP_WORLD_TMP"] = os.path.dirname(init_file)
        import warnings
        warnings.filterwarnings("ignore", category=FutureWarning)   # torch's all_gather_into_tensor rename
        import torch
        torch.set_num_threads(1)   # N ranks share the cores; oversubscription makes gloo timeouts flaky
        import torch.distributed as dist
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(timeout_s, 30)))
        from dpep_parity.checks.harness.recorder import Recorder
        rec = Recorder(send)
        rec.install()
        ctx = RankContext(rank, size, device, backend, {}, rec)
        send(("ready",))
    except BaseException:
        send(("failed", traceback.format_exc()))
        return
    serve_jobs(conn, ctx, send)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def serve_jobs(conn, ctx: RankContext, send) -> bool:
    """A rank's loop: run each job the parent sends until it sends None (returns True: told to finish) or the
    connection ends (returns False: the parent dropped this rank, for example after a hang elsewhere)."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return False
        job = transport.loads(data)
        if job is None:
            return True
        ctx.recorder.reset()
        t0 = time.perf_counter()
        try:
            value = job(ctx)
            send(("done", value, time.perf_counter() - t0))
        except BaseException as e:
            from dpep_parity.checks.targets.protocol import HarnessFault
            try:
                send(("error", f"{traceback.format_exc()}", isinstance(e, HarnessFault)))
            except OSError:     # the parent dropped the connection while this job failed (a peer's hang)
                return False


# ---------------- how rank processes start ----------------
_FORKSERVER_PRELOAD: frozenset[str] = frozenset()
# What every CPU rank imports, whatever its job: the forkserver imports it once per test process.
BASE_PRELOAD = frozenset({"dpep_parity.checks.harness.world", "torch.distributed",
                          "dpep_parity.checks.harness.unitjob", "dpep_parity.checks.targets.spec"})


def _rank_context(device: str, preload: set[str]):
    """For a CPU world multiprocessing's forkserver with BASE_PRELOAD and `preload` preloaded; spawn for CUDA.

    The forkserver is one per process and imports its preload list when it starts; when a world asks for a
    module it lacks, it is stopped (after closing the worlds it forked) and the next rank start launches one
    that imports the union. Why the standard forkserver: it is exactly "processes forked from a pre-imported
    parent", with its own handling of fds, sentinels and `__main__`; only the restart uses its private `_stop`
    (what CPython's own tests stop it with), and where that is missing the running server is kept and ranks
    import what it lacks themselves (slower, still correct). A preload module that fails to import is skipped by the forkserver; the rank then imports
    it and reports the error as it always did. CUDA worlds spawn: a forked rank cannot initialise CUDA if the
    parent did, and importing a GPU library may."""
    global _FORKSERVER_PRELOAD
    if (device != "cpu" or "fork" not in mp.get_all_start_methods()
            or os.environ.get("DPEP_WORLD_PRELOAD") == "off"):      # off: every world spawns (an A/B, a doubt)
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    want = _FORKSERVER_PRELOAD | frozenset(preload) | BASE_PRELOAD
    if want != _FORKSERVER_PRELOAD:
        from multiprocessing import forkserver
        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None:
            stop = getattr(server, "_stop", None)
            if stop is None:
                return ctx               # keep the running server: ranks import the rest themselves
            # Ranks forked by the old server outlive it, but their exit status travels through it: once it is
            # gone they would read as dead and escape close()'s kill. So their worlds end first (restarted on
            # next use, from the new server).
            for w in list(_LIVE):
                if getattr(w, "forked", False):
                    w.close()
            stop()
        ctx.set_forkserver_preload(sorted(want))
        _FORKSERVER_PRELOAD = want
    return ctx


# ---------------- which kind of world: local pools, a torchrun world, or an outside package's ----------------
@dataclass(frozen=True)
class WorldOptions:
    """A world kind's own options: the fields of its kind's subclass (the local kind has none)."""


@dataclass(frozen=True)
class WorldSettings:
    """The world of a run: `kind` names a world kind (WORLD_KINDS), `options` are that kind's own (its
    Options class, read from its command-line options or the environment: WorldKind.options_from)."""
    kind: str = "local"
    options: WorldOptions = field(default_factory=WorldOptions)

    @classmethod
    def from_env(cls) -> WorldSettings:
        """DPEP_WORLD names the kind; the kind reads its own options from the environment."""
        kind = os.environ.get("DPEP_WORLD", "local")
        known = WORLD_KINDS.get(kind)
        return cls(kind, known.options_from(None) if known else WorldOptions())

    @property
    def size(self) -> int | None:
        """The world's size when this process knows it before ranks join (else None)."""
        return WORLD_KINDS[self.kind].size(self) if self.kind in WORLD_KINDS else None

    def problems(self, world_sizes: list[int] | None = None, test_processes: int = 0) -> list[str]:
        """What is wrong with these options, before any world starts (`test_processes`: pytest-xdist's
        workers, 0 without xdist)."""
        if self.kind not in WORLD_KINDS:
            return [f"--world: {self.kind!r} is not a world kind ({' | '.join(WORLD_KINDS)})"]
        return WORLD_KINDS[self.kind].problems(self, world_sizes or [], test_processes)


class WorldKind:
    """A kind of world: where the ranks of a world of `size` come from, with its own options (`Options`, its
    command-line options declared by `addoptions`, read by `options_from`). The local kind is this module's
    rank pools; others (checks.harness.torchrun_world, an outside package's through an entry point of group
    dpep_parity.worlds) return a World subclass of their own, or None to let this size run on a local pool."""
    name = "local"
    Options: type[WorldOptions] = WorldOptions

    def addoptions(self, group) -> None:
        """Declare this kind's own command-line options in the suite's pytest option group."""

    def options_from(self, getoption) -> WorldOptions:
        """This kind's options from pytest's `config.getoption`, or from the environment when it is None."""
        return self.Options()

    def size(self, settings: WorldSettings) -> int | None:
        return None

    def problems(self, settings: WorldSettings, world_sizes: list[int], test_processes: int) -> list[str]:
        return []

    def world(self, settings: WorldSettings, size: int, device: str, deadline_s: float) -> World | None:
        return None


WORLD_KINDS: Registry[WorldKind] = Registry("worlds", accept=WorldKind, noun="world kind")
WORLD_KINDS.register(WorldKind())
WORLD_KINDS.refer("torchrun", "dpep_parity.checks.harness.torchrun_world:KIND")


_SETTINGS: WorldSettings | None = None


def configure(settings: WorldSettings | None) -> None:
    """Choose the world kind of this process (None: from the environment, DPEP_WORLD and its kin)."""
    global _SETTINGS
    _SETTINGS = settings


def world_settings() -> WorldSettings:
    return _SETTINGS if _SETTINGS is not None else WorldSettings.from_env()


# ---------------- pool of worlds per process ----------------
_LIVE: set[World] = set()
_POOL: dict[tuple, World] = {}


def get_world(size: int, device: str = "cpu", deadline_s: float = 120.0, preload=(), **kw) -> World:
    """One world per (size, device) per test process, reused across examples; under another world kind
    (`--world torchrun`: checks.harness.torchrun_world) the world that kind gives, where it gives one. `preload`: modules the job's
    target imports on the ranks (its `preload_modules`): the world's next start forks its ranks from a process
    that imported them (_rank_context); a running world is not restarted for them."""
    settings = world_settings()
    w = WORLD_KINDS[settings.kind].world(settings, size, device, deadline_s)
    if w is not None:
        return w
    key = (size, device)
    w = _POOL.get(key)
    if w is None:
        w = _POOL[key] = World(size, device, deadline_s, **kw)
    w.deadline_s = deadline_s
    w.preload |= set(preload)
    return w.start()


@atexit.register
def close_all():
    for w in list(_LIVE):
        w.close()
    _POOL.clear()
