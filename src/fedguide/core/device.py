"""Where a run computes: the device named by ``train.device``, its precision, and moving records to it.

Everything that leaves a process or reaches the disk (uploads sent by a worker, checkpoints, client
state, ``model.safetensors``) is on the CPU, so a run started on a GPU resumes on a CPU and the other
way round; everything a process computes with (the model, the global weights, payloads, client state
in use) is moved to the run's device once, where it enters the process.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator

import torch

from fedguide.core import simulated
from fedguide.registry import ConfigError

# The device specs a config may name (``train.device``, ``guidance.device``), besides ``cuda:N``; the config's
# types are built from them, so a wrong one is refused when the config is loaded.
DEVICE_NAMES = ("auto", "cpu", "cuda", "mps", simulated.NAME)
DEVICE_SUMMARIES = {"auto": "cuda when available, else cpu", "cpu": "the host", "cuda": "the current CUDA device",
                    "cuda:N": "CUDA device N", "mps": "Apple's Metal device",
                    simulated.NAME: "the CPU under the CUDA backend's rules (checks the GPU code paths)"}
DEVICE_PATTERN = re.compile(rf"^({'|'.join(DEVICE_NAMES)}|cuda:\d+)$")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# cuBLAS needs a fixed workspace to give the same sums twice (PyTorch's reproducibility notes). CUDA reads
# the variable once per process, at its first cuBLAS call, so it is set when fedguide is imported (see
# ``fedguide/__init__.py``), unless the user set it: a deterministic run after any earlier CUDA matmul in the
# same process (a sweep in one process, the tests) then still gets it.
CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(spec: str, what: str = "train.device") -> torch.device:
    """``auto`` -> cuda when available, else cpu; an explicit device that this machine lacks is a
    sentence naming ``auto``/``cpu``, not a CUDA error at the first kernel. ``simulated``: the CPU under the
    CUDA backend's rules (``core/simulated.py``)."""
    if not DEVICE_PATTERN.match(spec):
        raise ConfigError(f"{what}: {spec!r} is not a device; write auto, cpu, cuda, cuda:N, mps or simulated")
    if spec == simulated.NAME:
        return simulated.SIMULATED
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what}: {spec} was asked for but this machine has no usable CUDA device "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                              f"write {what.split('.')[-1]}: auto (cuda when present, else cpu) or cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{what}: {spec} does not exist; this machine has {count} CUDA device"
                              f"{'s' if count != 1 else ''} (cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{what}: mps was asked for but this machine has no MPS device; write auto or cpu")
    return device


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and computes_on_host(device):
        raise ConfigError("train.precision: fp16 needs a GPU (CPU autocast computes in bfloat16); "
                          "write bf16 or fp32 on a CPU (train.device: simulated runs the fp16 path on the CPU)")


def computes_on_host(device: torch.device) -> bool:
    """True where the host's tensors are the device's (the CPU): nothing to move, nothing to re-encode.
    The simulated device is not the host: it moves and encodes as a GPU does."""
    return device.type == "cpu" and not simulated.is_simulated(device)


def is_gpu_like(device: torch.device) -> bool:
    """A device the GPU code paths run on: CUDA, or the simulated device that checks them."""
    return device.type == "cuda" or simulated.is_simulated(device)


def device_rules(device: torch.device) -> contextlib.AbstractContextManager:
    """The simulated device's checks while the block runs, on the simulated device; nothing elsewhere."""
    if simulated.is_simulated(device) and simulated.current() is None:
        return simulated.SimulatedDevice()
    return contextlib.nullcontext()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass (``fp32``: nothing changes)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def to_device(value: Any, device: torch.device) -> Any:
    """A record (tensors in dicts, lists, tuples) with every tensor on ``device``; no copy where it is
    there already."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def to_cpu(value: Any) -> Any:
    return to_device(value, torch.device("cpu"))


def set_cublas_workspace() -> None:
    """The fixed cuBLAS workspace, unless the user chose one (kept for the whole process: CUDA reads it once)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def apply_algorithms(deterministic_: bool, benchmark: bool = True) -> None:
    """Set PyTorch's algorithm choice: deterministic algorithms (and cuBLAS's fixed workspace), or, for a run
    that is not deterministic, cuDNN's search for the fastest convolution algorithms of each new input shape
    (``cudnn.benchmark``) unless ``benchmark`` is False (``train.cudnn_benchmark``). Without restoring: a
    client-side process calls it once for its whole life; the engine uses ``deterministic``."""
    if deterministic_:
        set_cublas_workspace()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    else:
        torch.backends.cudnn.benchmark = benchmark


@contextlib.contextmanager
def deterministic(enabled: bool, benchmark: bool = True) -> Iterator[None]:
    """``apply_algorithms`` while the block runs; the previous settings come back after it, so one
    deterministic run does not change the next."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic)
    apply_algorithms(enabled, benchmark)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before[2]



# The simulated device's free memory, when set (bytes): the decisions that depend on it (data.on_device, processes
# sharing a device) are then testable without a GPU.
SIMULATED_FREE_BYTES = "FEDGUIDE_SIMULATED_FREE_BYTES"


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None elsewhere: host memory is not checked here)."""
    if simulated.is_simulated(device):
        value = os.environ.get(SIMULATED_FREE_BYTES)
        return int(value) if value else None
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
