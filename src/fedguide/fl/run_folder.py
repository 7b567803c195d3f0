"""A run folder: what it holds, what state it is in, and the one place that writes it.

    config.yaml      the resolved config (every default written out) with ``meta``: versions, commit, CPU
    partition.json   the clients' class (and domain) counts, the public pool, the scored test subset
    metrics.jsonl    one line per committed round
    checkpoints/     the last round's global weights, server state, metrics and pinned config
    client_state/, server_state/   per-client state, committed with each round
    model.safetensors, summary.json   written when the last round is done
    stopped.json     written when a run stops for good (it diverged)
    .lock            held by the process running the folder (``fl/run_lock.py``)

A folder is ``new`` (nothing of a run in it), ``unfinished`` (a run that can continue), ``finished``
(its summary covers the rounds asked for) or ``stopped`` (it diverged: continuing would diverge again).
Resuming and sweeps decide whether a folder holds the run a config describes by the same rule: the
*pinned* settings (what the run computes: not where it computes, how it is logged or summarised) must
agree, except that ``train.rounds`` may be raised.
"""
from __future__ import annotations

import copy
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import yaml

import fedguide
from fedguide.config import (NAMED_SECTIONS, PLACEMENT_KEYS, Config, ResolvedConfig, build_config, config_differences,
                             flat_keys, to_yaml)
from fedguide.core.atomic import remove_stale_temporaries, write_json, write_jsonl, write_text
from fedguide.fl.run_lock import RunLock
from fedguide.registry import ConfigError

if TYPE_CHECKING:
    from fedguide.fl.checkpoint import Checkpoint

CONFIG_FILE = "config.yaml"
PARTITION_FILE = "partition.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STOPPED_FILE = "stopped.json"
MODEL_FILE = "model.safetensors"
CHECKPOINTS = "checkpoints"

State = Literal["new", "unfinished", "finished", "stopped"]

# Where a run computes is not part of what it is: a run started on a GPU may resume on a CPU (the same
# metrics up to float rounding) and the other way round (config.PLACEMENT_KEYS); nor is how the summary condenses
# the curve (report:).
UNPINNED = tuple(tuple(key.split(".")) for key in PLACEMENT_KEYS)


Settings = Union[Config, ResolvedConfig]


def pinned_config(cfg: Settings) -> dict[str, Any]:
    """What a checkpoint pins: the resolved config without ``meta`` (versions, commit) and the device keys."""
    raw = (cfg.config if isinstance(cfg, ResolvedConfig) else cfg).model_dump(mode="json")
    raw.pop("meta", None)
    raw.pop("logging", None)  # how a run is watched is not what it computes: a resume may change it
    raw.pop("report", None)
    raw.pop("method_options", None)  # what it gives this run's method is in the method section
    for section, key in UNPINNED:
        raw.get(section, {}).pop(key, None)
    return raw


def default_keys(cfg: Settings) -> dict[str, Any]:
    """Dotted keys -> defaults: the config's own, and, for a resolved config, every parameter's of the entries
    its named sections name (a parameter a method gained since a run was pinned holds its default there)."""
    out = flat_keys(pinned_config(Config()))
    if not isinstance(cfg, ResolvedConfig):
        return out
    for section in (*NAMED_SECTIONS, "server_optimizer"):
        parsed = getattr(cfg, section, None)
        if parsed is None:
            continue
        try:
            params = parsed.entry.params()
        except ValueError:  # an entry with a required parameter has no default for it
            continue
        out.update(flat_keys(params.model_dump(mode="json"), f"{section}."))
    return out


def unpinned_defaults(pinned: dict[str, Any], now: dict[str, Any], defaults: Optional[dict[str, Any]] = None
                      ) -> dict[str, Any]:
    """``now`` without the keys a checkpoint written by an older fedguide lacks where they hold their
    default (a setting added since, such as train.precision: fp32 or a method's new parameter, did not change
    that run). ``defaults``: ``default_keys`` of the settings ``now`` was dumped from."""
    defaults = defaults if defaults is not None else flat_keys(pinned_config(Config()))
    old = flat_keys(pinned)
    dropped = {k for k, v in flat_keys(now).items() if k not in old and defaults.get(k, object()) == v}
    out = copy.deepcopy(now)
    for key in dropped:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node.pop(last, None)
    return out


def _config(cfg: Settings) -> Config:
    return cfg.config if isinstance(cfg, ResolvedConfig) else cfg


class HoldsRun(ConfigError):
    """A new run was asked for in a folder that holds one."""


@dataclass(frozen=True)
class SettingsComparison:
    """A folder's pinned settings (``held``) against the ones asked for now (``wanted``)."""

    differences: list[str]  # 'key: held vs wanted' for every pinned key but train.rounds
    held_rounds: int
    wanted_rounds: int

    @property
    def same(self) -> bool:
        return not self.differences


def as_written_then(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's config as it ran: a method parameter added since the run wrote its config, whose default
    differs from what runs did before it had one (the parameters class's ``written_before``: SCAFFOLD's
    ``correction``), takes that earlier value, so a resume continues the run as it started and a comparison
    sees what it ran. Anything it cannot place is returned as it is (validation says what is wrong)."""
    method = raw.get("method")
    if not isinstance(method, dict) or not isinstance(method.get("name"), str):
        return raw
    from fedguide.methods import METHODS

    try:
        earlier = getattr(METHODS.get(method["name"]).params, "written_before", {})
    except (ConfigError, KeyError, ValueError):
        return raw
    missing = {key: value for key, value in earlier.items() if key not in method}
    return {**raw, "method": {**method, **missing}} if missing else raw


def compare_pinned(held: dict[str, Any], wanted: dict[str, Any], labels: tuple[str, str],
                   defaults: Optional[dict[str, Any]] = None) -> SettingsComparison:
    """The one comparison behind ``resume`` and sweeps: every pinned key must agree except ``train.rounds``,
    which the caller judges (a resume may raise it; a sweep with fewer rounds finds the run finished).
    ``defaults``: ``default_keys`` of the settings ``wanted`` was dumped from."""
    held = as_written_then(held)
    wanted = unpinned_defaults(held, wanted, defaults)
    held_rounds, wanted_rounds = held["train"]["rounds"], wanted["train"]["rounds"]
    aligned = {**wanted, "train": {**wanted["train"], "rounds": held_rounds}}
    return SettingsComparison(config_differences(held, aligned, labels, limit=20), held_rounds, wanted_rounds)


def git_commit() -> Optional[str]:
    src = Path(fedguide.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def host_cpu() -> str:
    """The CPU's model name. Runs of one config on two CPU models may part in the last bits (their kernels
    round differently), and so may their later rounds: config.yaml says which CPU a run computed on."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


RESTORE = "restore the file the run wrote (from a backup, or undo the edit)"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); {RESTORE}") from None


def _read_yaml(path: Path) -> Any:
    """A YAML file's content; a file that is not YAML (or not text) is one line naming the place, not the
    parser's multi-line dump."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not text (byte {err.start} is not UTF-8); {RESTORE}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = ": ".join(str(part) for part in (err.context, err.problem) if part)
        raise ConfigError(f"{where}: not valid YAML ({what}); {RESTORE}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())}); {RESTORE}") from None


class RunFolder:
    """One run's folder. Reading never writes; every write is atomic (a crash leaves the previous file)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # ---- what it holds --------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def holds_run(self) -> bool:
        """Whether a run was started here (its config is written once its set-up succeeded)."""
        return (self.path / CONFIG_FILE).is_file() or self.checkpoints.exists()

    def read_config(self) -> Config:
        path = self.path / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"{self.path} is not a fedguide run directory (no {CONFIG_FILE}); "
                              "pass the folder a 'fedguide run' created")
        raw = _read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of settings, found {type(raw).__name__}; {RESTORE}")
        try:
            return build_config(as_written_then(raw))
        except ConfigError as err:
            raise ConfigError(f"{path} does not hold a valid config ({err}); {RESTORE}") from None

    def read_summary(self) -> Optional[dict[str, Any]]:
        """summary.json (None before the last round is done)."""
        path = self.path / SUMMARY_FILE
        if not path.is_file():
            return None
        summary = _read_json(path)
        if not isinstance(summary, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(summary).__name__}")
        return summary

    def read_partition(self) -> Optional[dict[str, Any]]:
        path = self.path / PARTITION_FILE
        if not path.is_file():
            return None
        partition = _read_json(path)
        if not isinstance(partition, dict) or not isinstance(partition.get("counts"), list):
            raise ValueError(f"{path}: expected an object with a 'counts' list (clients x classes)")
        return partition

    def read_stopped(self) -> Optional[dict[str, Any]]:
        path = self.path / STOPPED_FILE
        return _read_json(path) if path.is_file() else None

    def read_config_mapping(self) -> dict[str, Any]:
        """config.yaml as written, unvalidated (a report reads runs of older and newer versions alike); {} before
        the run wrote it."""
        path = self.path / CONFIG_FILE
        if not path.is_file():
            return {}
        try:
            loaded = _read_yaml(path)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping, got {type(loaded).__name__}")
        return loaded or {}

    def read_run_config(self, warnings: Optional[list[str]] = None) -> dict[str, Any]:
        """The run's settings as a report shows them: config.yaml, except that a pinned setting edited since the
        run wrote it is shown as the checkpoint pins it (what the run computed with), and ``warnings`` says so.
        A checkpoint whose metadata cannot be trusted is said in ``warnings`` and config.yaml shown as it is."""
        from fedguide.fl.checkpoint import read_pinned_config

        raw = self.read_config_mapping()
        try:
            pinned = read_pinned_config(self.checkpoints)
        except ConfigError as err:
            if warnings is not None:
                warnings.append(f"the settings shown are config.yaml's, not checked against the checkpoint: {err}")
            return raw
        if pinned is None:
            return raw
        written = flat_keys(raw)
        edited = {key: value for key, value in flat_keys(pinned).items() if key in written and written[key] != value}
        if not edited:
            return raw
        out = copy.deepcopy(raw)
        for key, value in edited.items():
            *parents, last = key.split(".")
            node = out
            for part in parents:
                node = node[part]
            node[last] = value
        if warnings is not None:
            changes = "; ".join(f"{k}: {written[k]!r} ({CONFIG_FILE}) vs {v!r} (checkpoint)" for k, v in edited.items())
            warnings.append(f"{self.path / CONFIG_FILE} was edited since the run wrote it ({changes}); the report "
                            "shows the settings the run was made with, pinned by its checkpoint")
        return out

    def read_metrics(self, running: bool = False, warnings: Optional[list[str]] = None) -> list[dict[str, Any]]:
        """The committed rounds. ``running``: the run may be writing its last line now, so a last line that is
        not JSON yet is skipped (and said in ``warnings``) instead of refused."""
        path = self.path / METRICS_FILE
        if not path.is_file():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        rows: list[dict[str, Any]] = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if running and lineno == len(lines):
                    if warnings is not None:
                        warnings.append(f"{path}:{lineno}: skipped a line that is not valid JSON ({err}); the run "
                                        "may be writing it now")
                    break
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
        return rows

    def written(self) -> bool:
        """Whether any of a run's records is here (config.yaml alone: a run before its first round)."""
        return any((self.path / name).is_file() for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, STOPPED_FILE))

    def finished(self, rounds: int) -> bool:
        """Whether the summary covers ``rounds`` rounds (a run raised past its summary is not finished)."""
        summary = self.read_summary()
        return summary is not None and summary.get("rounds", 0) >= rounds

    def state(self, rounds: int) -> State:
        """What the folder holds for a run of ``rounds`` rounds."""
        if not self.holds_run():
            return "new"
        if self.finished(rounds):
            return "finished"
        if (self.path / STOPPED_FILE).is_file():
            return "stopped"
        return "unfinished"

    def compare(self, cfg: Settings, labels: tuple[str, str] = ("run folder", "this config")) -> SettingsComparison:
        """The folder's config.yaml against ``cfg``, pinned keys only (``compare_pinned``)."""
        return compare_pinned(pinned_config(self.read_config()), pinned_config(cfg), labels, default_keys(cfg))

    def state_for(self, cfg: Settings) -> State:
        """The state of the folder for a run of ``cfg``; a ConfigError when it holds a run of other settings."""
        if not (self.path / CONFIG_FILE).is_file():
            return self.state(_config(cfg).train.rounds)
        try:
            comparison = self.compare(cfg, ("run folder", "this sweep"))
        except ConfigError as err:
            raise ConfigError(f"{self.path} holds a run whose config.yaml cannot be read ({err}); choose another "
                              "--out") from None
        if not comparison.same:
            raise ConfigError(f"{self.path} holds a run of other settings:\n  " + "\n  ".join(comparison.differences)
                              + "\nrun the sweep with the settings it was started with, or choose another --out")
        return self.state(_config(cfg).train.rounds)

    # ---- checks before a run ---------------------------------------------------------------------
    def rounds_kept(self) -> bool:
        """Whether a run here finished a round (a checkpoint, a metrics line, a summary or a stop record)."""
        return ((self.checkpoints / "last.safetensors").is_file()
                or any((self.path / name).is_file() for name in (METRICS_FILE, SUMMARY_FILE, STOPPED_FILE)))

    def check_fresh(self) -> None:
        if self.holds_run():
            raise HoldsRun(f"{self.path} already holds a run; continue it with 'fedguide resume {self.path}' "
                              "or choose another --out")

    def forget_refused(self) -> None:
        """After a new run here was refused before it finished a round (a setting its first round turned down):
        remove what it wrote, its uncommitted client state first (a new run's first round would read it as its
        own), so the corrected command may use the same folder. Under the lock: a folder another process holds
        now is left as it is."""
        import shutil

        try:
            with self.lock():
                if self.rounds_kept():
                    return
                for store in ("client_state", "server_state"):
                    for pending in (self.path / store).glob("pending-*"):
                        shutil.rmtree(pending)
                for name in (CONFIG_FILE, PARTITION_FILE):
                    (self.path / name).unlink(missing_ok=True)
        except ConfigError:  # busy: not ours to clear
            pass

    def check_writable(self) -> None:
        """The folder exists (made here) and takes files, or a sentence says why not."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path):
                pass
        except OSError as err:
            raise ConfigError(f"cannot write the run folder {self.path}: {err.strerror or err} "
                              f"({err.filename or self.path}); choose another --out, a folder you can write to") \
                from None

    def check_pinned(self, pinned_checkpoint: Optional[dict[str, Any]], cfg: Settings) -> SettingsComparison:
        """Refuse a ``cfg`` (the folder's config.yaml) that no longer describes the checkpointed run: every pinned
        key must agree, and train.rounds may only be raised."""
        comparison = compare_pinned(pinned_checkpoint, pinned_config(cfg), ("checkpoint", CONFIG_FILE),
                                    default_keys(cfg))
        old, new = comparison.held_rounds, comparison.wanted_rounds
        if comparison.same and new >= old:
            return comparison
        if comparison.same:
            rule, diff = "train.rounds may only be raised", [f"train.rounds: {old!r} (checkpoint) vs {new!r} ({CONFIG_FILE})"]
        else:
            rule = "a run continues with the settings it was made with; only train.rounds may be raised"
            diff = comparison.differences
        raise ConfigError(f"{self.path / CONFIG_FILE} was edited since the run started ({rule}):\n  "
                          + "\n  ".join(diff) + "\nundo the edit to resume, or start a new run: fedguide run "
                          f"{self.path / CONFIG_FILE} --out NEW_FOLDER")

    def check_unedited(self, cfg: Config) -> None:
        """``check_pinned`` against the folder's checkpoint, read without its tensors (a finished run is checked
        too: a lowered train.rounds would otherwise leave a config.yaml that no longer describes it)."""
        from fedguide.fl.checkpoint import read_pinned_config

        pinned = read_pinned_config(self.checkpoints)
        if pinned is not None:
            self.check_pinned(pinned, cfg)

    def resume_notes(self, pinned_checkpoint: Optional[dict[str, Any]], cfg: Settings, notes: dict[str, Any],
                     log: Callable[[str], None]) -> dict[str, Any]:
        """Refuse a resume whose config.yaml no longer describes the checkpointed run; the run's notes, with
        ``rounds_raised_from`` when train.rounds was raised (the one change allowed)."""
        notes = dict(notes)
        if pinned_checkpoint is None:  # a checkpoint written before configs were pinned
            return notes
        comparison = self.check_pinned(pinned_checkpoint, cfg)
        old, new = comparison.held_rounds, comparison.wanted_rounds
        if new > old:
            log(f"train.rounds raised from {old} to {new}: the run continues to round {new}")
            notes.setdefault("rounds_raised_from", old)
            self._record_rounds(new)
        return notes

    def _record_rounds(self, rounds: int) -> None:
        """config.yaml describes the run as it stands: a sweep that raised train.rounds continues the run, and a
        report pairing runs by their settings must see the new length, not the one the run started with. The
        rest of the file (its meta: the versions that started the run) is kept."""
        raw = self.read_config_mapping()
        if raw.get("train", {}).get("rounds") != rounds:
            raw.setdefault("train", {})["rounds"] = rounds
            write_text(self.path / CONFIG_FILE, yaml.safe_dump(raw, sort_keys=False))

    def lock(self) -> RunLock:
        return RunLock(self.path)

    def continue_hint(self) -> str:
        """How to go on after an interruption: resume once the run's config is written, else run again."""
        if (self.path / CONFIG_FILE).is_file():
            return f"continue with: fedguide resume {self.path}"
        return f"nothing of the run was kept yet; start it again with the same command and --out {self.path}"

    # ---- writing ----------------------------------------------------------------------------------
    def open_for_resume(self) -> None:
        """Drop what a killed process left half-written, and a stop record a resume supersedes."""
        remove_stale_temporaries(self.path)
        (self.path / STOPPED_FILE).unlink(missing_ok=True)

    def write_config(self, cfg: Config) -> None:
        import torch  # here, not at the top: reading a folder (a report) must not pay for importing torch

        cfg = cfg.model_copy(deep=True)
        cfg.meta = {"version": fedguide.__version__, "git_commit": git_commit(), "torch": torch.__version__,
                    "python": platform.python_version(), "cpu": host_cpu()}
        write_text(self.path / CONFIG_FILE, to_yaml(cfg))

    def write_partition(self, record: dict[str, Any]) -> None:
        write_json(self.path / PARTITION_FILE, record)

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        write_jsonl(self.path / METRICS_FILE, rows)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / SUMMARY_FILE, summary)

    def write_stopped(self, record: dict[str, Any]) -> None:
        write_json(self.path / STOPPED_FILE, record)

    def write_model(self, state: dict[str, Any]) -> None:
        from fedguide.core.sealed import save_sealed

        save_sealed(self.path / MODEL_FILE, state)

    def read_checkpoint(self) -> Optional["Checkpoint"]:
        """The last checkpoint, verified against its digests (None when the run has none); a damaged one is a
        DamagedCheckpoint naming the file."""
        from fedguide.fl.checkpoint import load_checkpoint

        return load_checkpoint(self.checkpoints)

    def read_model(self) -> dict[str, Any]:
        """model.safetensors' state dict, verified against its digests. One written before model files were
        sealed (no metadata) is read with a warning; a damaged one is a ConfigError naming the file."""
        from fedguide.core.sealed import Unverified, load_sealed

        path = self.path / MODEL_FILE
        try:
            opened = load_sealed(path, frozenset(), lambda meta: not meta)
        except Unverified as err:
            raise ConfigError(f"damaged model: {path}: {err.reason}. Restore the file from a backup, or run the "
                              f"run again: fedguide run {self.path / CONFIG_FILE} --out NEW_FOLDER") from None
        if opened.legacy:
            print(f"warning: {path} was written before model files carried a checksum; it is used unverified",
                  file=sys.stderr)
        return opened.tensors
