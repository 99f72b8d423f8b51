"""The eval-task registry: every task is one module of this package defining ``TASK`` (an
:class:`~dpep_parity.evals.tasks.base.EvalTask`), found on the registry's first read (dpep_parity.registry)
with outside packages' entry points of group ``dpep_parity.tasks``; ``register`` adds one from code (a
test). The data loader, the sign-off, the gate, the matrix's margins and the report consult the registry
and never test task names.

Adding a task is one new file, ``evals/tasks/<name>.py`` (its lm-eval YAML may sit beside it): subclass
``EvalTask`` with its name, data splits and row validator, its lm-eval task, how documents are selected, how
its requests are built, run through the LM and scored, and its measures (unit, cluster, default margin); set
``TASK = MyTask()``. Then ``--tasks <name>`` and ``--<name>-limit`` work, and ``[gate] margin`` accepts its
measures. mmlu.py and gsm8k.py are the two shipped tasks.

``TaskSet(data, max_gen_toks=...)`` holds the lm-eval ``ConfigurableTask`` objects of one validated data set,
built lazily by the tasks and cached: their prompts, request construction, filters and ``process_results``
are lm-eval's own; only the dataset comes from :mod:`evals.data`.
"""
from __future__ import annotations

from dpep_parity.evals.tasks.base import HERE, EvalTask, Measure, doc_seed  # noqa: F401  (re-exported)
from dpep_parity.registry import Registry


def _measures_are_new(task: EvalTask) -> None:
    """A task needs a name and measures, and its measure names must not belong to another task."""
    taken = {m.name: t.name for t in TASKS.values() if t.name != task.name for m in t.measures}
    clash = [m.name for m in task.measures if m.name in taken]
    if not task.name or not task.measures or clash:
        raise ValueError(f"cannot register task {task.name!r}: it needs a name and measures"
                         + (f"; measures {clash} belong to other tasks" if clash else ""))


# the tasks: one module per task here (TASK), and outside packages' entry points (group dpep_parity.tasks)
TASKS: Registry[EvalTask] = Registry("tasks", package=__name__, attr="TASK", accept=EvalTask,
                                     order=lambda t: (t.order, t.name), noun="eval task")


def register(task: EvalTask) -> EvalTask:
    """Add a task (replacing one of the same name); its measure names must be new."""
    _measures_are_new(task)
    return TASKS.register(task, replace=True)


def unregister(name: str) -> None:
    TASKS.unregister(name)


def get(name: str) -> EvalTask:
    return TASKS.lookup(name)


def names() -> tuple[str, ...]:
    return tuple(TASKS)


def measures() -> dict[str, Measure]:
    """Every registered measure by name, in task order; two tasks (an outside one among them) may not share
    a measure's name."""
    out: dict[str, Measure] = {}
    owner: dict[str, str] = {}
    for t in TASKS.values():
        for m in t.measures:
            if m.name in out:
                raise ValueError(f"measure {m.name!r} of task {t.name!r} ({TASKS.origin(t.name)}) belongs to task "
                                 f"{owner[m.name]!r} already")
            out[m.name], owner[m.name] = m, t.name
    return out


def measure(name: str) -> Measure:
    try:
        return measures()[name]
    except KeyError:
        raise KeyError(f"unknown measure {name!r} (known: {', '.join(measures())})") from None


def default_margins() -> dict[str, float]:
    return {name: m.margin for name, m in measures().items()}


def runner_of(key: str):
    """What runs a cache key's samples: a task name (its `run`), or a task's truth measure (its `run_truth`)."""
    if key in TASKS:
        return TASKS[key].run
    for t in TASKS.values():
        if t.truth_measure == key:
            return t.run_truth
    raise KeyError(f"nothing runs {key!r}: neither a task nor a task's truth measure")


class TaskSet:
    """lm-eval task objects over one :class:`evals.data.EvalData`, built lazily by the tasks and cached."""

    def __init__(self, data, max_gen_toks: int = 256) -> None:
        self.data = data
        self.max_gen_toks = int(max_gen_toks)
        self._memo: dict[tuple, object] = {}

    def __getstate__(self) -> dict:
        """Pickled without the memo (lm-eval's task objects hold lambdas): a job process of `signoff --jobs`
        (evals/jobs.py) builds its own."""
        return {**self.__dict__, "_memo": {}}

    def memo(self, key: tuple, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def lm_task(self, name: str, *key):
        """Task `name`'s lm-eval ConfigurableTask (MMLU: one per subject, `key` = (subject,))."""
        return self.memo(("lm-task", name, *key), lambda: get(name).lm_eval_task(self, *key))

