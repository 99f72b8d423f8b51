"""Failures as typed, versioned records, end to end: the judge's checks (checks.judge.parity.ParityResult) -> a
property's failure (PropertyFailure, an AssertionError carrying records) -> the pytest plugin, which puts
each record on the test's report (`user_properties`, so junit XML and pytest-xdist carry it) and into
reports/property-suite.json -> the kill table, which reads the records, never the text.

A record's `schema` names its version; a reader refuses a version it does not know rather than guess
(`FailureRecord.from_json`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SCHEMA = "dpep.failure/1"
REPORT_KEY = "dpep_failure"      # the user property a test report carries one record under


class RecordError(ValueError):
    pass


@dataclass(frozen=True)
class FailedCheck:
    prop: str          # the property (checks.judge.parity.Check.prop): "parity", "liveness", "precision", ...
    message: str = ""


@dataclass(frozen=True)
class FailureRecord:
    """One failed example (or one pooled verdict) of a property test."""
    failed: tuple[FailedCheck, ...]
    unit: str | None = None
    layout: str | None = None
    batch: str | None = None
    dtype: str | None = None
    replay: str | None = None
    schema: str = SCHEMA

    @property
    def properties(self) -> list[str]:
        """The failed properties, in order, once each."""
        return list(dict.fromkeys(c.prop for c in self.failed))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FailureRecord:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise RecordError(f"not a failure record: {e}") from None
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise RecordError(f"failure record of schema {d.get('schema') if isinstance(d, dict) else None!r}; "
                              f"this reader knows {SCHEMA!r}")
        try:
            failed = tuple(FailedCheck(**c) for c in d.pop("failed"))
            return cls(failed=failed, **d)
        except (TypeError, KeyError) as e:
            raise RecordError(f"malformed failure record: {e}") from None


class PropertyFailure(AssertionError):
    """A property's failure: the text a person reads, and the records a tool reads."""

    def __init__(self, text: str, *records: FailureRecord) -> None:
        super().__init__(text)
        self.records = records


def records_of(exc: BaseException | None) -> list[FailureRecord]:
    """The records an exception carries, through exception groups (hypothesis reports distinct bugs as one)."""
    if isinstance(exc, PropertyFailure):
        return list(exc.records)
    if isinstance(exc, BaseExceptionGroup):
        return [r for e in exc.exceptions for r in records_of(e)]
    return []


def expect(res, text: str, replay: str | None = None) -> None:
    """Raise PropertyFailure(text) with the result's record unless the judged result passed."""
    if not res.ok:
        raise PropertyFailure(text, res.failure_record(replay))
