"""One registry idiom for every kind of addition: units, targets, mutants, eval tasks, world kinds, model
families and fixtures.

A registry is a read-only mapping from name to object, filled on first read from three sources, in order:
1. the objects its own package registers in code (`register`, or a decorator that calls it: the mutant
   catalog), or names it by reference (`refer`: 'package.module:attr', imported on first lookup, so that a
   heavy target such as SGLang's is imported only where it runs);
2. a scan of its own package: every module that defines the registry's attribute (`UNIT`, `FAMILY`,
   `TASK`, ...), the repository's "one file per addition";
3. the entry points of group ``dpep_parity.<kind>`` of every installed distribution, each naming one object
   (``my_unit = my_pkg.units:UNIT``), so that an outside package adds any kind without editing this one.

Reading is lazy, so a plugin module may import this package's modules at its top without a circle at start
up. An entry point that fails to load, or one whose name is taken, is an error that names its distribution:
a silently dropped plugin would look like a check that passed.

Why not lm-eval's `lm_eval.api.registry.Registry` (0.4.13): its idiom is the one kept here (aliases, lazy
materialisation, a base-class check, a KeyError that lists the known names), but lm-eval is an optional
dependency (the `eval` extra) that the property suite and the kill table must not need, and it scans no
entry-point group itself. Entry points come from `importlib.metadata`, the mechanism pytest's plugins use.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")

GROUP_PREFIX = "dpep_parity."


class RegistryError(ValueError):
    pass


class Registry(Mapping[str, T], Generic[T]):
    """`kind`: the entry-point group's suffix. `package` and `attr`: the package whose modules are scanned for
    `attr`. `names`: the names an object is registered under (default: its `name`; a family registers each
    of its `archs`). `accept`: the objects this registry holds (an entry point to anything else is an
    error). `order`: sort key of the merged mapping (default: the order found). `check`: raises ValueError
    for an object that may not join. `noun`: what one item is called in errors (default: `kind` less its s)."""

    def __init__(self, kind: str, *, package: str | None = None, attr: str | None = None,
                 names: Callable[[T], tuple[str, ...]] | None = None, accept: type | tuple[type, ...] = object,
                 order: Callable[[T], Any] | None = None, check: Callable[[T], None] | None = None,
                 noun: str | None = None) -> None:
        self.kind, self.group, self.noun = kind, GROUP_PREFIX + kind, noun or kind.rstrip("s")
        self.package, self.attr = package, attr
        self._names = names or (lambda obj: (obj.name,))
        self.accept, self.order, self.check = accept, order, check
        self._code: dict[str, T] = {}
        self._code_origin: dict[str, str] = {}     # where each of _code came from
        self._items: dict[str, T] | None = None      # the merged view (code, scan, entry points)
        self._origins: dict[str, str] = {}           # where each of _items came from

    # ---------------- registering in code
    def _put(self, name: str, obj, origin: str) -> None:
        self._code[name] = obj
        self._code_origin[name] = origin
        self._items = None                  # the merged view is rebuilt on the next read

    def register(self, obj: T, *, replace: bool = False) -> T:
        """Add an object (a decorator may call this). Names must be new unless `replace`."""
        self._validate(obj, "register()")
        for name in self._names(obj):
            if not replace and name in self._code:
                raise RegistryError(f"{self.kind}: {name!r} is registered twice")
            self._put(name, obj, "register()")
        return obj

    def refer(self, name: str, ref: str) -> None:
        """Register `name` as 'package.module:attr', imported on its first lookup."""
        if name in self._code:
            raise RegistryError(f"{self.kind}: {name!r} is registered twice")
        self._put(name, _Ref(ref), ref)

    def unregister(self, name: str) -> None:
        self._code.pop(name, None)
        self._items = None

    def __setitem__(self, name: str, obj: T) -> None:
        """Replace (or add) one entry under `name`: what a test's monkeypatch.setitem does."""
        self._validate(obj, "setitem")
        self._put(name, obj, "setitem")

    def __delitem__(self, name: str) -> None:
        self.unregister(name)

    # ---------------- reading
    def _load(self) -> dict[str, T]:
        if self._items is not None:
            return self._items
        items: dict[str, T] = dict(self._code)
        origin = dict(self._code_origin)
        if self.package and self.attr:
            pkg = importlib.import_module(self.package)
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
                if info.name.startswith("_"):
                    continue
                obj = getattr(importlib.import_module(f"{self.package}.{info.name}"), self.attr, None)
                if obj is not None and isinstance(obj, self.accept):
                    self._add(items, origin, obj, f"{self.package}.{info.name}")
        for ep in sorted(entry_points(group=self.group), key=lambda e: e.name):
            where = f"entry point {ep.name!r} ({ep.value}) of {ep.dist.name if ep.dist else 'an unknown distribution'}"
            try:
                obj = ep.load()
            except Exception as e:
                raise RegistryError(f"{self.kind}: {where} failed to load: {type(e).__name__}: {e}") from e
            self._add(items, origin, self._materialize(obj, where), where)
        if self.order is not None:
            items = dict(sorted(items.items(), key=lambda kv: self.order(kv[1])))
        self._items, self._origins = items, origin
        return items

    def _add(self, items: dict, origin: dict, obj: T, where: str) -> None:
        for name in self._names(obj):
            if name in items and items[name] is not obj:
                raise RegistryError(f"{self.kind}: {name!r} from {where} is already taken by {origin[name]}")
            items[name], origin[name] = obj, where

    def _materialize(self, obj: Any, where: str) -> T:
        """An entry point's or a reference's object: a class stands for its instance (registries hold
        objects), checked like a registered one."""
        obj = obj() if isinstance(obj, type) else obj
        self._validate(obj, where)
        return obj

    def _validate(self, obj: Any, where: str) -> None:
        if not isinstance(obj, self.accept):
            want = getattr(self.accept, "__name__", str(self.accept))
            raise RegistryError(f"{self.kind}: {where} gives a {type(obj).__name__}, not a {want}")
        if self.check is not None:
            try:
                self.check(obj)
            except (TypeError, ValueError) as e:
                raise RegistryError(f"{self.kind}: {where}: {e}") from e

    def origin(self, name: str) -> str:
        """Where a name came from: a module of this package, register(), or an entry point and its
        distribution."""
        self._load()
        return self._origins[name]

    def lookup(self, name: str) -> T:
        """The object registered as `name`, or an error that lists the known names."""
        items = self._load()
        if name not in items:
            raise KeyError(f"unknown {self.noun} {name!r}: one of {', '.join(items) or '(none)'}")
        return self[name]

    def __getitem__(self, name: str) -> T:
        items = self._load()
        obj = items[name]
        if isinstance(obj, _Ref):
            mod, _, attr = obj.ref.partition(":")
            obj = self._materialize(getattr(importlib.import_module(mod), attr), obj.ref)
            items[name] = self._code[name] = obj
        return obj

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._load())})"


class _Ref:
    """A registered 'package.module:attr', imported on first lookup."""

    def __init__(self, ref: str) -> None:
        self.ref = ref

    def __repr__(self) -> str:
        return f"<{self.ref}>"
