"""Named registries: methods, datasets, partitions and models are looked up by the name a config gives.

Each entry may carry a pydantic ``Params`` model; a config section ``{name: x, **params}`` is
validated against it, so an unknown key or a wrong type is reported with the valid choices.
"""
from __future__ import annotations

import importlib
import pkgutil
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T")


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigError(ValueError):
    """A configuration problem; the message says what to change."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """" (did you mean 'x'?)" for the closest of ``choices`` to a mistyped ``word``; "" when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers and not booleans (int, float, Optional/Union/Annotated of them)."""
    if annotation in (int, float):
        return True
    if annotation is bool:
        return False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric(args[0])
    return any(_numeric(a) for a in args) and bool not in args


def bool_for_number(model: type[BaseModel], raw: Any) -> list[str]:
    """The keys of ``raw`` whose field takes a number but whose value is a boolean. pydantic turns
    ``lr: true`` into 1.0 without a word; a YAML boolean where a number belongs is a typo, not a value."""
    if not isinstance(raw, dict):
        return []
    return [k for k, v in raw.items() if isinstance(v, bool) and k in model.model_fields
            and _numeric(model.model_fields[k].annotation)]


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    params: type[BaseModel]
    summary: str


@dataclass(frozen=True)
class Parsed(Generic[T]):
    """A registry entry with its parameters parsed: what a named config section resolves to, once."""

    entry: Entry[T]
    params: BaseModel

    @property
    def name(self) -> str:
        return self.entry.name

    def dump(self) -> dict[str, Any]:
        """``{name, **params}``: the section as the resolved config writes it."""
        return {"name": self.entry.name, **self.params.model_dump(mode="json")}


def plugin_modules(package: str) -> list[str]:
    """``package`` and every public module below it, at any depth (rooms of a package included), sorted.
    A name starting with ``_`` at any level is private: helpers, never entries."""
    module = importlib.import_module(package)
    found = [package]
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=f"{package}."):
        if not any(part.startswith("_") for part in info.name[len(package) + 1:].split(".")):
            found.append(info.name)
    return sorted(found)


class Registry(Generic[T]):
    """Entries by name, with the one way fedguide discovers plug-ins: ``plugins`` names the packages (or
    modules) whose public modules register entries, at any depth. They are imported at the first lookup,
    so a registry never misses an entry because its module had not been imported yet, a new module in a
    declared package is registered without touching any other file, and a module holding entries never
    has to be imported by the one holding the registry (no import cycle)."""

    def __init__(self, kind: str, plugins: Sequence[str] = ()):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._plugins = tuple(plugins)
        self._loaded = not self._plugins

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # set first: the plugins' own imports may look entries up
        for package in self._plugins:
            for name in plugin_modules(package):
                importlib.import_module(name)

    def register(self, name: str, params: type[BaseModel] | None = None, summary: str = "") -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries:
                raise RuntimeError(f"{self.kind} '{name}' registered twice")
            doc = summary or ((getattr(obj, "__doc__", "") or "").strip().splitlines() or [""])[0]
            self._entries[name] = Entry(name, obj, params or getattr(obj, "Params", NoParams), doc)
            return obj

        return deco

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries

    def get(self, name: str) -> Entry[T]:
        self._load()
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} '{name}'{did_you_mean(name, self.names())}; valid choices: "
                              f"{', '.join(self.names())}")
        return self._entries[name]

    def parse(self, name: str, raw: dict[str, Any], where: str) -> Parsed[T]:
        """Entry ``name`` with ``raw`` (its section without ``name``) parsed by its Params model."""
        return Parsed(self.get(name), self.parse_params(name, raw, where))

    def parse_params(self, name: str, raw: dict[str, Any], where: str) -> BaseModel:
        """Validate ``raw`` (the section without ``name``) against the entry's Params model."""
        entry = self.get(name)
        wrong = bool_for_number(entry.params, raw)
        if wrong:
            raise ConfigError("; ".join(f"{where}.{k}: {raw[k]!r} is a boolean where a number belongs; write a number"
                                        for k in wrong))
        try:
            return entry.params.model_validate(raw)
        except ValidationError as err:
            fields = ", ".join(entry.params.model_fields) or "(none)"
            problems = "; ".join(
                f"{'.'.join([where, *(str(p) for p in e['loc'])])}: "
                + (f"{self.kind} '{name}' has no parameter '{e['loc'][0]}'"
                   f"{did_you_mean(str(e['loc'][0]), list(entry.params.model_fields))}"
                   if e["type"] == "extra_forbidden" and len(e["loc"]) == 1 else e["msg"].removeprefix("Value error, "))
                for e in err.errors()
            )
            raise ConfigError(f"{problems} — valid keys for {self.kind} '{name}': name, {fields}") from None
