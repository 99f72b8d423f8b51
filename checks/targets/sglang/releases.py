"""SGLang's releases as the `sglang` target knows them: which era adapter runs each one, or why none does.

Standard library only: `dpep bisect`, the environment manager and the target's version check read it in the
suite's process without importing sglang or torch.

    from dpep_parity.checks.targets.sglang import releases
    releases.get("0.5.22").era            # 'layer_boundary'
    releases.between("0.5.8", "0.5.23")   # every known release in that range, oldest first
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata


class UnknownRelease(ValueError):
    pass


@dataclass(frozen=True)
class Release:
    version: str
    date: str                 # the wheel's build date (its files' timestamps)
    era: str | None = None    # module of checks/targets/sglang/eras/, None: not supported (see blocked)
    blocked: str = ""         # why no adapter runs this release
    deps: tuple[str, ...] = ()  # what this release needs in another version than the project environment
                                # has (measured by envs.install's import probe; empty: nothing)

    @property
    def supported(self) -> bool:
        return self.era is not None

    @property
    def key(self) -> tuple:
        return version_key(self.version)


def version_key(v: str) -> tuple:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", v)
    if not m:
        raise UnknownRelease(f"{v!r} is not an sglang release number (like 0.5.22 or 0.5.15.post1)")
    return tuple(int(g) if g is not None else 0 for g in m.groups())


_VLLM_NORM = ("on a CPU without AMX, sglang <= 0.5.7 replaces its own RMSNorm with vLLM's at import "
              "(layers/layernorm.py: `from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm`), "
              "and vLLM has no CPU build that installs beside torch 2.13 here: the model's norms would not be "
              "SGLang's (0.5.8 dropped the fallback)")

_TABLE = [
    # version, date, era or None, why not
    ("0.5.1", "2025-08-23", None, _VLLM_NORM),
    ("0.5.1.post3", "2025-08-27", None, _VLLM_NORM),
    ("0.5.2", "2025-09-11", None, _VLLM_NORM),
    ("0.5.3", "2025-10-06", None, _VLLM_NORM),
    ("0.5.3.post3", "2025-10-16", None, _VLLM_NORM),
    ("0.5.4", "2025-10-24", None, _VLLM_NORM),
    ("0.5.4.post3", "2025-11-05", None, _VLLM_NORM),
    ("0.5.5", "2025-11-06", None, _VLLM_NORM),
    ("0.5.5.post3", "2025-11-17", None, _VLLM_NORM),
    ("0.5.6", "2025-12-03", None, _VLLM_NORM),
    ("0.5.6.post2", "2025-12-11", None, _VLLM_NORM),
    ("0.5.7", "2026-01-01", None, _VLLM_NORM),
    ("0.5.8", "2026-01-23", "pre_bootstrap", ""),
    ("0.5.8.post1", "2026-02-05", "pre_bootstrap", ""),
    ("0.5.9", "2026-02-23", "pre_bootstrap", ""),
    ("0.5.10", "2026-04-05", "pre_bootstrap", ""),
    ("0.5.10.post1", "2026-04-08", "pre_bootstrap", ""),
    ("0.5.11", "2026-05-07", "pre_bootstrap", ""),
    ("0.5.12", "2026-05-16", "pre_bootstrap", ""),
    ("0.5.12.post1", "2026-05-23", "pre_bootstrap", ""),
    ("0.5.13", "2026-06-11", "pre_bootstrap", ""),
    ("0.5.13.post1", "2026-06-15", "pre_bootstrap", ""),
    ("0.5.14", "2026-06-26", "pre_bootstrap", ""),
    ("0.5.15", "2026-07-10", "pre_bootstrap", ""),
    ("0.5.15.post1", "2026-07-14", "pre_bootstrap", ""),
    ("0.5.16", "2026-07-25", "communicator", ""),
    ("0.5.17", "2026-08-08", "communicator", ""),
    ("0.5.18", "2026-08-21", "communicator", ""),
    ("0.5.19", "2026-09-04", "communicator", ""),
    ("0.5.20", "2026-09-18", "communicator", ""),
    ("0.5.21", "2026-10-01", "layer_boundary", ""),
    ("0.5.22", "2026-10-15", "layer_boundary", ""),
    ("0.5.23", "2026-10-30", "layer_boundary", ""),
]
RELEASES: tuple[Release, ...] = tuple(Release(v, d, e, b) for v, d, e, b in _TABLE)
DEFAULT = "0.5.23"            # what scripts/install_sglang_cpu.sh installs into the project's own environment


def installed_version() -> str | None:
    """The sglang release importable here (this interpreter's environment), or None."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def get(version: str) -> Release:
    version_key(version)
    for r in RELEASES:
        if r.version == version:
            return r
    raise UnknownRelease(f"sglang {version} is not a release the sglang target knows (known: "
                         f"{RELEASES[0].version} .. {RELEASES[-1].version}; checks/targets/sglang/releases.py)")


def supported() -> list[Release]:
    return [r for r in RELEASES if r.supported]


def between(lo: str, hi: str) -> list[Release]:
    """Every known release from lo to hi (both included, both must be known), oldest first."""
    a, b = get(lo), get(hi)
    if a.key > b.key:
        raise UnknownRelease(f"release range {lo}..{hi} is empty: {lo} is newer than {hi}")
    return [r for r in RELEASES if a.key <= r.key <= b.key]


def parse_range(text: str) -> list[Release]:
    """'0.5.21..0.5.23' (or a single release) -> the supported releases in it; UnknownRelease when a bound is
    not known or the range holds no supported release."""
    lo, sep, hi = text.partition("..")
    rels = between(lo.strip(), (hi if sep else lo).strip())
    ok = [r for r in rels if r.supported]
    if not ok:
        why = "; ".join(sorted({f"{r.version}: {r.blocked}" for r in rels}))
        raise UnknownRelease(f"release range {text} holds no release the sglang target supports ({why})")
    return ok
