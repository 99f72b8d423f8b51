"""What an engine kind is (`Engine`, with its own options `EngineOptions`), the interface every in-process
engine implements (`ForwardEngine`), and the errors engines raise.

An engine kind is one module of evals/engines defining ``ENGINE`` (or an outside package's entry point of
group ``dpep_parity.engines``; evals.engines.ENGINES): its name (a [[config]]'s `engine`), its options class
(the keys of a [[config]] table it owns beyond the common ones), its checks (static, when the matrix is read;
pre-flight, before the baseline runs), and how it opens an lm-eval LM for a configuration. The matrix, the
sign-off and the cache ask the kind; none of them branches on its name.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ForwardEngine(Protocol):
    """One full forward pass per request, no cache: what the eval adapter needs from an engine."""

    name: str

    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        """Per request: float32 logits ``[len(tokens), vocab]`` for every position."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """An engine could not be built, started or reached."""


@dataclasses.dataclass
class EngineOptions:
    """An engine kind's own keys of a [[config]] table: the fields of its subclass, with their defaults."""

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def identity(self) -> dict:
        """What of these options determines a configuration's answers (the sample cache's fingerprint)."""
        return dataclasses.asdict(self)


def is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


class Engine:
    """A kind of engine a configuration runs on. Subclasses set `name` and `Options` and implement `open`."""
    name: ClassVar[str] = ""
    Options: ClassVar[type[EngineOptions]] = EngineOptions
    deterministic: ClassVar[bool] = False   # do its answers repeat exactly (the A/A rerun's default)
    hub_ids: ClassVar[bool] = False         # may `model` be a hub id the engine fetches itself
    forced_scores: ClassVar[bool] = False   # does its LM score teacher-forced tokens (gsm8k-gold's measure)
    truth: ClassVar[bool] = False           # can it serve the baseline in float64 (the tolerance test's truth)

    def problems(self, config, label: str) -> list[str]:
        """Broken rules of this kind's options, found when the matrix is read ('[rule] label: ...')."""
        return []

    def preflight(self, config) -> list[str]:
        """What stops this configuration from running, found before the baseline runs (a dead server, a
        missing package, an unimportable plug-in)."""
        return []

    def concurrent(self, config) -> bool:
        """May this configuration run beside another on this machine (`signoff --jobs`): its processes are its
        own and it takes no GPU or server another run needs. Default no."""
        return False

    def describe(self, config) -> str:
        """What the report's configuration table names as what runs (a target, a server)."""
        return self.name

    def drift_target(self, config) -> str | None:
        """The in-process target whose served drift the sign-off measures (checks.serving.invariance), if any."""
        return None

    @contextlib.contextmanager
    def open(self, config, max_gen_toks: int, log_dir: Path) -> Iterator[Any]:
        """Yield an lm-eval LM for the configuration; whatever it started is ended on exit."""
        raise NotImplementedError
        yield
