"""The suite's pytest plugin (entry point `pytest11: dpep`): options, hypothesis profiles, usage errors, the
`gpu` marker, GPU slicing per xdist worker, the report header and reports/property-suite.json.

Options: --target (spec, or package.module:object), --world-sizes, --dtypes, --models, --device,
--deadline, and the world kind (--world local|torchrun, --world-driver, --world-agents, --world-nproc). Hypothesis profiles (ci, the default; dev, fuzz, release, gpu, kill) are in checks/suite/profiles.py;
choose with --hypothesis-profile or DPEP_PROFILE, and DPEP_MAX_EXAMPLES always sets the count. The `gpu`
marker tags the production-size tier (property_tests/test_gpu.py), which skips without CUDA.

Installed (pip), pytest loads it by itself; from an engine's repository, name it and the tests:
`python -m pytest -p dpep --pyargs dpep_parity.property_tests.test_parity`. A plain checkout loads it from the root
conftest.py. Nothing here may rely on this repository's pyproject.toml (testpaths, addopts): from another
rootdir it does not apply.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import settings

from dpep_parity.checks.suite import profiles

# At import, before hypothesis's own plugin reads --hypothesis-profile in its pytest_configure: DPEP_PROFILE
# (or ci) is the base that hypothesis's options then build on.
profiles.load_default()


def pytest_addoption(parser):
    g = parser.getgroup("dpep", "DP-attention / TP / EP parity suite")
    g.addoption("--target", default=os.environ.get("DPEP_TARGET", "spec"),
                help="system under test: 'spec' or package.module:object (docs/targets.md)")
    g.addoption("--world-sizes", default=os.environ.get("DPEP_WORLD_SIZES", "1,2,4"),
                help="comma-separated world sizes (ranks) to draw layouts from, e.g. 1,2,4,8")
    g.addoption("--dtypes", default=os.environ.get("DPEP_DTYPES", "float32,bfloat16"))
    g.addoption("--models", default=os.environ.get("DPEP_MODELS", ""),
                help="fixture models to draw from (default: every fixture of the default suite; see dpep fixtures list)")
    g.addoption("--device", default=os.environ.get("DPEP_DEVICE", "cpu"), choices=("cpu", "cuda", "auto"))
    g.addoption("--deadline", type=float, default=float(os.environ.get("DPEP_DEADLINE", "60")),
                help="seconds an example may take before its world is diagnosed and killed")
    g.addoption("--world", default=os.environ.get("DPEP_WORLD", "local"),
                help="local: rank pools on this host (default); torchrun: the workers of torchrun agents on one "
                     "or more hosts (docs/property-suite.md, 'Worlds beyond one host')")
    from dpep_parity.checks.harness.world import WORLD_KINDS
    for kind in WORLD_KINDS.values():     # each world kind's own options (torchrun: --world-driver, ...)
        kind.addoptions(g)


@pytest.hookimpl(trylast=True)   # after hypothesis's plugin has loaded --hypothesis-profile
def pytest_configure(config):
    from dpep_parity.checks.suite.suite_options import parse
    config.dpep_suite, bad = parse(config.getoption("--target"), config.getoption("--world-sizes"),
                                   config.getoption("--dtypes"), config.getoption("--models"),
                                   config.getoption("--deadline"), config.getoption("--device"))
    bad += profiles.problems() + configure_world(config)
    from dpep_parity.checks.harness.gpus import controller_threads, oracle_thread
    for setting in (controller_threads, oracle_thread):
        try:
            setting()
        except ValueError as e:
            bad.append(str(e))
    if config.getoption("--device") == "cuda" and not hasattr(config, "workerinput"):
        from dpep_parity.checks.harness.gpus import visible_gpus
        if not visible_gpus():   # read with nvidia-smi: nothing initializes CUDA in the controller
            bad.append("--device cuda: no GPU is visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is "
                       "empty); use --device cpu, or auto to take GPUs when there are some")
    if bad:   # a usage error (exit 4) before anything is collected, every broken option at once
        raise pytest.UsageError("dpep options:\n  " + "\n  ".join(bad))
    profiles.apply_max_examples()
    config.addinivalue_line("markers", "gpu: production-size tier, needs CUDA (--device cuda|auto); "
                                       "skipped on CPU runs")
    if not hasattr(config, "workerinput"):
        # the invariance properties' drift log: one file per run, inherited by xdist's workers (started after
        # this hook), read back by pytest_terminal_summary
        import tempfile

        from dpep_parity.checks.judge.invariance import DRIFT_LOG
        fd, path = tempfile.mkstemp(prefix="dpep-drift-", suffix=".jsonl")
        os.close(fd)
        os.environ[DRIFT_LOG] = config._dpep_drift_log = path
    device = config.getoption("--device")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if device in ("cuda", "auto") and worker:
        from dpep_parity.checks.harness.gpus import assign_worker_gpus
        assign_worker_gpus(worker, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if device in ("cuda", "auto"):
        from dpep_parity.checks.harness.gpus import limit_controller_threads
        limit_controller_threads(device)


def configure_world(config) -> list[str]:
    """The world kind of this run (checks.harness.world.configure), or what is wrong with its options."""
    from dpep_parity.checks.harness import world
    name = config.getoption("--world")
    kind = world.WORLD_KINDS.get(name)
    settings = world.WorldSettings(name, kind.options_from(config.getoption) if kind else world.WorldOptions())
    sizes = list(config.dpep_suite.world_sizes) if config.dpep_suite else []
    n = getattr(config.option, "numprocesses", None)
    bad = settings.problems(sizes, n if isinstance(n, int) else 0)
    if not bad:
        world.configure(settings)
    return bad


def pytest_report_header(config):
    opts = config.dpep_suite        # parsed at configure time (a broken option stopped the run there)
    return [f"dpep: target={opts.target} device={opts.device} "
            f"world sizes={','.join(map(str, opts.world_sizes))} dtypes={','.join(opts.dtypes)} "
            f"world={config.getoption('--world')} "
            f"hypothesis profile={settings.get_current_profile_name()} "
            f"(max_examples={settings.default.max_examples})",
            device_header(opts.device, list(opts.world_sizes), config), *families_header(opts),
            *target_header(opts)]


def target_header(opts) -> list[str]:
    """What the target says of itself on this device (an optional `report_header(device)`)."""
    from dpep_parity.checks.targets.protocol import resolve
    try:
        header = getattr(resolve(opts.target), "report_header", None)
        return list(header(opts.device)) if header else []
    except Exception as e:      # noqa: BLE001 -- a header must not stop the run; the suite's checks report it
        return [f"dpep: the target's header failed: {type(e).__name__}: {e}"]


def families_header(opts) -> list[str]:
    """The requested fixtures the target leaves out (a family it declares it does not implement)."""
    from dpep_parity.checks.targets.protocol import left_out_fixtures
    try:
        left = left_out_fixtures(opts.target, opts.fixtures)
    except Exception:           # an unknown target or fixture is reported by the suite's option check
        return []
    return [f"dpep: fixture {f} left out: {why}" for f, why in left]


def device_header(device: str, sizes: list[int], config) -> str:
    """Which GPUs each test process gets and which backend each world size uses (checks.harness.world), read
    with nvidia-smi: nothing initializes CUDA in the controller."""
    from dpep_parity.checks.harness.world import describe_backends
    if device == "cpu":
        return "dpep worlds: " + describe_backends(sizes, 0)
    from dpep_parity.checks.harness.gpus import mps_daemon, visible_gpus, worker_slice
    gpus = visible_gpus()
    if not gpus:
        return "dpep worlds: --device auto, no GPU visible: " + describe_backends(sizes, 0)
    n = getattr(config.option, "numprocesses", None)
    workers = n if isinstance(n, int) and n > 0 else 1
    mine = worker_slice(gpus, 0, workers)
    share = f", one GPU shared by ~{-(-workers // len(gpus))} workers" if workers > len(gpus) else ""
    mps = mps_daemon()
    oracle = (f"; the oracle beside the ranks (MPS daemon at {mps})" if mps else
              "; the oracle after the ranks (no MPS daemon: docs/gpu.md)")
    return (f"dpep GPUs: {len(gpus)} visible [{','.join(gpus)}], {workers} test process(es), "
            f"{len(mine)} GPU(s) each (CUDA_VISIBLE_DEVICES per xdist worker{share}); worlds: "
            + describe_backends(sizes, len(mine)) + oracle)


def scaled_timeout(ini_timeout: float, max_examples: int, base_examples: int = 12) -> float:
    """pytest-timeout's per-test limit for a property search of `max_examples` examples: the configured one
    (a backstop for hangs the worlds' own deadlines miss, sized for the ci profile's 12 examples) grown in
    proportion to the count, so that a fuzz run's search is not cut for being long (`DPEP_PROFILE=fuzz`:
    500 examples of a unit take 15-40 minutes on two cores; a 900 s limit cut them)."""
    return ini_timeout * max(1.0, max_examples / base_examples) if ini_timeout > 0 else ini_timeout


def pytest_collection_modifyitems(config, items):
    """Property searches get a timeout scaled to their example count (scaled_timeout)."""
    try:
        ini = float(config.getini("timeout") or 0)
    except (ValueError, TypeError):   # pytest-timeout not installed: no such ini key
        return
    limit = scaled_timeout(ini, settings.default.max_examples)
    if limit == ini:
        return
    for item in items:
        if "property_tests" in str(item.path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed property's records (checks.core.records) onto its reports: the call's (pytest-xdist sends it to the
    controller; reports/property-suite.json reads it) and the item's, which the teardown report copies and
    junit XML writes as <properties>. The kill table reads them, not the text."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        from dpep_parity.checks.core.records import REPORT_KEY, records_of
        for rec in records_of(call.excinfo.value):
            report.user_properties.append((REPORT_KEY, rec.to_json()))
            item.user_properties.append((REPORT_KEY, rec.to_json()))


def _records(report) -> list[dict]:
    import json

    from dpep_parity.checks.core.records import REPORT_KEY
    return [json.loads(v) for k, v in getattr(report, "user_properties", ()) if k == REPORT_KEY]


def _is_property_test(report) -> bool:
    """A report of property_tests/. The node id is relative to the rootdir, and from another rootdir (--pyargs
    from an engine's repository) it may not name the package at all; the location's path always does."""
    location = getattr(report, "location", None) or ("",)
    return any("property_tests" in str(s) for s in (getattr(report, "nodeid", ""), location[0]))


def _test_id(report) -> str:
    """The node id, with the file put back when pytest left it out (a test file outside the rootdir)."""
    nodeid = report.nodeid
    return f"{report.location[0]}{nodeid}" if nodeid.startswith("::") else nodeid


def _drift_table(config) -> str:
    """The drift the invariance properties measured on a target that promised none (checks.judge.invariance)."""
    path = getattr(config, "_dpep_drift_log", None)
    if not path or not os.path.exists(path) or not os.path.getsize(path):
        return ""
    from dpep_parity.checks.judge.invariance import table_of_log
    return table_of_log(path).markdown()


def pytest_unconfigure(config):
    path = getattr(config, "_dpep_drift_log", None)
    if path and os.path.exists(path):
        os.unlink(path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Leave <rootdir>/reports/property-suite.json for the sign-off report to embed (property tests only)."""
    if hasattr(config, "workerinput"):
        return
    drift = _drift_table(config)
    if drift:
        terminalreporter.write_sep("-", "invariance drift (information: the target promises no such invariance)")
        terminalreporter.write_line(drift)
    stats = terminalreporter.stats
    props = {k: [r for r in stats.get(k, []) if _is_property_test(r)]
             for k in ("passed", "failed", "skipped", "error")}
    if not any(props.values()):
        return
    import json
    import pathlib
    import time
    counts = {k: len(v) for k, v in props.items()}
    out = pathlib.Path(config.rootpath) / "reports" / "property-suite.json"
    try:   # a rootdir we may not write (an engine's read-only checkout) costs the file, not the run's verdict
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "summary": f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
                       f"(target {config.dpep_suite.target}, profile {settings.get_current_profile_name()}, "
                       f"world sizes {','.join(map(str, config.dpep_suite.world_sizes))})",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **counts,
            "failed_tests": [_test_id(r) for r in props["failed"]],
            "failures": [{"test": _test_id(r), "records": _records(r)} for r in props["failed"]],
            "invariance_drift": drift}, indent=2))
    except OSError as e:
        terminalreporter.write_line(f"dpep: could not write {out}: {e}")
