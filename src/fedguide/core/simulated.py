"""A simulated accelerator: ``train.device: simulated`` computes on the CPU under the CUDA backend's rules.

Nobody needs a GPU to keep the GPU path correct. Under this device a run computes real numbers on the
CPU (accuracy, resume and determinism stay testable), while two PyTorch modes watch every operation:

* a ``TorchFunctionMode`` sees the Python-level calls: moves (``.to``, ``.cuda()``, ``.cpu()``, a
  factory's ``device=``), reads of a device tensor's values on the host (``.tolist()``, ``.numpy()``)
  and ``tensor.device``, which answers :data:`SIMULATED` for a device tensor, so ``device=x.device``
  idioms keep working;
* a ``TorchDispatchMode`` sees every ATen operation, the backward pass included, and propagates where
  each result lives: an operation with a device input makes device results; one with no tensor input
  (a factory inside a composite operation, autograd's zero gradients) makes results where the
  Python-level call that ran it computes.

Where a tensor lives is a property of its storage (views, ``.data`` and parameters share it), kept in a
table of weak storage references, so a freed storage never lends its mark to a new one.

CUDA's rules, as enforced here: an operation mixing a device tensor with a host tensor of one or more
dimensions raises :class:`DeviceMixError` naming the operation and the line of fedguide (or of the
caller) that ran it; a 0-dim host tensor is a scalar and may mix (as on CUDA). Indexing a device tensor
with host indices is allowed and copies the indices; indexing a host tensor with device indices is an
error. ``copy_`` between the two sides is allowed and counted. ``.numpy()`` of a device tensor is an
error. Counted: host syncs (``.item()``, ``float()``/``bool()``/``int()``, ``.tolist()``, a copy to the
host, and operations whose output size depends on device values: boolean masks, ``nonzero``,
``unique``, ``masked_select``) and host-to-device bytes by every route (``.to``, ``.cuda()``,
``copy_``, ``as_tensor``/``tensor`` with ``device=``, host indices into device tensors).

The run's training loop marks its optimiser steps (:func:`step`), so syncs and copies are reported
per step, apart from the once-per-round work around them.
"""
from __future__ import annotations

import contextlib
import os
import threading
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# A CPU device that PyTorch accepts everywhere (factories, ``.to``, generators) and that differs from the
# host's ``cpu``: ``.to(SIMULATED)`` of a host tensor makes a copy, as a move to a GPU does.
SIMULATED = torch.device("cpu", 0)
NAME = "simulated"

aten = torch.ops.aten
_DEVICE_ATTR = torch._C.TensorBase.__dict__["device"]
_TO = {torch.Tensor.to}
_CUDA = {torch.Tensor.cuda}
_CPU = {torch.Tensor.cpu}
_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}
_TOLIST = {torch.Tensor.tolist}
# Factories whose data come from the caller (a host list, array or tensor): their ``device=`` is a copy.
_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
_COPIES = {aten.copy_, aten.copy}
_INDEXING = {aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_, aten._unsafe_index,
             aten._unsafe_index_put}
# Operations whose output size depends on device values: CUDA waits for the device to know it.
_SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.masked_select, aten._unique,
            aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.is_nonzero, aten.equal,
            aten.repeat_interleave, aten.allclose}
# Operations with no deterministic CUDA kernel (torch.use_deterministic_algorithms' list for torch 2.x):
# under deterministic algorithms CUDA raises on them, and so does the simulated device. op -> condition.
_ANY = (lambda args, kwargs: True)
_NONDETERMINISTIC = {
    aten.avg_pool3d_backward: _ANY, aten._adaptive_avg_pool2d_backward: _ANY, aten._adaptive_avg_pool3d_backward: _ANY,
    aten.adaptive_max_pool2d_backward: _ANY, aten.fractional_max_pool2d_backward: _ANY,
    aten.fractional_max_pool3d_backward: _ANY, aten.max_unpool2d: _ANY, aten.max_unpool3d: _ANY,
    aten.upsample_linear1d_backward: _ANY, aten.upsample_bilinear2d_backward: _ANY,
    aten._upsample_bilinear2d_aa_backward: _ANY, aten.upsample_bicubic2d_backward: _ANY,
    aten._upsample_bicubic2d_aa_backward: _ANY, aten.upsample_trilinear3d_backward: _ANY,
    aten.reflection_pad1d_backward: _ANY, aten.reflection_pad2d_backward: _ANY, aten.reflection_pad3d_backward: _ANY,
    aten.nll_loss2d_forward: _ANY, aten._ctc_loss_backward: _ANY, aten.histc: _ANY,
    aten.grid_sampler_2d_backward: _ANY, aten.grid_sampler_3d_backward: _ANY,
    aten.put_: _ANY, aten.put: _ANY,
    aten.bincount: lambda args, kwargs: (args[1] if len(args) > 1 else kwargs.get("weights")) is not None,
    aten.cumsum: lambda args, kwargs: (kwargs.get("dtype") or args[0].dtype).is_floating_point,
    aten.median: lambda args, kwargs: len(args) > 1 or "dim" in kwargs,  # with indices output
    aten.nanmedian: lambda args, kwargs: len(args) > 1 or "dim" in kwargs,
    aten.kthvalue: _ANY,
}
_OWN_FILE = os.path.normcase(os.path.abspath(__file__))
_TORCH_DIR = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__)))


class DeviceMixError(RuntimeError):
    """An operation mixed device and host tensors, as CUDA would refuse."""


def is_simulated(device: Any) -> bool:
    return isinstance(device, torch.device) and device == SIMULATED


@dataclass
class Counters:
    """What the simulated device counted; ``step_*`` inside the training loop's optimiser steps."""

    host_syncs: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    steps: int = 0
    step_host_syncs: int = 0
    step_h2d_bytes: int = 0
    # Where the steps' host-to-device bytes came from (caller_line -> bytes): a copy per step is a defect to
    # find, and the summary names its lines.
    step_h2d_sites: dict[str, int] = field(default_factory=dict)

    def copy(self) -> "Counters":
        return Counters(**asdict(self))

    def since(self, before: "Counters") -> "Counters":
        out = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self) if f.type == "int"}
        sites = {k: v - before.step_h2d_sites.get(k, 0) for k, v in self.step_h2d_sites.items()}
        return Counters(**out, step_h2d_sites={k: v for k, v in sites.items() if v})

    def add(self, other: "Counters") -> None:
        for f in fields(self):
            if f.type == "int":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for k, v in other.step_h2d_sites.items():
            self.step_h2d_sites[k] = self.step_h2d_sites.get(k, 0) + v


def _frame_text(frame: traceback.FrameSummary) -> str:
    where = frame.filename
    marker = os.sep + "fedguide" + os.sep
    if marker in where:
        where = "fedguide" + os.sep + where.rsplit(marker, 1)[1]
    return f"{where}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def caller_line() -> str:
    """Where an operation came from: the innermost frame outside torch and this module and, when that is not
    a method's own code (a model's forward, a library's layer), the innermost frame that is (a file of
    fedguide/methods, or the caller's code outside fedguide and the installed libraries)."""
    frames = [f for f in reversed(traceback.extract_stack())
              if not f.filename.startswith("<")
              and os.path.normcase(os.path.abspath(f.filename)) != _OWN_FILE
              and not os.path.normcase(os.path.abspath(f.filename)).startswith(_TORCH_DIR)]
    if not frames:
        return "(no caller outside torch)"

    def owns(frame: traceback.FrameSummary) -> bool:
        name = frame.filename
        inside = os.sep + "fedguide" + os.sep
        if inside in name:
            return name.rsplit(inside, 1)[1].startswith("methods" + os.sep)
        return "site-packages" not in name and "dist-packages" not in name

    first = frames[0]
    own = next((f for f in frames if owns(f)), None)
    if own is None or own is first:
        return _frame_text(first)
    return f"{_frame_text(own)} (through {_frame_text(first)})"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Marks:
    """Storages that live on the simulated device, held by weak reference."""

    def __init__(self):
        self._refs: dict[int, StorageWeakRef] = {}
        self._added = 0

    @staticmethod
    def _storage(t: torch.Tensor):
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors: never on the device
            return None

    def has(self, t: torch.Tensor) -> bool:
        storage = self._storage(t)
        if storage is None:
            return False
        ref = self._refs.get(storage._cdata)
        return ref is not None and not ref.expired()

    def mark(self, t: torch.Tensor) -> None:
        storage = self._storage(t)
        if storage is None or storage._cdata in self._refs:
            return
        self._refs[storage._cdata] = StorageWeakRef(storage)
        self._added += 1
        if self._added >= 4096:  # forget freed storages now and then (the weak references pin their address)
            self._added = 0
            self._refs = {k: r for k, r in self._refs.items() if not r.expired()}

    def unmark(self, t: torch.Tensor) -> None:
        storage = self._storage(t)
        if storage is not None:
            self._refs.pop(storage._cdata, None)


# One table per process: device memory outlives a run (a guidance model loaded once per process, by an
# earlier run on the simulated device, is still on it in the next).
_MARKS = _Marks()
_active = threading.local()


def current() -> Optional["SimulatedDevice"]:
    """The simulated device this thread computes under, or None."""
    return getattr(_active, "device", None)


_NO_STEP = contextlib.nullcontext()


def step() -> contextlib.AbstractContextManager:
    """Around one optimiser step of a training loop: what it syncs and copies is counted per step."""
    sim = current()
    return _NO_STEP if sim is None else sim.step()


class SimulatedDevice:
    """The two modes and their counters; entered with ``with`` for a run (or a worker's life)."""

    def __init__(self):
        self.marks = _MARKS
        self.counters = Counters()
        self._in_step = False
        self._context_device = False  # where the current Python-level call computes
        self._function = _FunctionLayer(self)
        self._dispatch = _DispatchLayer(self)
        self._previous = None

    # ---- entering -----------------------------------------------------------------------------------
    def __enter__(self) -> "SimulatedDevice":
        self._previous = current()
        _active.device = self
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._dispatch.__exit__(*exc)
            self._function.__exit__(*exc)
        finally:
            _active.device = self._previous

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        outer, self._in_step = self._in_step, True
        try:
            yield
        finally:
            self._in_step = outer
        if not outer:
            self.counters.steps += 1

    # ---- what is where ------------------------------------------------------------------------------
    def on_device(self, t: torch.Tensor) -> bool:
        return self.marks.has(t)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """Mark a host tensor's storage as device memory (tests build device tensors with it)."""
        self.marks.mark(t)
        return t

    # ---- counting -----------------------------------------------------------------------------------
    def sync(self) -> None:
        self.counters.host_syncs += 1
        if self._in_step:
            self.counters.step_host_syncs += 1

    def h2d(self, nbytes: int) -> None:
        self.counters.h2d_bytes += nbytes
        if self._in_step:
            self.counters.step_h2d_bytes += nbytes
            sites = self.counters.step_h2d_sites
            site = caller_line()
            sites[site] = sites.get(site, 0) + nbytes

    def d2h(self, nbytes: int) -> None:
        self.counters.d2h_bytes += nbytes

    def mix(self, op: Any, device: list[torch.Tensor], host: list[torch.Tensor]) -> DeviceMixError:
        return DeviceMixError(
            f"{op} mixes device tensors ({', '.join(_describe(t) for t in device[:3])}) with host tensors "
            f"({', '.join(_describe(t) for t in host[:3])}), which CUDA refuses; at {caller_line()}. Move the host "
            "tensor to the run's device once (ctx.device / run.device; per-client data through ctx.batch), or "
            "the device tensor to the host with .cpu() where the host is meant")


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, sim: SimulatedDevice):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if getattr(func, "__self__", None) is _DEVICE_ATTR:
            return SIMULATED if sim.on_device(args[0]) else func(*args, **kwargs)
        if func in _TO:
            return self._to(args[0], *_parse_to(sim, args[1:], kwargs))
        if func in _CUDA:
            return self._to(args[0], SIMULATED, None, kwargs.get("non_blocking", False), None, False)
        if func in _CPU:
            return self._to(args[0], torch.device("cpu"), None, False, kwargs.get("memory_format"), False)
        if func in _NUMPY and sim.on_device(args[0]):
            raise TypeError(f"can't convert a device tensor ({_describe(args[0])}) to numpy, as on CUDA; use "
                            f".cpu() first (a host sync). At {caller_line()}")
        if func in _TOLIST and sim.on_device(args[0]):
            sim.sync()
            sim.d2h(_nbytes(args[0]))
        target = kwargs.get("device")
        target = None if target is None else torch.device(target)
        if target is None and func is torch.Tensor.new_tensor and sim.on_device(args[0]):
            target = SIMULATED  # new_tensor makes its copy where self is
        inputs = tensors_in(args, kwargs)
        from_device = any(sim.on_device(t) for t in inputs)
        outer = sim._context_device
        sim._context_device = is_simulated(target) if target is not None else from_device
        try:
            out = func(*args, **kwargs)
        finally:
            sim._context_device = outer
        if target is None:
            return out
        outs = tensors_in(out)
        if is_simulated(target):
            for t in outs:
                if not from_device and func in _DATA_FACTORIES:
                    sim.h2d(_nbytes(t))
                sim.marks.mark(t)
        elif from_device and target.type == "cpu":  # device=cpu of a device tensor: a copy to the host
            out = tree_map_tensors(out, lambda t: self._to(t, torch.device("cpu"), None, False, None, False))
        return out

    def _to(self, src: torch.Tensor, device, dtype, non_blocking, memory_format, copy) -> torch.Tensor:
        sim = self.sim
        was = sim.on_device(src)
        to_device = was if device is None else is_simulated(device)
        kwargs = {"dtype": dtype or src.dtype, "non_blocking": non_blocking, "copy": copy or to_device != was}
        if memory_format is not None:
            kwargs["memory_format"] = memory_format
        with torch._C.DisableTorchFunction():
            out = torch.Tensor.to(src, **kwargs)
        if to_device and not was:
            sim.h2d(_nbytes(src))
            sim.marks.mark(out)
        elif was and not to_device:
            if not non_blocking:
                sim.sync()
            sim.d2h(_nbytes(out))
            sim.marks.unmark(out)
        return out


def tensors_in(*values: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result, through tuples, lists and dicts (what ops take and return).
    torch's generic pytree walk was a third of the simulated device's time per op on small models."""
    found: list[torch.Tensor] = []
    _collect(values, found)
    return found


def _collect(values, found: list) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            if v:
                _collect(v, found)
        elif isinstance(v, dict):
            if v:  # most ops' kwargs are empty
                _collect(v.values(), found)


def tree_map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(tree_map_tensors(v, fn) for v in value)
    return value


def _parse_to(sim: SimulatedDevice, args: tuple, kwargs: dict):
    """(device, dtype, non_blocking, memory_format, copy) of a ``Tensor.to`` call, whichever of its three
    signatures it used: ``to(other, ...)``, ``to(dtype, non_blocking, copy)``, ``to(device, dtype,
    non_blocking, copy)``."""
    kwargs = dict(kwargs)
    copy = bool(kwargs.pop("copy", False))
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        other, rest = args[0], args[1:]
        non_blocking = kwargs.get("non_blocking", rest[0] if rest else False)
        copy = copy or (len(rest) > 1 and bool(rest[1]))
        device = SIMULATED if sim.on_device(other) else torch.device("cpu")
        return device, other.dtype, non_blocking, kwargs.get("memory_format"), copy
    limit = 2 if args and isinstance(args[0], torch.dtype) else 3
    if len(args) > limit:
        copy = copy or bool(args[limit])
        args = args[:limit]
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, memory_format, copy


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, sim: SimulatedDevice):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        packet = func._overloadpacket
        with torch._C.DisableTorchFunction():
            tensors = tensors_in(args, kwargs)
            device, host = [], []
            for t in tensors:
                (device if sim.on_device(t) else host).append(t)
            if packet in _COPIES:
                return self._copy(func, args, kwargs, device)
            if packet in _INDEXING:
                self._index(func, args, device)
            else:
                host = [t for t in host if t.dim() > 0]  # a 0-dim host tensor is a scalar argument
                if device and host:
                    raise sim.mix(func, device, host)
                if device and packet in _SYNCING:
                    sim.sync()
            if device and packet in _NONDETERMINISTIC and torch.are_deterministic_algorithms_enabled() \
                    and _NONDETERMINISTIC[packet](args, kwargs):
                raise RuntimeError(f"{func} has no deterministic CUDA implementation, and deterministic algorithms "
                                   f"are on (train.deterministic: true), as CUDA would refuse; at {caller_line()}. "
                                   "Change the setting that uses it or write train.deterministic: false")
            out = func(*args, **kwargs)
            if device if tensors else sim._context_device:
                for t in tensors_in(out):
                    sim.marks.mark(t)
            return out

    def _copy(self, func, args, kwargs, device):
        sim = self.sim
        dst, src = args[0], args[1]
        dst_on, src_on = sim.on_device(dst), sim.on_device(src)
        if dst_on and not src_on:
            sim.h2d(_nbytes(src))
        elif src_on and not dst_on:
            sim.sync()
            sim.d2h(_nbytes(src))
        out = func(*args, **kwargs)
        if func._overloadpacket is aten.copy and dst_on:  # the functional form makes a tensor where dst is
            sim.marks.mark(out)
        return out

    def _index(self, func, args, device):
        """CUDA's indexing rules: host indices into a device tensor are copied there; device indices into a
        host tensor are an error; a boolean mask on the device needs a sync (its output size)."""
        sim = self.sim
        self_, indices = args[0], [i for i in args[1] if isinstance(i, torch.Tensor)]
        values = [a for a in args[2:3] if isinstance(a, torch.Tensor)]
        if sim.on_device(self_):
            for i in indices:
                if not sim.on_device(i):
                    sim.h2d(_nbytes(i))
                elif i.dtype == torch.bool and func._overloadpacket is aten.index:
                    sim.sync()
            host = [v for v in values if v.dim() > 0 and not sim.on_device(v)]
            if host:
                raise sim.mix(func, [self_], host)
        else:
            wrong = [i for i in indices if sim.on_device(i)] + [v for v in values if v.dim() > 0 and sim.on_device(v)]
            if wrong:
                raise sim.mix(func, wrong, [self_])


def device_check_summary(counters: Counters) -> dict[str, Any]:
    """The ``device_check`` record of a run's summary."""
    steps = max(counters.steps, 1)
    return {"device": NAME, "steps": counters.steps,
            "host_syncs_per_step": counters.step_host_syncs / steps,
            "h2d_bytes_per_step": counters.step_h2d_bytes / steps,
            "host_syncs": counters.host_syncs, "h2d_bytes": counters.h2d_bytes, "d2h_bytes": counters.d2h_bytes,
            "mixes": 0,
            "h2d_step_sites": dict(sorted(counters.step_h2d_sites.items(), key=lambda kv: -kv[1])[:5])}
