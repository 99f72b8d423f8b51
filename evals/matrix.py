"""The configuration matrix: a small declarative TOML (or YAML) file, validated before anything runs.

::

    [defaults]                      # optional: inherited by every [[config]]
    model = "fixture:qwen2-moe-shared"
    dtype = "float32"
    engine = "inproc"
    target = "spec"

    [gate]                          # optional: the verdict's parameters
    margin = 1.0                    # equivalence margin, accuracy points
    alpha = 0.05

    [[config]]
    name = "tp1"
    baseline = true
    tp = 1

Every broken rule is reported at once, each message naming the rule (see ``RULES``).
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from dpep_parity.evals.engines import ENGINES, EngineOptions

DTYPES = ("float32", "bfloat16", "float16", "auto")
GSM8K_METRICS = ("flexible-extract", "strict-match")
RULES = {
    "unique-names": "configuration names must be unique",
    "one-baseline": "exactly one configuration must have baseline = true",
    "tp%dp": "tp % dp == 0 (DP attention splits the TP group)",
    "tp%ep": "tp % ep == 0 (EP groups live inside the TP group)",
    "positive": "tp, dp, ep must be positive integers",
    "engine": "engine must name an engine kind (evals.engines.ENGINES: inproc, openai, sglang, plug-ins)",
    "required": "engine-specific required fields",
    "known-keys": "only known keys",
    "dtype": f"dtype must be one of {DTYPES}",
    "gate": "gate settings",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class MatrixError(ValueError):
    """The matrix file is invalid; ``problems`` lists every broken rule."""

    def __init__(self, problems: list[str], path: str | Path | None = None) -> None:
        self.problems = problems
        head = f"invalid configuration matrix{f' {path}' if path else ''}:"
        super().__init__("\n  - ".join([head, *problems]))


@dataclass
class Config:
    """One configuration of the matrix: the keys every engine shares, and its engine kind's own options
    (`options`, an instance of that kind's Options class: evals/engines). The TOML stays flat: a
    [[config]] table's keys are split between the two by `Config.make`."""
    name: str
    engine: str = "inproc"
    tp: int = 1
    dp: int = 1
    ep: int = 1
    baseline: bool = False
    model: str | None = None
    dtype: str = "float32"
    tokenizer: str | None = None       # default: the model path
    deterministic: bool | None = None  # default: the engine kind's (true for inproc)
    options: EngineOptions | None = None   # the engine kind's own keys (default: its Options())
    replica: int = 0                   # 1 for the A/A rerun of the baseline (set by the sign-off)
    model_path: str | None = None      # resolved by resolve_models()

    def __post_init__(self) -> None:
        if self.options is None and self.engine in ENGINES:
            self.options = ENGINES[self.engine].Options()

    @classmethod
    def make(cls, **keys) -> Config:
        """A configuration from flat keys (a [[config]] table, or code): the common ones and the engine's own.
        A key neither takes is a TypeError that names the engine."""
        engine = keys.get("engine", "inproc")
        kind = ENGINES.lookup(engine)
        own = {k: keys.pop(k) for k in list(keys) if k in kind.Options.keys()}
        unknown = set(keys) - COMMON_KEYS
        if unknown:
            raise TypeError(f"unknown key(s) {sorted(unknown)} for engine {engine!r}")
        return cls(**keys, options=kind.Options(**own))

    @property
    def layout(self) -> str:
        return f"tp={self.tp} dp={self.dp} ep={self.ep}"

    @property
    def is_deterministic(self) -> bool:
        return ENGINES.lookup(self.engine).deterministic if self.deterministic is None else bool(self.deterministic)


COMMON_KEYS = {f.name for f in fields(Config)} - {"options"}


def default_margins() -> dict[str, float]:
    """Equivalence margins in accuracy points per measure: each registered task's measures declare theirs, and
    why (evals/tasks/<task>.py; docs/evals.md, "Margins"): a margin is the smallest accuracy change a release
    must not ignore."""
    from dpep_parity.evals import tasks

    return tasks.default_margins()


@dataclass
class GateSettings:
    margin: float | dict = field(default_factory=default_margins)   # points, per measure
    alpha: float = 0.05
    power: float = 0.8
    gsm8k_metric: str = "flexible-extract"
    bootstrap: int = 2000                   # draws of the reported bootstrap interval (0: not computed)
    symmetry_draws: int = 20000             # Monte Carlo sign flips of the cluster symmetry test
    seed: int = 20240601
    min_agreement: float | None = None      # optional hard floor on answer/output agreement (fraction)
    max_logprob_drift: float | None = None  # optional hard ceiling on mean |delta logprob| (nats)
    truth: bool = True                      # half-precision in-process baseline: serve it in float64 too, for
                                            # the tolerance test of gsm8k-gold (gate.error_test)

    def margin_for(self, measure: str) -> float:
        if isinstance(self.margin, dict):
            return float(self.margin.get(measure, default_margins().get(measure, 1.0)))
        return float(self.margin)


@dataclass
class Matrix:
    configs: list[Config]
    gate: GateSettings
    path: Path | None = None

    @property
    def baseline(self) -> Config:
        return next(c for c in self.configs if c.baseline)

    def ordered(self) -> list[Config]:
        return [self.baseline] + [c for c in self.configs if not c.baseline]


_CONFIG_KEYS = COMMON_KEYS - {"replica", "model_path"}


def engine_keys() -> dict[str, set[str]]:
    """Every engine kind's own keys."""
    return {name: kind.Options.keys() for name, kind in ENGINES.items()}
_GATE_KEYS = {f.name for f in fields(GateSettings)}


def _read(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise MatrixError([f"cannot read the file: {e}"], path) from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise MatrixError([f"not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'TOML'}: {e}"],
                          path) from None
    if not isinstance(data, dict):
        raise MatrixError(["the file must hold a table/mapping at the top"], path)
    return data


def parse(data: dict, path: Path | None = None) -> Matrix:
    problems: list[str] = []
    unknown_top = set(data) - {"defaults", "gate", "config"}
    if unknown_top:
        problems.append(f"[known-keys] unknown top-level keys {sorted(unknown_top)} "
                        "(expected defaults, gate, config)")
    defaults = data.get("defaults") or {}
    entries = data.get("config") or []
    if not isinstance(entries, list) or not entries:
        raise MatrixError(problems + ["[required] no [[config]] entries"], path)
    owned = engine_keys()
    any_engine = set().union(*owned.values())
    for key in set(defaults) - _CONFIG_KEYS - any_engine:
        problems.append(f"[known-keys] [defaults] has unknown key {key!r}")

    configs: list[Config] = []
    for i, raw in enumerate(entries):
        if not isinstance(raw, dict):
            problems.append(f"[required] config #{i + 1} is not a table")
            continue
        engine = raw.get("engine", defaults.get("engine", "inproc"))
        mine = owned.get(engine, set())
        # [defaults] may hold keys of several engines: each configuration takes those its engine has
        merged = {k: v for k, v in defaults.items() if k in _CONFIG_KEYS | mine} | raw
        label = f"config {merged.get('name', f'#{i + 1}')!r}"
        if engine not in owned:
            problems.append(f"[engine] {label}: {RULES['engine']}, got {engine!r}")
            continue
        for key in sorted(set(raw) - _CONFIG_KEYS - mine):
            others = [n for n, keys in owned.items() if key in keys]
            problems.append(f"[known-keys] {label}: unknown key {key!r}"
                            + (f" for engine {engine!r} (an option of engine {' / '.join(map(repr, others))}"
                               + (": engine 'sglang' starts its own server" if key == "base_url" else "") + ")"
                               if others else ""))
        merged = {k: v for k, v in merged.items() if k in _CONFIG_KEYS | mine}
        if not isinstance(merged.get("name"), str) or not merged.get("name"):
            problems.append(f"[required] {label}: 'name' (a non-empty string) is required")
            continue
        if not re.fullmatch(r"[A-Za-z0-9][\w.=+-]*", merged["name"]):
            problems.append(f"[required] {label}: name may hold only letters, digits and . _ = + -")
        try:
            cfg = Config.make(**merged)
        except TypeError as e:
            problems.append(f"[required] {label}: {e}")
            continue
        problems += _check_config(cfg, label)
        configs.append(cfg)

    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"[unique-names] {RULES['unique-names']}: {dupes} appear more than once")
    baselines = [c.name for c in configs if c.baseline is True]
    if len(baselines) != 1:
        problems.append(f"[one-baseline] {RULES['one-baseline']}; found {len(baselines)}"
                        + (f": {baselines}" if baselines else ""))

    gate, gate_problems = _parse_gate(data.get("gate") or {})
    problems += gate_problems
    if problems:
        raise MatrixError(problems, path)
    return Matrix(configs=configs, gate=gate, path=path)


def _is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check_config(c: Config, label: str) -> list[str]:
    p: list[str] = []
    if not all(_is_pos_int(v) for v in (c.tp, c.dp, c.ep)):
        p.append(f"[positive] {label}: {RULES['positive']} (got {c.layout})")
    else:
        if c.tp % c.dp:
            p.append(f"[tp%dp] {label}: {RULES['tp%dp']} is false for tp={c.tp}, dp={c.dp}")
        if c.tp % c.ep:
            p.append(f"[tp%ep] {label}: {RULES['tp%ep']} is false for tp={c.tp}, ep={c.ep}")
    if not isinstance(c.baseline, bool):
        p.append(f"[required] {label}: baseline must be true or false")
    if c.dtype not in DTYPES:
        p.append(f"[dtype] {label}: {RULES['dtype']}, got {c.dtype!r}")
    if not c.model:
        p.append(f"[required] {label}: 'model' (a model directory, fixture:NAME or hub id) is required")
    return p + ENGINES[c.engine].problems(c, label)


def _parse_gate(raw: dict) -> tuple[GateSettings, list[str]]:
    p = [f"[known-keys] [gate] has unknown key {k!r}" for k in sorted(set(raw) - _GATE_KEYS)]
    g = GateSettings(**{k: v for k, v in raw.items() if k in _GATE_KEYS})
    if isinstance(g.margin, dict):
        known = default_margins()
        unknown = sorted(set(g.margin) - set(known))
        if unknown:
            p.append(f"[gate] margin has unknown measures {unknown} (known: {sorted(known)})")
        if not all(isinstance(v, int | float) and v > 0 for v in g.margin.values()):
            p.append(f"[gate] every margin must be a positive number of accuracy points, got {g.margin!r}")
        g.margin = {**known, **g.margin}
    elif not isinstance(g.margin, int | float) or not g.margin > 0:
        p.append(f"[gate] margin must be a positive number of accuracy points or a table per measure, "
                 f"got {g.margin!r}")
    if not isinstance(g.alpha, float) or not 0 < g.alpha < 0.5:
        p.append(f"[gate] alpha must be in (0, 0.5), got {g.alpha!r}")
    if not isinstance(g.power, float) or not 0 < g.power < 1:
        p.append(f"[gate] power must be in (0, 1), got {g.power!r}")
    if g.gsm8k_metric not in GSM8K_METRICS:
        p.append(f"[gate] gsm8k_metric must be one of {GSM8K_METRICS}, got {g.gsm8k_metric!r}")
    if not (_is_pos_int(g.bootstrap) or g.bootstrap == 0) or isinstance(g.bootstrap, bool):
        p.append("[gate] bootstrap must be a non-negative integer (0: no bootstrap interval)")
    if not _is_pos_int(g.symmetry_draws) or g.symmetry_draws < 1000:
        p.append("[gate] symmetry_draws must be an integer >= 1000")
    if g.min_agreement is not None and not 0 <= g.min_agreement <= 1:
        p.append("[gate] min_agreement must be a fraction in [0, 1]")
    if g.max_logprob_drift is not None and not g.max_logprob_drift >= 0:
        p.append("[gate] max_logprob_drift must be >= 0")
    if not isinstance(g.truth, bool):
        p.append(f"[gate] truth must be true or false, got {g.truth!r}")
    return g, p


def load_matrix(path: Path | str) -> Matrix:
    path = Path(path)
    return parse(_read(path), path)


# ---------------------------------------------------------------------------------------- models
def resolve_model(spec: str, engine: str, base: Path | None) -> str:
    """A local model directory (with config.json), ``fixture:NAME``, or (sglang/openai) a hub id."""
    if spec.startswith("fixture:"):
        name = spec.split(":", 1)[1]
        try:
            from dpep_parity.fixtures.build import fixture_path  # lazy: a colleague's module
        except ImportError as e:
            raise ValueError(f"model {spec!r} needs fixtures.build.fixture_path, which cannot be "
                             f"imported yet ({e})") from None
        try:
            path = Path(fixture_path(name))
        except Exception as e:  # noqa: BLE001 - any failure of the fixture builder is bad input here
            raise ValueError(f"fixture {name!r} could not be built: {type(e).__name__}: {e}") from None
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute() and not path.exists() and base is not None and (base / path).exists():
            path = base / path
        if not path.exists():
            if engine in ENGINES and ENGINES[engine].hub_ids and _HUB_ID.match(spec):
                return spec  # a hub id: the server fetches it
            raise ValueError(f"model path {spec!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return str(path.resolve())


def resolve_models(matrix: Matrix) -> None:
    """Fill ``model_path`` (and check tokenizers) for every config; raises MatrixError listing all."""
    problems = []
    base = matrix.path.parent if matrix.path else None
    for c in matrix.configs:
        try:
            c.model_path = resolve_model(c.model, c.engine, base)
        except ValueError as e:
            problems.append(f"[model] config {c.name!r}: {e}")
            continue
        if c.tokenizer:
            tok = Path(c.tokenizer).expanduser()
            if not tok.is_absolute() and not tok.exists() and base is not None and (base / tok).exists():
                tok = base / tok
            if tok.exists():
                c.tokenizer = str(tok.resolve())
            elif not _HUB_ID.match(c.tokenizer):
                problems.append(f"[model] config {c.name!r}: tokenizer {c.tokenizer!r} does not exist")
    if problems:
        raise MatrixError(problems, matrix.path)
