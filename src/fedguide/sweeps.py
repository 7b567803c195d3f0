"""Sweeps: ``--sweep KEY=VALUES`` axes, their combinations, and the plan that checks every combination
and finds what its run folder already holds before the first run starts.

VALUES is either a YAML list (``seed=[0, 1, 2]``, ``model.mapping=[[64, 64], []]``: each item one value)
or values separated by commas (``seed=0,1,2``; a comma inside brackets or quotes does not separate,
so ``method.layers=[1],[2]`` is two list values). Each combination's run folder is named from its
values (``name=fedavg-seed=0``), the same on every invocation, so a sweep run again into the same
parent folder skips its finished runs and continues the unfinished ones.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import yaml

from fedguide.config import Config, ResolvedConfig, apply_overrides, build_config, flat_keys, parse_value, to_yaml
from fedguide.registry import ConfigError

if TYPE_CHECKING:
    from fedguide.fl.run_folder import RunFolder, State

# Characters a folder name cannot hold on some system (or that would make a sub-folder).
_UNSAFE = re.compile(r'[/\\:*?"<>|\s\x00-\x1f]')


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[Any, ...]
    labels: tuple[str, ...]  # each value as it appears in folder names and printed labels


@dataclass(frozen=True)
class Combination:
    settings: tuple[tuple[str, Any], ...]  # (dotted key, value) per axis
    labels: tuple[str, ...]
    names: tuple[str, ...] = ()  # each key as the folder name writes it (``grid``: its last part where unique)

    @property
    def overrides(self) -> list[tuple[str, Any]]:
        return list(self.settings)

    @property
    def label(self) -> str:
        """'method.name=fedavg seed=0'."""
        return " ".join(f"{k}={lab}" for (k, _), lab in zip(self.settings, self.labels))

    @property
    def folder(self) -> str:
        """'name=fedavg-seed=0': each key by its last part (the whole dotted key where two axes share a last
        part: 'method.name=fedavg-data.name=digits') with its value."""
        names = self.names or tuple(k.split(".")[-1] for k, _ in self.settings)
        return "-".join(f"{n}={_UNSAFE.sub('_', lab)}" for n, lab in zip(names, self.labels))


def value_label(value: Any) -> str:
    """A value as written in a label: strings as they are, anything else as compact JSON ([64,64], true)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def split_values(text: str) -> list[str]:
    """'a,[1,2],"x,y"' -> ['a', '[1,2]', '"x,y"']: commas inside brackets, braces or quotes do not split."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0 or quote:
        raise ConfigError(f"unbalanced brackets or quotes in the sweep values '{text}'; write them as a YAML list, "
                          "e.g. [[64, 64], []]")
    return parts + [text[start:]]


def axis(key: str, values: Sequence[Any], labels: Optional[Sequence[str]] = None) -> Axis:
    """One sweep axis; ``labels`` default to ``value_label`` of each value."""
    key = key.strip()
    if not key or not all(key.split(".")):
        raise ConfigError(f"sweep key '{key}' is malformed; write dotted keys like method.mu")
    values = list(values)
    if not values:
        raise ConfigError(f"--sweep {key} has no values; write e.g. --sweep {key}=[v1, v2]")
    labels = [value_label(v) for v in values] if labels is None else list(labels)
    seen: dict[str, Any] = {}
    for v in values:
        canon = json.dumps(v, sort_keys=True, default=str)
        if canon in seen:
            raise ConfigError(f"--sweep {key} lists the value {value_label(v)} twice; give each value once (a list "
                              f"value goes inside the list of values: --sweep '{key}=[[64, 64], []]')")
        seen[canon] = v
    return Axis(key, tuple(values), tuple(labels))


def parse_axis(spec: str) -> Axis:
    """``KEY=VALUES`` as ``--sweep`` takes it (the module docstring gives the two forms)."""
    if "=" not in spec:
        raise ConfigError(f"--sweep '{spec}' is not key=values; write e.g. --sweep seed=0,1,2 or --sweep 'seed=[0, 1, 2]'")
    key, text = spec.split("=", 1)
    parts = split_values(text)
    if len(parts) == 1 and text.strip().startswith("["):
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"--sweep '{spec}': the values are not a valid YAML list ({err}); write e.g. "
                              f"--sweep '{key}=[[64, 64], []]'") from None
        return axis(key, values)
    return axis(key, [parse_value(p) for p in parts], [p.strip() for p in parts])


def grid(axes: Sequence[Axis]) -> list[Combination]:
    """Every combination of the axes (the first axis varies slowest), each with its own run folder."""
    keys = [a.key for a in axes]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ConfigError(f"--sweep {repeated[0]} is given twice; list all its values in one --sweep")
    lasts = [k.split(".")[-1] for k in keys]
    names = tuple(last if lasts.count(last) == 1 else key for key, last in zip(keys, lasts))
    combos = [Combination(tuple((a.key, v) for a, (v, _) in zip(axes, pick)), tuple(lab for _, lab in pick), names)
              for pick in itertools.product(*(list(zip(a.values, a.labels)) for a in axes))]
    folders: dict[str, Combination] = {}
    for c in combos:
        if c.folder in folders:
            raise ConfigError(f"the sweep combinations '{folders[c.folder].label}' and '{c.label}' would share the "
                              f"run folder {c.folder}; give values that differ in more than punctuation")
        folders[c.folder] = c
    return combos


@dataclass
class PlannedRun:
    combination: Combination
    config: Config  # resolved: every default written out
    run_dir: Path
    state: "State"  # new; unfinished (resumed); finished or stopped (diverged: resuming would diverge again), skipped
    partition_summary: dict[str, Any]


def plan(raw: dict[str, Any], overrides: Sequence[Union[str, tuple[str, Any]]], combos: Sequence[Combination],
         parent: Path) -> list[PlannedRun]:
    """Resolve and prepare every combination (data, partition, model, method, regularisers, runtime)
    and read its run folder; a ConfigError names every invalid combination with its error, before
    anything runs or any folder is written."""
    from fedguide.fl.preflight import check, refuse_runtime
    from fedguide.fl.run_folder import RunFolder

    parent = Path(parent)
    named = {parent / c.folder for c in combos}
    # Run folders of this parent that no combination names: a sweep before an axis was added (its runs hold
    # that axis' value of the config) or before its folders were named as now. A new combination whose
    # settings one of them holds continues it there instead of recomputing it under a new name.
    others = sorted(p for p in parent.iterdir() if p not in named and (p / "config.yaml").is_file()) \
        if parent.is_dir() else []
    planned, errors = [], []
    for combo in combos:
        try:
            cfg = build_config(apply_overrides(raw, [*overrides, *combo.overrides]))
            folder = RunFolder(parent / combo.folder)
            prepared = check(cfg)
            state = folder.state_for(prepared.resolved)
            if state == "new":
                held = _holding(others, prepared.resolved)
                if held is not None:
                    others.remove(held.path)
                    folder, state = held, held.state_for(prepared.resolved)
            refuse_runtime(prepared.config, folder.path, resume=state != "new")
            planned.append(PlannedRun(combo, prepared.config, folder.path, state, prepared.data.summary()))
        except ValueError as err:  # ConfigError and what building a model or method refuses
            errors.append(f"{combo.label}: {err}")
    if errors:
        raise ConfigError(f"{len(errors)} of {len(combos)} sweep combinations are invalid, so none ran:\n  "
                          + "\n  ".join(e.replace("\n", "\n    ") for e in errors))
    check_like_with_like(planned)
    return planned


# What a sweep's combinations may differ in beside the swept keys: the method's own section and regularisers
# (a sweep over methods) and what fedguide writes (meta).
OWN_PER_COMBINATION = ("method", "regularizers", "meta")


def check_like_with_like(planned: Sequence[PlannedRun]) -> None:
    """A sweep compares its combinations, so they must differ only in what it sweeps: a setting that resolves
    differently for different combinations without being swept (a model default a method brought, ...) is an
    error naming it, before anything runs."""
    if len(planned) < 2:
        return
    swept = {k for p in planned for k, _ in p.combination.settings}
    # Sweeping a section's entry (partition.name) sweeps that entry's parameters with it.
    swept |= {k.rsplit(".", 1)[0] for k in swept if k.endswith(".name")}

    def free(key: str) -> bool:
        return not any(key == s or key.startswith(s + ".") for s in (*swept, *OWN_PER_COMBINATION))

    flats = [{k: v for k, v in flat_keys(p.config.model_dump(mode="json")).items() if free(k)} for p in planned]
    missing = object()
    differing = sorted({k for f in flats for k in f if any(g.get(k, missing) != f.get(k, missing) for g in flats)})
    if differing:
        shown = []
        for key in differing[:4]:
            values = ", ".join(f"{json.dumps(f.get(key), default=str)} ({p.combination.label})"
                               for f, p in zip(flats, planned))
            shown.append(f"{key}: {values}")
        raise ConfigError("the sweep's combinations would differ in more than the swept keys, so its table would "
                          "compare unlike runs:\n  " + "\n  ".join(shown)
                          + "\nset these keys in the config (or as overrides) so every combination shares them, or "
                          "sweep them too")


def _holding(folders: list[Path], cfg: ResolvedConfig) -> Optional["RunFolder"]:
    """The first of ``folders`` that holds a run of ``cfg``'s settings (train.rounds aside), if any."""
    from fedguide.fl.run_folder import RunFolder

    for path in folders:
        folder = RunFolder(path)
        try:
            if folder.compare(cfg).same:
                return folder
        except ValueError:  # a folder whose config cannot be read holds no run of these settings
            continue
    return None


def dry_run_text(runs: Sequence[PlannedRun]) -> str:
    """Each combination's resolved config and partition summary under a comment line naming it."""
    blocks = []
    for i, p in enumerate(runs, 1):
        blocks.append(f"# sweep run {i}/{len(runs)}: {p.combination.label}  (folder {p.run_dir.name}: {p.state})\n"
                      + to_yaml(p.config) + "partition summary: " + json.dumps(p.partition_summary) + "\n")
    return "".join(blocks)
