"""One cached virtual environment per SGLang release, for the `sglang` target, `dpep bisect` and the museum.

    python -m checks.targets.sglang.envs install 0.5.21 0.5.22     # (dpep sglang-env install ...)
    python -m checks.targets.sglang.envs list
    python -m checks.targets.sglang.envs python 0.5.21             # the interpreter to run the suite with

A release's environment is layered over the environment this command runs in (the project's, where torch
2.13.0 CPU, transformers and SGLang's light dependencies are installed by scripts/install_sglang_cpu.sh):
a venv of its own holding `sglang==X --no-deps` and whatever that release needs in another version
(`releases.Release.deps`), with a `.pth` file that appends the project environment's site-packages after its
own. So the release's sglang shadows the project's, torch / transformers / the suite itself are the same
objects for every release (the oracle never changes with the release under test), and a release costs its
wheel (30-100 MB), not a second 2.7 GB install. Rank processes inherit it: they are spawned with the
environment's interpreter. An environment is usable once its marker file exists (written last, after an
import probe of the modules the target drives): an interrupted install is redone, never half-used.

Location: $DPEP_SGLANG_ENVS, default ~/.cache/dpep-parity/sglang-envs/<version>. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from dpep_parity.checks.targets.sglang import releases
from dpep_parity.progname import prog

MARKER = "dpep-sglang-env.json"
# What the import probe loads: every sglang module the target's session, batch and units import first.
PROBE = ("from dpep_parity.checks.targets.sglang import cpu_shims; cpu_shims.install_import_shims(); "
         "import sglang.srt.server_args, sglang.srt.model_executor.model_runner, sglang.srt.models.qwen3_moe, "
         "sglang.srt.models.qwen2_moe, sglang.srt.layers.attention.torch_native_backend; "
         "from importlib import metadata; print(metadata.version('sglang'))")


def root() -> Path:
    return Path(os.environ.get("DPEP_SGLANG_ENVS") or Path.home() / ".cache" / "dpep-parity" / "sglang-envs")


def env_dir(version: str) -> Path:
    return root() / version


def _env_python(d: Path) -> Path:
    return d / "bin" / "python"


def ready(version: str) -> bool:
    return (env_dir(version) / MARKER).is_file()


def python_for(version: str) -> str:
    """The interpreter that runs release `version`: this one when it has that release installed (the
    project's own environment), else its cached environment (which must be ready)."""
    if releases.installed_version() == version:
        return sys.executable
    if not ready(version):
        raise RuntimeError(f"sglang {version}: no environment at {env_dir(version)} (python -m "
                           f"checks.targets.sglang.envs install {version})")
    return str(_env_python(env_dir(version)))


def _run(cmd: list[str], log, what: str) -> None:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{tail}")
    log(f"  {what}: {time.perf_counter() - t0:.1f} s")


def _size_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def install(version: str, log=print, constraints: str | None = None) -> Path:
    """Build (or find) the environment of `version`; returns its directory. Refuses an unknown or unsupported
    release before anything is downloaded."""
    rel = releases.get(version)
    if not rel.supported:
        raise releases.UnknownRelease(f"sglang {version}: {rel.blocked}")
    d = env_dir(version)
    if ready(version):
        log(f"sglang {version}: ready at {d}")
        return d
    if d.exists():
        log(f"sglang {version}: removing an unfinished environment at {d}")
        shutil.rmtree(d)
    t0 = time.perf_counter()
    log(f"sglang {version}: building {d}")
    d.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--without-pip", str(d)], log, "venv")
    py = _env_python(d)
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                         "['purelib'])"], text=True).strip())
    base = sysconfig.get_paths()["purelib"]
    # The project environment after the release's own packages (addsitedir also runs its .pth files: the
    # suite's editable install among them).
    (site / "zz_dpep_project_env.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", f"sglang=={version}"], log, f"pip install --no-deps sglang=={version}")
    if rel.deps:
        c = ["-c", constraints] if constraints else []
        _run([*pip, *c, *rel.deps], log, f"pip install {' '.join(rel.deps)}")
    _run([str(py), "-c", PROBE], log, "import probe")
    info = {"version": version, "seconds": round(time.perf_counter() - t0, 1), "mb": round(_size_mb(d), 1),
            "deps": list(rel.deps), "base": base}
    (d / MARKER).write_text(json.dumps(info, indent=1))
    log(f"sglang {version}: ready in {info['seconds']} s, {info['mb']} MB")
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.targets.sglang.envs"),
                                 description="Cached environments of SGLang releases (docs/sglang.md, 'Releases').")
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="build the environments of these releases (cached)")
    i.add_argument("versions", nargs="+")
    i.add_argument("--constraints", default=None, help="pip constraints for the releases' own dependencies")
    sub.add_parser("list", help="every known release: supported or why not, and its environment")
    p = sub.add_parser("python", help="print the interpreter that runs a release")
    p.add_argument("version")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "install":
            for v in a.versions:             # every name checked before anything installs
                if not releases.get(v).supported:
                    raise releases.UnknownRelease(f"sglang {v}: {releases.get(v).blocked}")
            for v in a.versions:
                install(v, constraints=a.constraints)
        elif a.cmd == "python":
            releases.get(a.version)
            print(python_for(a.version))
        else:
            for r in releases.RELEASES:
                where = (f"ready: {env_dir(r.version)}" if ready(r.version) else
                         "installed here" if releases.installed_version() == r.version else "no environment")
                print(f"{r.version:14} {r.date}  {r.era or '-':15} {where if r.supported else r.blocked}")
    except releases.UnknownRelease as e:
        ap.error(str(e))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
