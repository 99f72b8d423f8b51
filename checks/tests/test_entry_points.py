"""Every kind of addition from an outside package, through its entry point (dpep_parity.registry), with no
file of this repository edited: a unit, a target, a mutant, a fixture, a world kind, an eval task and an
engine kind, written into a temporary directory as an installed distribution (`dpep_outside`, with its
`.dist-info/entry_points.txt`) and run in a fresh process that has it on its path.

- the outside target runs the outside unit on the outside fixture, on worlds the outside world kind gives,
  and passes (`dpep replay`: the judge, the oracle and the world are this repository's);
- the outside mutant (the MoE output reduced twice) fails the same replay through `checks.catalog.mutants:X99`;
- the sign-off runs the outside task on the outside fixture, the candidate on the outside engine kind;
- controls: without the distribution on the path none of the names exists (each lookup's error lists the
  known ones), and an entry point whose object is of the wrong kind is refused, naming its distribution.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpep_parity.registry import Registry, RegistryError

pytestmark = pytest.mark.slow     # a whole sub-run per test (checks/suite/tiers.py)

PLUGIN = {
    "__init__.py": '"""An outside package that adds one of each kind to dpep-parity (checks/tests/test_entry_points.py)."""\n',
    "unit.py": """
        import dataclasses

        from dpep_parity.checks.units.moe import UNIT as MOE

        # the MoE block under another name: the outside target implements it
        UNIT = dataclasses.replace(MOE, name="moe-outside", order=90)
        """,
    "target.py": """
        import dataclasses

        from dpep_parity.checks.targets.spec import SpecTarget


        class OutsideTarget(SpecTarget):
            name = "outside"
            units = ("moe", "attention", "decoder", "model", "moe-outside")

            def run(self, m, step):
                if step.unit == "moe-outside":
                    step = dataclasses.replace(step, unit="moe")
                return super().run(m, step)


        TARGET = OutsideTarget()
        """,
    "mutant.py": """
        import torch.distributed as dist

        from dpep_parity.checks.catalog.mutants import Mutant
        from dpep_parity.checks.targets.spec import SpecModel


        class ReducedTwice(SpecModel):
            def reduce_and_scatter(self, y, step, mode):
                dist.all_reduce(y, group=self.g.tp)
                return super().reduce_and_scatter(y, step, mode)


        MUTANT = Mutant("X99", "outside-double-reduction", "wrong numbers", "the MoE output reduced twice",
                        ReducedTwice, ("parity",))
        """,
    "fixture.py": """
        from dpep_parity.fixtures.specs import FixtureSpec

        SPEC = FixtureSpec(name="outside-qwen3", arch="qwen3_moe", seed=4242, num_attention_heads=8, head_dim=32,
                           num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                           in_default_suite=False)
        """,
    "world.py": """
        import os

        from dpep_parity.checks.harness.world import World, WorldKind


        class MarkedWorlds(WorldKind):
            '''Local worlds of its own, each start written to $OUTSIDE_MARK.'''
            name = "outside-local"

            def __init__(self):
                self.pool = {}

            def world(self, settings, size, device, deadline_s):
                w = self.pool.get(size) or self.pool.setdefault(size, World(size, device, deadline_s))
                with open(os.environ["OUTSIDE_MARK"], "a") as f:
                    f.write(f"{size}\\n")
                return w.start()


        KIND = MarkedWorlds()
        """,
    "task.py": """
        # the registry tests' one-file task (a log-likelihood echo), offered through an entry point
        from dpep_parity.evals.tests.echo_task import EchoTask

        TASK = EchoTask()
        """,
    "engine.py": """
        import contextlib
        import dataclasses

        from dpep_parity.evals.engines.base import Engine, EngineOptions


        @dataclasses.dataclass
        class Options(EngineOptions):
            label: str = "outside"


        class OutsideHF(Engine):
            '''transformers on one device, opened by an outside engine kind'''
            name = "outside-hf"
            Options = Options
            deterministic = True

            def problems(self, config, label):
                return [] if (config.tp, config.dp, config.ep) == (1, 1, 1) else [f"[required] {label}: one device"]

            def describe(self, config):
                return f"outside-hf ({config.options.label})"

            @contextlib.contextmanager
            def open(self, config, max_gen_toks, log_dir):
                from dpep_parity.evals.engines.hf_local import HFForwardEngine
                from dpep_parity.evals.lm_adapter import ForwardEngineLM
                engine = HFForwardEngine(config.model_path, config.dtype)
                try:
                    yield ForwardEngineLM(engine=engine, tokenizer=config.model_path, max_gen_toks=max_gen_toks)
                finally:
                    engine.close()


        ENGINE = OutsideHF()
        """,
}

ENTRY_POINTS = """
[dpep_parity.units]
moe-outside = dpep_outside.unit:UNIT

[dpep_parity.targets]
outside = dpep_outside.target:TARGET

[dpep_parity.mutants]
X99 = dpep_outside.mutant:MUTANT

[dpep_parity.fixtures]
outside-qwen3 = dpep_outside.fixture:SPEC

[dpep_parity.worlds]
outside-local = dpep_outside.world:KIND

[dpep_parity.tasks]
echo = dpep_outside.task:TASK

[dpep_parity.engines]
outside-hf = dpep_outside.engine:ENGINE
"""

MATRIX = """
[defaults]
model = "fixture:outside-qwen3"

[[config]]
name = "base"
baseline = true
engine = "inproc"
target = "hf"

[[config]]
name = "outside"
engine = "outside-hf"
label = "from an entry point"
"""


def install(site: Path, entry_points: str = ENTRY_POINTS) -> Path:
    """Write dpep_outside into `site` as pip would install it: the package and its .dist-info."""
    pkg = site / "dpep_outside"
    pkg.mkdir(parents=True)
    for name, text in PLUGIN.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip())
    info = site / "dpep_outside-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dpep-outside\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points.lstrip())
    return site


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outside")
    site = install(tmp / "site")
    data = tmp / "data" / "echo"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join(json.dumps({"word": w}) + "\n" for w in
                                             ("apple", "ducks", "eggs", "Janet", "market", "the")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OUTSIDE_MARK": str(tmp / "worlds.txt"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return tmp, env


def dpep(args, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpep_parity.checks.tools.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


REPLAY = ["replay", "--fixture", "outside-qwen3", "--layout", "tp2-dp2-ep2", "--dtype", "float32", "--layer", "1",
          "--batch", "dp0:0+3 dp1:idle seed=5"]


def test_an_outside_target_runs_an_outside_unit_on_an_outside_fixture_and_world(outside):
    tmp, env = outside
    r = dpep([*REPLAY, "--target", "outside", "--unit", "moe-outside"], {**env, "DPEP_WORLD": "outside-local"}, tmp)
    assert r.returncode == 0 and "PASS" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert (tmp / "worlds.txt").read_text().split() == ["2"]      # the outside kind gave the world


def test_an_outside_mutant_is_caught_through_the_catalog(outside):
    tmp, env = outside
    r = dpep([*REPLAY, "--target", "checks.catalog.mutants:X99", "--unit", "moe"], env, tmp)
    assert r.returncode == 1 and "FAIL" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_the_sign_off_runs_an_outside_task_on_an_outside_engine(outside):
    tmp, env = outside
    (tmp / "m.toml").write_text(MATRIX)
    r = dpep(["signoff", "--matrix", str(tmp / "m.toml"), "--data-dir", str(tmp / "data"), "--tasks", "echo",
              "--echo-limit", "5", "--out", str(tmp / "out"), "--no-progress"], env, tmp)
    assert r.returncode in (0, 4), (r.stdout + r.stderr)[-3000:]
    rep = json.loads((tmp / "out" / "signoff.json").read_text())
    assert rep["tasks"] == ["echo"]
    (cmp,) = rep["comparisons"]
    assert cmp["n"] == 5 and cmp["agreement"] == 1.0
    rows = {c["name"]: c for c in rep["configs"]}
    assert rows["outside"]["engine"] == "outside-hf" and rows["outside"]["target"] == "outside-hf (from an entry point)"


def test_without_the_distribution_none_of_its_names_exists(tmp_path):
    """Control: the same lookups in a process without dpep_outside fail, each naming the known ones."""
    code = textwrap.dedent("""
        from dpep_parity.checks import units
        from dpep_parity.checks.catalog import mutants
        from dpep_parity.checks.targets.protocol import TARGETS
        from dpep_parity.checks.harness.world import WORLD_KINDS
        from dpep_parity.evals import tasks
        from dpep_parity.evals.engines import ENGINES
        from dpep_parity.fixtures.specs import FIXTURES
        for reg, name in ((units.REGISTRY, "moe-outside"), (TARGETS, "outside"), (mutants.CATALOG, "X99"),
                          (FIXTURES, "outside-qwen3"), (WORLD_KINDS, "outside-local"), (tasks.TASKS, "echo"),
                          (ENGINES, "outside-hf")):
            try:
                reg.lookup(name)
            except KeyError as e:
                print(e.args[0])
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 7, r.stdout + r.stderr
    assert "unknown unit 'moe-outside': one of moe, attention, decoder, model" in lines
    assert any(ln.startswith("unknown world kind 'outside-local': one of local") for ln in lines)


def test_an_entry_point_of_the_wrong_kind_or_a_taken_name_is_refused_naming_its_distribution(tmp_path):
    site = install(tmp_path / "site", "[dpep_parity.units]\nbad = dpep_outside.fixture:SPEC\n\n"
                                      "[dpep_parity.fixtures]\noutside-qwen3 = dpep_outside.fixture:SPEC\n")
    sys.path.insert(0, str(site))
    try:
        from dpep_parity.checks.units import Unit
        from dpep_parity.fixtures.specs import FixtureSpec
        with pytest.raises(RegistryError, match=r"entry point 'bad' .* of dpep-outside gives a FixtureSpec, not "
                                                r"a Unit"):
            list(Registry("units", accept=Unit))
        taken = Registry("fixtures", accept=FixtureSpec)
        taken.register(FixtureSpec(name="outside-qwen3", arch="qwen3_moe", seed=1))
        with pytest.raises(RegistryError, match=r"'outside-qwen3' from entry point .* of dpep-outside is already "
                                                r"taken by register\(\)"):
            list(taken)
    finally:
        sys.path.remove(str(site))
        for m in [m for m in sys.modules if m.startswith("dpep_outside")]:
            del sys.modules[m]
