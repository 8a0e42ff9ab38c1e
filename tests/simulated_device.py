"""A GPU stand-in for a machine without one: PyTorch's own device rules, checked on the CPU.

Inside ``SimulatedDevice()`` every tensor keeps its values on the CPU but carries the device it
would be on (a model placed with ``place_model`` is on "cuda:0"). Each torch call runs twice: for
real, on the CPU, and on fake tensors of the carried devices (``torch._subclasses.fake_tensor``,
which applies the rules a CUDA kernel applies: a CPU 0-dim tensor may be an input of a CUDA op, never
its output; no other mix). A call that would mix devices raises ``DeviceMismatch``; ``.numpy()`` of
a "cuda" tensor raises as it does on CUDA; ``tensor.device`` answers the carried device, so code
that reads it places what it makes there. Calls that fake tensors cannot run (ones whose output
depends on the values) fall back to the same rule over their tensor arguments.

A model placed on "mps" (``place_model(model, MPS)``) also gets MPS's dtype rule: no float64
(nor complex128) tensor lives there, so making one there, casting one there (``.double()``) or
moving one there raises ``NoFloat64`` as MPS does.

Slow (a call with a tensor on the stand-in device, or a ``device=``, runs twice, through Python): for
small models and few prompts. A call on CPU tensors alone, with no ``device=``, runs once: its outputs
stay on the CPU and it cannot mix devices.
"""

from __future__ import annotations

import re

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

CUDA, MPS, CPU = torch.device("cuda", 0), torch.device("mps", 0), torch.device("cpu")
DEVICE_ERROR = re.compile(r"same device|wrong device|two devices|device type tensor|on the expected device")
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}  # a CUDA tensor may be indexed by CPU ones
NEW_OBJECT = {torch.tensor, torch.as_tensor, torch.from_numpy}  # CPU unless given a device
WIDE = {torch.float64, torch.complex128}  # the dtypes MPS has not


class DeviceMismatch(AssertionError):
    """A call that mixes devices as CUDA refuses."""


class NoFloat64(TypeError):
    """A float64 tensor on MPS, which MPS refuses (a TypeError there too)."""


def as_device(device) -> torch.device:
    device = torch.device(device)
    return torch.device(device.type, 0) if device.type in ("cuda", "mps") and device.index is None else device


class SimulatedDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=False)
        self.where = WeakTensorKeyDictionary()  # tensor -> its carried device, where not the CPU

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return self.where.get(tensor, CPU)

    def place(self, tensor: torch.Tensor, device) -> None:
        device = as_device(device)
        if device.type == "mps" and tensor.dtype in WIDE:
            raise NoFloat64(f"Cannot convert a MPS Tensor to {str(tensor.dtype).removeprefix('torch.')} dtype as the "
                            "MPS framework doesn't support float64. Please use float32 instead.")
        if device == CPU:
            self.where.pop(tensor, None)
        else:
            self.where[tensor] = device

    def place_model(self, model, device=CUDA) -> None:
        """Put every parameter and buffer of ``model`` on ``device`` (as ``model.to`` would)."""
        for tensor in [*model.parameters(), *model.buffers()]:
            self.place(tensor, device)
        if hasattr(model.cfg, "device"):
            model.cfg.device = str(as_device(device))

    def place_map(self, hf_model, device_map: dict) -> None:
        """Spread a Hugging Face model over devices as ``from_pretrained(device_map=...)`` does through
        accelerate's ``dispatch_model``: each mapped module's tensors on its device, and accelerate's
        own ``AlignDevicesHook``s: a mapped module moves its inputs to its device, the whole model
        returns its output on its input's device (``io_same_device``). ``device_map``: module name
        -> device, covering every tensor. Call before booting a bridge over it, as ``load_model`` does."""
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module

        for name, device in device_map.items():
            module = hf_model.get_submodule(name)
            for tensor in [*module.parameters(), *module.buffers()]:
                self.place(tensor, device)
        for name, device in [("", None), *device_map.items()]:
            hook = AlignDevicesHook(io_same_device=name == "")
            add_hook_to_module(hf_model.get_submodule(name), hook)
            hook.execution_device = device  # set after attaching: its init would move the weights for real

    # ------------------------------------------------------------------ the calls
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # a new method-wrapper at each access: ==, not is
            return self.device_of(args[0])
        if func == torch.Tensor.is_cuda.__get__:
            return self.device_of(args[0]).type == "cuda"
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            if self.device_of(args[0]) != CPU:
                raise DeviceMismatch(f"can't convert {self.device_of(args[0])} device type tensor to numpy; "
                                     "use Tensor.cpu() to copy the tensor to host memory first")
            return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self.moved(func, args, kwargs)
        if getattr(func, "__name__", "") == "__get__":  # metadata, or a view (.T, .data, .grad): where its tensor is
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out is not args[0]:
                self.place(out, self.device_of(args[0]))
            return out
        if func == torch.Tensor.data.__set__:  # Module.to() moves a parameter by setting its .data
            func(*args, **kwargs)
            self.place(args[0], self.device_of(args[1]))
            return None
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch._C._nn._parse_to):
            return func(*args, **kwargs)  # values read back, or Module.to's parsing of its device: as asked
        if func is torch.Tensor.__iter__:
            device = self.device_of(args[0])
            rows = list(func(*args, **kwargs))
            for row in rows:
                self.place(row, device)
            return iter(rows)
        devices = self.shadow(func, args, kwargs) if self.carries_a_device(args, kwargs) else []
        real_kwargs = {k: (CPU if k == "device" else v) for k, v in kwargs.items()}
        out = func(*args, **real_kwargs)
        real, _ = tree_flatten(out)
        for tensor, device in zip(real, devices):
            if isinstance(tensor, torch.Tensor):
                self.place(tensor, device)
        return out

    def moved(self, func, args, kwargs):
        """``.to(...)`` / ``.cpu()`` / ``.cuda()``: the real call keeps the CPU, the result carries the device."""
        tensor = args[0]
        if func is torch.Tensor.cpu:
            target, real = CPU, tensor
        elif func is torch.Tensor.cuda:
            target, real = CUDA, tensor
        else:
            rest = args[1:]
            if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
                target, real = self.device_of(rest[0]), tensor.to(rest[0].dtype)
            else:
                device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
                target = self.device_of(tensor) if device is None else as_device(device)
                real = tensor.to(dtype=dtype or tensor.dtype, copy=bool(kwargs.get("copy", False)))
        if target != self.device_of(tensor) and real is tensor:
            real = tensor.clone()  # a copy on the other device
        self.place(real, target)
        return real

    def carries_a_device(self, args, kwargs) -> bool:
        """Whether a call could leave the CPU or mix devices: a tensor argument carries another device,
        or the call names a ``device=``. Without either, every output is on the CPU (where an output
        is placed by default), so the fake run is skipped."""
        if kwargs.get("device") is not None:
            return True
        return any(isinstance(t, torch.Tensor) and t in self.where for t in tree_flatten((args, kwargs))[0])

    def shadow(self, func, args, kwargs) -> list[torch.device | None]:
        """The devices of ``func``'s outputs (flattened), by running it on fake tensors of the carried
        devices; ``DeviceMismatch`` where CUDA would refuse the mix."""
        def fake(value):
            if not isinstance(value, torch.Tensor):
                return value
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            return FakeTensor(self.fake, meta, self.device_of(value))

        try:
            with self.fake:
                out = func(*tree_map(fake, args), **tree_map(fake, kwargs))
        except Exception as error:  # noqa: BLE001 (any refusal: a device one is ours, others fall back)
            if isinstance(error, DeviceMismatch) or DEVICE_ERROR.search(str(error)):
                placed = [f"{tuple(t.shape)} on {self.device_of(t)}" for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)]
                raise DeviceMismatch(f"{getattr(func, '__name__', func)} of {', '.join(placed)}: {error}") from None
            return self.fallback(func, args, kwargs)
        return [value.device if isinstance(value, torch.Tensor) else None for value in tree_flatten(out)[0]]

    def fallback(self, func, args, kwargs) -> list[torch.device]:
        """The rule for calls fake tensors cannot run: every tensor argument on one device (CPU 0-dim
        ones aside, and the indices of an indexing); the outputs there, or at ``device=``."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in INDEXING:
            tensors = tensors[:1]
        devices = {self.device_of(t) for t in tensors if not (t.dim() == 0 and self.device_of(t) == CPU)}
        if len(devices) > 1:
            raise DeviceMismatch(f"{getattr(func, '__name__', func)}: expected all tensors on one device, "
                                 f"found {sorted(map(str, devices))}")
        if "device" in kwargs and kwargs["device"] is not None:
            device = as_device(kwargs["device"])
        elif func in NEW_OBJECT:
            device = CPU
        else:
            device = devices.pop() if devices else CPU
        return [device] * 64  # as many as the outputs
