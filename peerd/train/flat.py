"""Flat parameter buffers: a model's parameters back to back in one contiguous byte tensor.

Design:
- One ``uint8`` buffer holds every parameter. Within a run of equal dtype, parameters sit back to
  back with no padding, so each run is one typed 1-D view; a new run starts at a 64-byte boundary.
  Publishing is then one memcpy of the byte buffer, and mixing and the optimizer work on a handful
  of typed runs (usually one) instead of looping over parameters in Python.
- The model's parameters are re-pointed (``p.data = view``) into the buffer, and their ``.grad``
  into a twin gradient buffer of the same layout, so ``backward()`` accumulates straight into it
  (autograd adds in place into an existing ``.grad``). Never set grads to None afterwards.
- The ``Layout`` (names, dtypes, shapes) determines every offset: ``Layout.build`` derives them
  with one rule, so a daemon can rebuild a layout from the names/dtypes/shapes it is sent and
  compare it with another; ``Layout.diff`` names the first difference.
- Within a parameter group, parameters are ordered by dtype (stable), so a group of mixed dtypes
  still gives one run per dtype. Construct the flat buffer after moving the model to its device.
- Only parameters are flattened (and mixed). Module buffers such as BatchNorm running statistics
  stay local to each worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class LayoutMismatch(ValueError):
    """Two layouts differ; the message names the first difference."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str           # e.g. "float32"
    shape: tuple[int, ...]
    offset: int          # bytes from the start of the buffer
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * parse_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Run:
    """A stretch of parameters of one dtype, contiguous in the buffer."""
    dtype: str
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    total_bytes: int

    @staticmethod
    def build(specs: Iterable[tuple[str, str | torch.dtype, Sequence[int]]]) -> "Layout":
        """Offsets from (name, dtype, shape) triples in order: the one rule both sides apply."""
        entries: list[Entry] = []
        end = 0
        prev: str | None = None
        for name, dtype, shape in specs:
            dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
            if not dt.is_floating_point:
                raise ValueError(f"parameter {name!r}: dtype {dtype_name(dt)} is not floating point")
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            if dtype_name(dt) != prev:
                end = _align(end)
                prev = dtype_name(dt)
            entries.append(Entry(name, prev, shape, end, numel))
            end += numel * dt.itemsize
        return Layout(tuple(entries), _align(end))

    def runs(self) -> list[Run]:
        out: list[Run] = []
        for e in self.entries:
            if out and out[-1].dtype == e.dtype and \
                    out[-1].offset + out[-1].numel * parse_dtype(e.dtype).itemsize == e.offset:
                last = out[-1]
                out[-1] = Run(last.dtype, last.offset, last.numel + e.numel)
            elif e.numel:
                out.append(Run(e.dtype, e.offset, e.numel))
        return out

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    def diff(self, other: "Layout", here: str = "here", there: str = "there") -> str | None:
        """None when equal, else a sentence naming the first difference."""
        for i, (a, b) in enumerate(zip(self.entries, other.entries)):
            if a.name != b.name:
                return f"parameter {i}: named {a.name!r} {here}, {b.name!r} {there}"
            if a.shape != b.shape:
                return f"parameter {a.name!r}: shape {list(a.shape)} {here}, {list(b.shape)} {there}"
            if a.dtype != b.dtype:
                return f"parameter {a.name!r}: dtype {a.dtype} {here}, {b.dtype} {there}"
            if a.offset != b.offset:
                return f"parameter {a.name!r}: offset {a.offset} {here}, {b.offset} {there}"
        na, nb = len(self.entries), len(other.entries)
        if na != nb:
            extra = (self.entries[nb].name, here) if na > nb else (other.entries[na].name, there)
            return (f"{na} parameters {here}, {nb} {there} "
                    f"(first unmatched: {extra[0]!r} {extra[1]})")
        if self.total_bytes != other.total_bytes:
            return f"total size {self.total_bytes} bytes {here}, {other.total_bytes} {there}"
        return None

    def check(self, other: "Layout", here: str = "here", there: str = "there") -> None:
        d = self.diff(other, here, there)
        if d is not None:
            raise LayoutMismatch(f"parameter layouts differ: {d}")

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) triples, what travels in an Attach request."""
        return [(e.name, e.dtype, e.shape) for e in self.entries]

    def typed(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """1-D typed views of ``buf`` (uint8, this layout), one per run."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.total_bytes:
            raise ValueError(f"expected a 1-D uint8 buffer of {self.total_bytes} bytes, got "
                             f"{buf.dtype} of shape {list(buf.shape)}")
        return [_view(buf, r.offset, r.numel, parse_dtype(r.dtype)) for r in self.runs()]


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. A sum is non-finite whenever an element is, and summing is ~30x faster
    than ``isfinite().all()``; only a non-finite sum (maybe overflow) pays for the exact check."""
    if math.isfinite(t.sum().item()):
        return True
    return bool(torch.isfinite(t).all())


def _view(buf: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset:offset + numel * dtype.itemsize].view(dtype)


@dataclass(frozen=True)
class Segment:
    """The part of one run that belongs to one parameter group: the optimizer's unit of work."""
    group: int
    dtype: torch.dtype
    offset: int
    numel: int


class FlatParams:
    """Re-points parameters (and their grads) into one contiguous buffer each.

    ``groups``: a list of parameter lists (the optimizer's groups); ``names`` the matching names.
    """

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]],
                 names: Sequence[Sequence[str]] | None = None):
        params = [p for g in groups for p in g]
        if not params:
            raise ValueError("no parameters to flatten")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears more than once")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        self.device = params[0].device
        if names is None:
            names, i = [], 0
            for g in groups:
                names.append([f"param{i + j}" for j in range(len(g))])
                i += len(g)
        frozen = [n for g, gn in zip(groups, names) for n, p in zip(gn, g) if not p.requires_grad]
        if frozen:
            raise ValueError(f"parameter {frozen[0]!r} does not require grad: pass only trainable "
                             "parameters (e.g. [p for p in model.parameters() if p.requires_grad])")
        ordered: list[tuple[int, str, torch.nn.Parameter]] = []
        for gi, (g, gn) in enumerate(zip(groups, names, strict=True)):
            order = {}
            for p in g:
                order.setdefault(p.dtype, len(order))
            ordered += sorted(((gi, n, p) for n, p in zip(gn, g, strict=True)),
                              key=lambda t: order[t[2].dtype])
        self.layout = Layout.build((n, p.dtype, p.shape) for _, n, p in ordered)
        self.params = [p for _, _, p in ordered]
        self.buffer = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self.grad_buffer = torch.zeros_like(self.buffer)
        segs: list[Segment] = []
        with torch.no_grad():
            for (gi, _, p), e in zip(ordered, self.layout.entries):
                view = _view(self.buffer, e.offset, e.numel, p.dtype).view(p.shape)
                view.copy_(p.detach())
                p.data = view
                gview = _view(self.grad_buffer, e.offset, e.numel, p.dtype).view(p.shape)
                if p.grad is not None:
                    gview.copy_(p.grad)
                p.grad = gview
                if segs and segs[-1].group == gi and segs[-1].dtype == p.dtype:
                    s = segs[-1]
                    segs[-1] = Segment(gi, p.dtype, s.offset, s.numel + e.numel)
                elif e.numel:
                    segs.append(Segment(gi, p.dtype, e.offset, e.numel))
        self.segments = segs
        self._grads = [p.grad for p in self.params]

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed 1-D views of ``buf`` (same layout as ours), one per segment."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.layout.total_bytes:
            raise ValueError(f"expected a 1-D uint8 buffer of {self.layout.total_bytes} bytes, got "
                             f"{buf.dtype} of shape {list(buf.shape)}")
        return [_view(buf, s.offset, s.numel, s.dtype) for s in self.segments]

    def grads_in_place(self) -> bool:
        """True when every .grad is still our view (checks identity only, no data touched)."""
        return all(p.grad is g for p, g in zip(self.params, self._grads))

    def repair_grads(self) -> None:
        """Someone replaced .grad (e.g. ``model.zero_grad()`` set it to None): copy back, re-point."""
        with torch.no_grad():
            for p, g in zip(self.params, self._grads):
                if p.grad is not g:
                    if p.grad is None:
                        g.zero_()
                    else:
                        g.copy_(p.grad)
                    p.grad = g

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        if not self.grads_in_place():
            self.repair_grads()

    def rehome(self, buf: torch.Tensor) -> None:
        """Move the parameters into ``buf`` (same size, same device): copy them there and re-point
        every parameter at it, so that ``buffer`` is ``buf`` from now on (e.g. a shared-memory
        slot, which makes publishing a buffer the exchange already holds)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.layout.total_bytes \
                or buf.device != self.device:
            raise ValueError(f"rehome: expected a 1-D uint8 buffer of {self.layout.total_bytes} bytes on "
                             f"{self.device}, got {buf.dtype} {list(buf.shape)} on {buf.device}")
        with torch.no_grad():
            buf.copy_(self.buffer)
            for p, e in zip(self.params, self.layout.entries):
                p.data = _view(buf, e.offset, e.numel, p.dtype).view(p.shape)
        self.buffer = buf

    def load(self, buf: torch.Tensor) -> None:
        """Overwrite the parameters with a buffer of the same layout."""
        with torch.no_grad():
            self.buffer.copy_(buf)


def flatten_module(model: torch.nn.Module) -> FlatParams:
    """Flat buffer of a module's trainable parameters, named as in ``named_parameters()``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return FlatParams([[p for _, p in named]], [[n for n, _ in named]])


def average(buffers: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """Exact element-wise mean of byte buffers of one layout (per dtype run)."""
    out = torch.zeros_like(buffers[0])
    for dst, *srcs in zip(layout.typed(out), *(layout.typed(b) for b in buffers)):
        acc = torch.stack(srcs).to(torch.float64).mean(0)
        dst.copy_(acc)
    return out
