"""The typed experiment config: YAML + dotted overrides -> validated, fully resolved settings.

Sections with a ``name`` (data, partition, model, method, runtime) carry the named entry's own parameters;
those are validated against the entry's ``Params`` model, so every default lives in one place and
the resolved config written to a run directory lists them all.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedguide.registry import ConfigError, bool_for_number


class Typed(BaseModel):
    """Numbers are numbers: a YAML boolean where a number belongs is refused (pydantic would read
    ``lr: true`` as 1.0)."""

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        wrong = bool_for_number(cls, data)
        if wrong:
            raise ValueError(", ".join(f"{k}: {data[k]!r} is a boolean where a number belongs" for k in wrong)
                             + "; write a number")
        return data


class Strict(Typed):
    model_config = ConfigDict(extra="forbid")


class Named(Typed):
    """A section selecting a registry entry; its other keys are that entry's parameters."""

    model_config = ConfigDict(extra="allow")
    name: str

    def params_dict(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DataConfig(Named):
    name: str = "fmnist"
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    public_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="stratified share of the training set held out as a public pool "
                                         "that no client receives (server-side public data, guidance pretraining)")
    public_seed: int = Field(0, description="fixes the public pool, independently of the run seed")


class RuntimeConfig(Named):
    """Where the clients train; the other keys are the named runtime's (``fl/runtimes/``)."""

    name: str = "local"


class ClientsConfig(Strict):
    num: int = Field(10, ge=1)
    per_round: int = Field(10, ge=1)


class TrainConfig(Strict):
    rounds: int = Field(20, ge=1)
    epochs: int = Field(1, ge=1)
    local_steps: Optional[int] = Field(
        None, ge=1, description="every client takes exactly this many optimiser steps per round, "
                                "passing over its data as often as needed (overrides epochs)")
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(1e-5, ge=0.0)
    eval_batch_size: int = Field(1024, ge=1)


class GuidanceConfig(Strict):
    """The ``guidance:`` section: which frozen text-to-image model and image encoder to load."""

    model: Optional[str] = Field(
        "embedded", description="SD-layout pipeline: 'embedded' (fedguide's own small trained models, offline), a "
                                "hub id (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1, "
                                "stabilityai/stable-diffusion-2-1-unclip) or a local folder of the same layout")
    revision: Optional[str] = Field(None, description="hub revision (branch, tag or commit) of a hub id")
    image_encoder: Optional[str] = Field(
        None, description="CLIP image encoder: a hub id or folder of a CLIPModel (zero-shot available) or a "
                          "CLIPVisionModelWithProjection; null = the pipeline's own image_encoder/ if it has one; "
                          "'none' = no image encoder")
    device: str = Field("auto", description="auto = cuda when available, else cpu")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto = float16 on a GPU, float32 on a CPU")
    feature_cache: Optional[str] = Field(
        None, description="folder of the feature cache; null = $FEDGUIDE_CACHE or ~/.cache/fedguide/features")
    rebuild: bool = Field(False, description="recompute cached features (fedguide run --rebuild)")

    def cache_dir(self) -> Path:
        if self.feature_cache:
            return Path(self.feature_cache).expanduser()
        return Path(os.environ.get("FEDGUIDE_CACHE", "~/.cache/fedguide/features")).expanduser()


class Config(Strict):
    data: DataConfig = DataConfig()
    partition: Named = Named(name="dirichlet")
    model: Named = Named(name="cnn")
    method: Named = Named(name="fedavg")
    clients: ClientsConfig = ClientsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    train: TrainConfig = TrainConfig()
    guidance: GuidanceConfig = GuidanceConfig()
    regularizers: list[Union[str, dict[str, Any]]] = Field(
        default_factory=list, description="terms added to any method's local objective, e.g. [dw]")
    seed: int = 0
    meta: dict[str, Any] = Field(default_factory=dict, description="written by fedguide: version, git commit")

    @model_validator(mode="after")
    def _clients(self) -> "Config":
        if self.clients.per_round > self.clients.num:
            raise ValueError(
                f"clients.per_round ({self.clients.per_round}) exceeds clients.num ({self.clients.num}); "
                "lower clients.per_round"
            )
        return self


# Keys a named section owns itself (not parameters of the entry it names).
SECTION_KEYS = {"data": ("fraction", "public_fraction", "public_seed")}


def parse_value(text: str) -> Any:
    """Override values are YAML scalars/lists: 'mu=0.01' -> 0.01, 'regularizers=[dw]' -> ['dw']."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value; write e.g. train.rounds=5")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override key '{key}' is malformed; write dotted keys like method.mu=0.01")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{p}' is a value, not a section")
            node = nxt
        if parts[-1] == "name" and len(parts) == 2 and node.get("name") not in (None, value):
            # Switching method/model/partition/dataset drops the old entry's parameters, which the
            # new one would reject as unknown keys; the section's own keys (data.fraction) stay.
            own = set(SECTION_KEYS.get(parts[0], ()))
            kept = {k: v for k, v in node.items() if k in own}
            node.clear()
            node.update(kept)
        node[parts[-1]] = parse_value(value)
    return out


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = e["loc"][:-1]
            model: Any = Config
            for p in section:
                model = model.model_fields[p].annotation if p in getattr(model, "model_fields", {}) else None
            valid = ", ".join(getattr(model, "model_fields", {})) if model else ""
            msg = f"unknown key{'; valid keys: ' + valid if valid else ''}"
        lines.append(f"{loc}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_raw(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass a YAML file such as configs/smoke.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if raw is None:  # an empty file is more often a mistake than a wish for every default: say so
        d = Config()
        print(f"warning: {path} is empty; every default runs ({d.method.name} on {d.data.name}, {d.partition.name} "
              f"partition over {d.clients.num} clients, {d.model.name}, {d.train.rounds} rounds; --dry-run prints "
              "them all)", file=sys.stderr)
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a YAML mapping (data:, method:, ...), not {type(raw).__name__}")
    return raw


def build_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: Path, overrides: list[str] | None = None) -> Config:
    return build_config(apply_overrides(load_raw(path), overrides or []))


def flat_keys(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys: {"train": {"lr": 0.1}} -> {"train.lr": 0.1}."""
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flat_keys(v, f"{prefix}{k}."))
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str], limit: int = 8) -> list[str]:
    """'key: a value (label a) vs b value (label b)' for every dotted key two config dumps disagree on."""
    fa, fb = flat_keys(a), flat_keys(b)
    missing = object()
    lines = [f"{k}: {fa.get(k, '(unset)')!r} ({labels[0]}) vs {fb.get(k, '(unset)')!r} ({labels[1]})"
             for k in sorted(set(fa) | set(fb)) if fa.get(k, missing) != fb.get(k, missing)]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
