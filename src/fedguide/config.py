"""The typed experiment config: YAML + dotted overrides -> validated, fully resolved settings.

Sections with a ``name`` (data, partition, model, method, runtime) carry the named entry's own parameters;
those are validated against the entry's ``Params`` model, so every default lives in one place and
the resolved config written to a run directory lists them all. ``fl.setup.resolve`` parses each of them
once into a ``ResolvedConfig`` (entry + parsed parameters per section), which every later step reads.
"""
from __future__ import annotations

import copy
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from fedguide.core.device import DEVICE_NAMES, DEVICE_SUMMARIES
from fedguide.core.schedules import lr_at
from fedguide.registry import ConfigError, Parsed, bool_for_number, did_you_mean

# The closed sets of choices a config names are types, so a wrong value is refused when the config is loaded,
# with the choices, not when a run reaches the code that reads it. The device specs come from core/device.py,
# which resolves them. The augmentation recipes are defined here, as data/augment.py (a layer above) implements
# them. The logging back-ends are registered in fl/loggers.py (``LOGGERS``), which no layer below fl may
# import, so their names are written here and the tests hold the two equal.
AUGMENTATIONS = {"none": "no augmentation",
                 "crop": "random crop after 4 px zero padding (no flips: digits)",
                 "crop_flip": "crop + horizontal flip with p = 0.5 (the CIFAR recipe)",
                 "autoaugment": "crop_flip + AutoAugment's ImageNet policy (three-channel images)"}
LOGGER_NAMES = ("csv", "tensorboard", "wandb")
AugmentName = Literal[tuple(AUGMENTATIONS)]
LoggerName = Literal[LOGGER_NAMES]
DeviceName = Literal[DEVICE_NAMES]
_CUDA_INDEX = re.compile(r"^cuda:\d+$")


def _device_spec(value: Any) -> Any:
    # One sentence with every choice, instead of pydantic's two errors (one per member of the union below).
    if isinstance(value, str) and (value in DEVICE_NAMES or _CUDA_INDEX.match(value)):
        return value
    raise ValueError(f"{value!r} is not a device; write one of {', '.join(DEVICE_SUMMARIES)}")


# cuda:N is open-ended, so it is a pattern beside the names' Literal.
DeviceSpec = Annotated[Union[DeviceName, Annotated[str, StringConstraints(pattern=_CUDA_INDEX.pattern)]],
                       BeforeValidator(_device_spec)]


def choices() -> dict[str, dict[str, str]]:
    """The device specs and augmentation recipes, each with its one-line summary (``fedguide list``; the
    logging back-ends are ``LOGGERS``' entries)."""
    return {"devices": dict(DEVICE_SUMMARIES), "augmentations": dict(AUGMENTATIONS)}


def choices_comment() -> str:
    """The choices as YAML comment lines (``fedguide run --dry-run`` prints them above the resolved config)."""
    return (f"# train.device, guidance.device: one of {', '.join(DEVICE_SUMMARIES)}\n"
            f"# train.augment: one of {', '.join(AUGMENTATIONS)}\n"
            f"# logging: any of {', '.join(LOGGER_NAMES)} (fedguide list describes each choice)\n")


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


# A search budget (the dirichlet partition's), not a property of the split it finds: two runs that differ only
# here hold the same partition.
NOT_IN_PARTITION_LABEL = ("max_tries",)


def partition_label(name: str, params: dict[str, Any]) -> str:
    """The name a run's summary and its report give a partition section: ``dirichlet(alpha=0.1, min_size=10)``."""
    shown = ", ".join(f"{k}={v}" for k, v in params.items() if k not in NOT_IN_PARTITION_LABEL)
    return f"{name}({shown})" if shown else name


class DataConfig(Named):
    name: str = "fmnist"
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    public_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="stratified share of the training set held out as a public pool "
                                         "that no client receives (server-side public data, guidance pretraining)")
    public_seed: int = Field(0, description="fixes the public pool, independently of the run seed")
    on_device: Union[Literal["auto"], bool] = Field(
        "auto", description="keep the training and test tensors on train.device (8-bit images as uint8): "
                            "auto = when they fit in half its free memory; true = always (an error if not); false = "
                            "on the host, batches copied over")
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of the training data held out for validation (seeded by the run "
                                         "seed); every round scores it (val_accuracy), report picks the round by it")
    val_from: Literal["server", "clients"] = Field(
        "server", description="server: a stratified share of the training set before the partition; clients: the "
                              "same share of each client's data, per class (each class keeps one training sample)")


class RuntimeConfig(Named):
    """Where the clients train; the other keys are the named runtime's (``fl/runtimes/``)."""

    name: str = "local"


class ClientsConfig(Strict):
    num: int = Field(10, ge=1)
    per_round: int = Field(10, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="share of each round's sampled clients that fail "
                                                            "(seeded per round; their uploads are missing)")
    stragglers: float = Field(0.0, ge=0.0, le=1.0, description="share of each round's training clients that return "
                                                              "late, with only clients.straggler_steps local steps")
    straggler_steps: int = Field(1, ge=1, description="the local steps a straggler completes before its upload is "
                                                      "taken (its train.local_steps)")


class ScheduleConfig(Strict):
    """``train.schedule``: the local learning rate per round (core/schedules.py)."""

    name: Literal["constant", "exponential", "step", "cosine"] = Field(
        "constant", description="constant; exponential: lr*gamma^(r-1) (FedRCL: gamma 0.998); step: "
                                "lr*gamma^floor((r-1)/step_rounds); cosine: down to min_lr over train.rounds")
    gamma: float = Field(0.998, gt=0.0, le=1.0, description="decay factor of exponential (per round) and step "
                                                             "(per step_rounds rounds)")
    step_rounds: int = Field(10, ge=1, description="rounds between two decays of step")
    min_lr: float = Field(0.0, ge=0.0, description="the learning rate cosine reaches after train.rounds rounds")


class TrainConfig(Strict):
    rounds: int = Field(20, ge=1)
    epochs: int = Field(1, ge=1)
    local_steps: Optional[int] = Field(
        None, ge=1, description="every client takes exactly this many optimiser steps per round, "
                                "passing over its data as often as needed (overrides epochs)")
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0.0)
    schedule: ScheduleConfig = Field(ScheduleConfig(), description="the local learning rate over rounds: train.lr "
                                                                   "is round 1's")
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(1e-5, ge=0.0)
    eval_batch_size: int = Field(1024, ge=1)
    device: DeviceSpec = Field("auto", description="where the model trains and is evaluated: auto (cuda when "
                                                   "available, else cpu), cpu, cuda, cuda:N, mps or simulated")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="autocast of the forward passes: bf16 (GPU or CPU) or fp16 (GPU, with gradient scaling)")
    channels_last: bool = Field(False, description="train convolutional models in the channels-last memory format")
    compile: bool = Field(False, description="torch.compile the model's forward for training")
    augment: AugmentName = Field("none", description="training augmentation on the device: none, crop, crop_flip, "
                                                     "autoaugment (data/augment.py)")
    deterministic: bool = Field(False, description="deterministic algorithms (and cuBLAS's fixed workspace): the "
                                                   "same run twice on one GPU gives the same metrics")
    cudnn_benchmark: bool = Field(
        True, description="when not deterministic: cuDNN searches for the fastest convolution algorithms of each "
                          "new input shape (one search per shape, the first round's cost: the clients' last batches "
                          "differ in size); false skips the search. No effect without cuDNN")


    def at_round(self, round_: int) -> "TrainConfig":
        """These settings with round ``round_``'s learning rate (itself when the schedule is constant)."""
        s = self.schedule
        if s.name == "constant":
            return self
        return self.model_copy(update={"lr": lr_at(s.name, self.lr, round_, self.rounds, s.gamma, s.step_rounds,
                                                   s.min_lr)})


class GuidanceConfig(Strict):
    """The ``guidance:`` section: which frozen text-to-image model and image encoder to load."""

    model: Optional[str] = Field(
        "embedded", description="SD-layout pipeline: 'embedded' (fedguide's own small trained models, offline), a "
                                "hub id (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1, "
                                "stabilityai/stable-diffusion-2-1-unclip) or a local folder of the same layout; "
                                "'oracle' is a diagnostic, never a default: a small CNN trained on the labels of "
                                "the embedded models' pretraining pool serves its penultimate features as the "
                                "guidance features (an upper bound for the feature-guided methods; image "
                                "generation refused; guidance/oracle)")
    revision: Optional[str] = Field(None, description="hub revision (branch, tag or commit) of a hub id")
    image_encoder: Optional[str] = Field(
        None, description="CLIP image encoder: a hub id or folder of a CLIPModel (zero-shot available) or a "
                          "CLIPVisionModelWithProjection; null = the pipeline's own image_encoder/ if it has one; "
                          "'none' = no image encoder")
    device: DeviceSpec = Field("auto", description="auto = the run's train.device")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto = float16 on a GPU, float32 on a CPU")
    feature_cache: Optional[str] = Field(
        None, description="folder of the feature cache; null = $FEDGUIDE_CACHE or ~/.cache/fedguide/features")
    rebuild: bool = Field(False, description="recompute cached features (fedguide run --rebuild)")

    def cache_dir(self) -> Path:
        if self.feature_cache:
            return Path(self.feature_cache).expanduser()
        return Path(os.environ.get("FEDGUIDE_CACHE", "~/.cache/fedguide/features")).expanduser()


class EvalConfig(Strict):
    """The ``eval:`` section: what a round scores. ``personal`` scores each client's own model on its own test
    split (drawn from the test set with the client's label and domain mix, fixed for the run)."""

    mode: Literal["global", "personal", "both"] = Field(
        "global", description="global: the server's model on the whole test set; personal: each client's "
                              "personalised model on its own test split (the round's accuracy is then the "
                              "personal accuracy); both: the two side by side")
    finetune_steps: int = Field(
        0, ge=0, description="personal: methods without a personalised model of their own score the global model "
                             "fine-tuned for this many steps on the client's training data; 0 = the global model")
    personal_test_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="share of the test set divided among the clients' test splits, each "
                                         "test sample to one client, in proportion to the clients' training "
                                         "samples of its class (and domain)")
    test_subset: float = Field(
        1.0, gt=0.0, le=1.0, description="share of the test set scored, stratified by class (and domain) and the "
                                         "same samples for every run seed; below 1 only for quick runs (smoke "
                                         "tests, debugging): its accuracies do not compare with the whole test "
                                         "set's. Personal test splits are drawn from it")
    personal_every: int = Field(
        1, ge=1, description="mode both: personal scores every this many rounds and in each of the last "
                             "report.last_k rounds (so the personal last-k means are those of scoring every round; "
                             "with eval.early_stop also in every round after which the run could stop within "
                             "report.last_k rounds)")
    client_classes: bool = Field(
        False, description="also score the server's model on the test samples of each client's classes "
                           "(client_class_accuracy: client id -> accuracy; FedCADO Table 2's per-client columns); a "
                           "client's classes are those it has training samples of in the partition, before a "
                           "method such as centralized pools the clients")
    early_stop: Optional[int] = Field(
        None, ge=1, description="stop when the validation accuracy (data.val_fraction) has not improved for this "
                                "many rounds; null = run every round")

    @model_validator(mode="after")
    def _every(self) -> "EvalConfig":
        if self.mode == "personal" and self.personal_every != 1:
            raise ValueError(f"personal_every: {self.personal_every} with mode personal, whose personal accuracy is "
                             "every round's accuracy; write mode: both to score the clients less often")
        return self

    def personal_round(self, round_: int, rounds: int, last_k: int = 1, stale: Optional[int] = None) -> bool:
        """Whether round ``round_`` of ``rounds`` scores the personalised models: every ``personal_every`` rounds
        and each of the last ``last_k`` (the report's window: the personal last-k statistics then average the
        same rounds as when every round is scored).

        Under ``early_stop`` the last rounds are not known in advance. ``stale`` is the number of rounds since
        the best validation accuracy, this round's included. A run that stops after round s has gone
        ``early_stop`` rounds without improving; each of its last ``last_k`` rounds is then at least
        ``early_stop - last_k + 1`` rounds stale. Every round that stale is scored, so the window of an
        early-stopped run is scored too."""
        if self.mode == "global":
            return False
        watched = self.early_stop is not None and stale is not None and stale >= self.early_stop - last_k + 1
        return round_ % self.personal_every == 0 or round_ > rounds - last_k or watched


# Test-accuracy marks of summary.json's rounds_to_accuracy unless report.rounds_to names others.
ROUND_ACCURACY_MARKS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)


def default_last_k(rounds: int) -> int:
    """The last 10 % of ``rounds`` rounded up to an even count, at least 2, at most ``rounds``: under strong
    label skew accuracy oscillates with period 2, and an even window weighs both phases alike."""
    return max(1, min(rounds, max(2, 2 * -(-rounds // 20))))


class ReportConfig(Strict):
    """The ``report:`` section: how summary.json condenses the accuracy curve (training does not read it)."""

    last_k: Optional[int] = Field(
        None, description="summary.json's accuracy_last_k is the mean test accuracy over the last last_k rounds; "
                          "even, >= 2; null = the last 10 % of rounds rounded up to even, at least 2")
    rounds_to: list[float] = Field(
        default_factory=lambda: list(ROUND_ACCURACY_MARKS),
        description="test-accuracy marks (fractions in (0, 1]) whose first reaching round summary.json's "
                    "rounds_to_accuracy records; FedDifRC Table 12 uses [0.2, 0.3, 0.4]")

    @model_validator(mode="before")
    @classmethod
    def _check(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        k = data.get("last_k")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 2 or k % 2):
            raise ValueError(f"last_k: {k!r} is not an even whole number >= 2 (accuracy under label skew "
                             "oscillates with period 2, so an odd window favours one phase); write e.g. 10, or null "
                             "for the last 10 % of rounds")
        if "rounds_to" not in data:
            return data
        marks = data["rounds_to"]
        if not isinstance(marks, list) or not all(
                isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m <= 1 for m in marks):
            raise ValueError(f"rounds_to: {marks!r} is not a list of accuracies in (0, 1]; write fractions, "
                             "e.g. [0.2, 0.3, 0.4] for 20, 30 and 40 %")
        return {**data, "rounds_to": sorted({float(m) for m in marks})}

    def last_k_for(self, rounds: int) -> int:
        """The window of accuracy_last_k for a run of ``rounds`` evaluated rounds."""
        return min(self.last_k, rounds) if self.last_k is not None else default_last_k(rounds)


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
    server_optimizer: Named = Field(
        Named(name="average"), description="the server's step from the aggregate (FedOpt): average (none), avgm, "
                                           "adagrad, adam, yogi; usable with any method")
    method_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per method name, given to the method section when it names that "
                                          "method (the section's own keys win): one config for a sweep over "
                                          "method.name, e.g. {feddifrc: {lambda_ndcr: 16}}")
    seed: int = 0
    report: ReportConfig = ReportConfig()
    logging: list[LoggerName] = Field(
        default_factory=list, description="metric loggers beside metrics.jsonl (fl/loggers.py): csv (metrics.csv), "
                                          "tensorboard (<run>/tensorboard/), wandb (when installed); any of them")
    eval: EvalConfig = EvalConfig()
    meta: dict[str, Any] = Field(default_factory=dict, description="written by fedguide: version, git commit")

    @model_validator(mode="before")
    @classmethod
    def _method_options(cls, data: Any) -> Any:
        """The method section with ``method_options[its name]`` beneath its own keys. The options of the other
        names stay in ``method_options`` (checked against their methods by ``fl.setup.resolve``)."""
        if not isinstance(data, dict) or not data.get("method_options"):
            return data
        options = data["method_options"]
        if not isinstance(options, dict) or not all(isinstance(v, dict) and "name" not in v for v in options.values()):
            raise ValueError("method_options maps method names to their options (the key is the name), e.g. "
                             "method_options: {feddifrc: {lambda_ndcr: 16}}")
        method = data.get("method", cls.model_fields["method"].default.model_dump())
        if isinstance(method, dict) and method.get("name") in options:
            data = {**data, "method": {**options[method["name"]], **method}}
        return data

    @model_validator(mode="after")
    def _clients(self) -> "Config":
        if self.clients.per_round > self.clients.num:
            raise ValueError(
                f"clients.per_round ({self.clients.per_round}) exceeds clients.num ({self.clients.num}); "
                "lower clients.per_round"
            )
        if self.eval.early_stop is not None and self.data.val_fraction == 0:
            raise ValueError("eval.early_stop watches the validation accuracy, but there is no validation split; set "
                             "data.val_fraction (e.g. 0.1) or remove eval.early_stop")
        if self.report.last_k is not None and self.report.last_k > self.train.rounds:
            raise ValueError(f"report.last_k ({self.report.last_k}) exceeds train.rounds ({self.train.rounds}); "
                             "lower report.last_k or leave it unset (the last 10 % of rounds)")
        return self


# Keys a named section owns itself (not parameters of the entry it names).
SECTION_KEYS = {"data": ("fraction", "public_fraction", "public_seed", "on_device", "val_fraction", "val_from")}


@dataclass(frozen=True)
class DataSection(Parsed):
    """The resolved ``data:`` section: the dataset's entry and parameters, and the section's own keys."""

    fraction: float
    public_fraction: float
    public_seed: int
    on_device: Union[Literal["auto"], bool]
    val_fraction: float = 0.0
    val_from: str = "server"

    def dump(self) -> dict[str, Any]:
        own = {k: getattr(self, k) for k in SECTION_KEYS["data"]}
        return {"name": self.entry.name, **own, **self.params.model_dump(mode="json")}


@dataclass(frozen=True)
class ResolvedConfig:
    """A config resolved once against the registries (``fl.setup.resolve``): each named section as its entry
    and parsed parameters, which every later step takes as they are, and ``config``, the same settings with
    every default written out (what config.yaml holds and what resolves to this again)."""

    config: Config
    data: DataSection
    partition: Parsed
    model: Parsed
    method: Parsed  # entry.obj: the Method class
    runtime: Parsed  # entry.obj: the Runtime class
    regularizers: tuple[Parsed, ...] = ()  # in the config's order; entry.obj: the Regularizer class
    server_optimizer: Optional[Parsed] = None  # entry.obj: the ServerOptimizer class; None: average


def parse_value(text: str) -> Any:
    """Override values are YAML scalars/lists: 'mu=0.01' -> 0.01, 'regularizers=[dw]' -> ['dw']."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _split_override(item: Union[str, tuple[str, Any]]) -> tuple[list[str], Any]:
    """('method.mu=0.5' or ('method.mu', 0.5)) -> (['method', 'mu'], 0.5)."""
    if isinstance(item, tuple):
        key, value = item
    else:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value; write e.g. train.rounds=5")
        key, text = item.split("=", 1)
        value = parse_value(text)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override key '{key}' is malformed; write dotted keys like method.mu=0.01")
    if len(parts) == 1 and parts[0] in NAMED_SECTIONS and not isinstance(value, dict):
        # Hydra's and FL-bench's habit (method=fedprox): here it would replace the whole section by a word.
        raise ConfigError(f"override '{key}={value}' would replace the {parts[0]} section; write "
                          f"{parts[0]}.name={value}")
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[Union[str, tuple[str, Any]]]) -> dict[str, Any]:
    """``raw`` with dotted overrides applied: 'key=YAML value' strings or (key, value) pairs.

    Order-independent for a section's entry: every ``SECTION.name`` override is applied first, so
    ``method.mu=0.5 method.name=fedprox`` is FedProx with mu 0.5, and a parameter the newly named
    entry lacks (``method.mu=0.5 method.name=fedavg``) is refused by name when the config is resolved.
    Switching a section's ``name`` drops the parameters the config gave the previous entry. The other
    overrides apply in the order given (a later one wins)."""
    out = copy.deepcopy(raw)
    items = [_split_override(o) for o in overrides]
    names = [(p, v) for p, v in items if len(p) == 2 and p[1] == "name"]
    rest = [(p, v) for p, v in items if not (len(p) == 2 and p[1] == "name")]
    for parts, value in names + rest:
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{'.'.join(parts)}': '{p}' is a value, not a section")
            node = nxt
        if parts[-1] == "name" and len(parts) == 2 and node.get("name") not in (None, value):
            # Switching method/model/partition/dataset drops the old entry's parameters, which the
            # new one would reject as unknown keys; the section's own keys (data.fraction) stay.
            own = set(SECTION_KEYS.get(parts[0], ()))
            kept = {k: v for k, v in node.items() if k in own}
            node.clear()
            node.update(kept)
        node[parts[-1]] = value
    return out


# Sections that name a registry entry (``{name: x, **its parameters}``).
NAMED_SECTIONS = ("data", "partition", "model", "method", "runtime")


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "literal_error":
            msg = f"{e['input']!r} is not one of the choices; write {e['ctx']['expected']}"
        if e["type"] == "extra_forbidden":
            section = e["loc"][:-1]
            model: Any = Config
            for p in section:
                model = model.model_fields[p].annotation if p in getattr(model, "model_fields", {}) else None
            fields = list(getattr(model, "model_fields", {})) if model else []
            valid = ", ".join(fields)
            msg = f"unknown key{did_you_mean(str(e['loc'][-1]), fields)}{'; valid keys: ' + valid if valid else ''}"
        if e["type"] in ("dict_type", "model_type") and len(e["loc"]) == 1 and e["loc"][0] in NAMED_SECTIONS:
            # Hydra's and FL-bench's habit: a section given its entry's name directly.
            msg = (f"{e['input']!r} is not a section; a section names its entry with name: write "
                   f"{e['loc'][0]}: {{name: {e['input']}}} (on the command line {e['loc'][0]}.name={e['input']})")
        lines.append(f"{loc}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_raw(path: Path | str) -> dict[str, Any]:
    path = Path(path)
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


def load_config(path: Path | str, overrides: list[str] | None = None) -> Config:
    return build_config(apply_overrides(load_raw(path), overrides or []))


# Keys that say where or how a run computes, not what: the device, cuDNN's algorithm search (both change floats only
# by rounding, as the thread count does), the feature cache's folder and a --rebuild of it. A resume may change
# them (fl/run_folder.py) and runs that differ in them share a report row and pair (report/tables.py).
PLACEMENT_KEYS = ("train.device", "train.cudnn_benchmark", "data.on_device", "guidance.device", "guidance.rebuild",
                  "guidance.feature_cache")


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
