"""The KV containers: a cached unit's attention states, and the reusable buffer cache.

``ModuleKV`` holds the per-layer keys and values of one cached unit, stacked
over layers so one copy moves a whole module. ``Workspace`` is the buffered
concatenation of the paper: per-layer buffers allocated once and reused
across prompts; a prompt's modules are copied in (or found already there from
the previous prompt), and new tokens are written after them in place, so the
forward pass never concatenates or copies the assembled cache. ``RequestKV`` is one
request's own rows while it decodes in a batch (its assembled cache copied out of the
workspace after its prefill, and room for its answer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

_uid = itertools.count(1)


@dataclass(slots=True, eq=False)
class ModuleKV:
    """Attention states of one cached unit.

    Never modified after creation: every prompt that imports the unit reads
    the same tensors, which is what makes repeated prompts identical.

    ``.to(dtype=torch.int8)`` quantizes as KIVI does: keys per channel (their outliers
    sit in fixed channels), values per token, symmetric, with fp16 scales kept beside
    the data. Any float ``.to(dtype=...)`` dequantizes, and the workspace dequantizes
    while it copies a unit in.
    """

    keys: torch.Tensor  # (n_layers, n_kv_heads, T, head_dim); int8 when quantized
    values: torch.Tensor  # (n_layers, n_kv_heads, T, head_dim_v); int8 when quantized
    token_ids: torch.Tensor  # (T,) int64
    position_ids: torch.Tensor  # (T,) int64
    uid: int = field(default_factory=lambda: next(_uid))  # identity for buffer reuse
    k_scale: torch.Tensor | None = None  # (n_layers, n_kv_heads, 1, head_dim) fp16, int8 keys only
    v_scale: torch.Tensor | None = None  # (n_layers, n_kv_heads, T, 1) fp16, int8 values only

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state tensors by name (scales included when quantized)."""
        out = {"keys": self.keys, "values": self.values}
        if self.quantized:
            out.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def map(self, fn) -> ModuleKV:
        """The same unit (same ``uid``) with ``fn`` applied to every state tensor (a move, a pin)."""
        t = {k: fn(v) for k, v in self.tensors().items()}
        return ModuleKV(t["keys"], t["values"], self.token_ids, self.position_ids, uid=self.uid,
                        k_scale=t.get("k_scale"), v_scale=t.get("v_scale"))

    def head(self, n: int) -> ModuleKV:
        """The unit's first ``n`` tokens, as views. Each token's states depend only on the
        tokens before it, so a prefix of a unit is a unit of its own (a document read without
        the separator it was encoded with). It keeps the ``uid``: the workspace matches units by
        ``(uid, end)`` in prompt order, so equal ends mean equal lengths and equal rows."""
        if n >= self.length:
            return self
        return ModuleKV(self.keys[:, :, :n], self.values[:, :, :n], self.token_ids[:n], self.position_ids[:n],
                        uid=self.uid, k_scale=self.k_scale,
                        v_scale=None if self.v_scale is None else self.v_scale[:, :, :n])

    def with_positions(self, position_ids: torch.Tensor) -> ModuleKV:
        """The same states at other position ids (for encodings whose states carry no position)."""
        return ModuleKV(self.keys, self.values, self.token_ids, position_ids, uid=self.uid, k_scale=self.k_scale,
                        v_scale=self.v_scale)

    def to(self, device=None, dtype=None) -> ModuleKV:
        """A copy on ``device`` in ``dtype`` (same ``uid`` only if nothing changed);
        ``torch.int8`` quantizes, a float dtype dequantizes."""
        if dtype == torch.int8:
            kv = self if self.quantized else _quantize(self)
            return kv if device is None else kv.map(lambda t: t.to(device))
        if self.quantized:
            if dtype is None:
                return self.map(lambda t: t.to(device=device))
            k = self.keys.to(device=device, dtype=dtype) * self.k_scale.to(device=device, dtype=dtype)
            v = self.values.to(device=device, dtype=dtype) * self.v_scale.to(device=device, dtype=dtype)
            return ModuleKV(k, v, self.token_ids, self.position_ids)
        k = self.keys.to(device=device, dtype=dtype)
        v = self.values.to(device=device, dtype=dtype)
        if k is self.keys and v is self.values:
            return self
        return ModuleKV(k, v, self.token_ids, self.position_ids)

    @staticmethod
    def concat(units: list[ModuleKV]) -> ModuleKV:
        """Units one after another along the token axis (float states only), as one context."""
        if any(u.quantized for u in units):
            raise ValueError("concat takes float states: dequantize with .to(dtype=...) first")
        return ModuleKV(torch.cat([u.keys for u in units], 2), torch.cat([u.values for u in units], 2),
                        torch.cat([u.token_ids for u in units]), torch.cat([u.position_ids for u in units]))

    def layer_keys(self, layer: int, device=None, dtype=None) -> torch.Tensor:
        """Keys of one layer, dequantized, (n_kv_heads, T, head_dim)."""
        k = self.keys[layer].to(device=device, dtype=dtype)
        return k * self.k_scale[layer].to(device=device, dtype=dtype) if self.quantized else k


# The smallest fp16 normal number: scales below it would lose precision as fp16.
_MIN_SCALE = 2.0**-14


def _quantize(kv: ModuleKV) -> ModuleKV:
    """Symmetric int8: keys per channel (over tokens), values per token (over channels)."""
    k = kv.keys.float()
    v = kv.values.float()
    ks = (k.abs().amax(dim=2, keepdim=True) / 127).clamp_min(_MIN_SCALE)  # (L, H, 1, D)
    vs = (v.abs().amax(dim=3, keepdim=True) / 127).clamp_min(_MIN_SCALE)  # (L, H, T, 1)
    kq = (k / ks).round_().clamp_(-127, 127).to(torch.int8)
    vq = (v / vs).round_().clamp_(-127, 127).to(torch.int8)
    return ModuleKV(kq, vq, kv.token_ids, kv.position_ids, k_scale=ks.half(), v_scale=vs.half())


def place(k: torch.Tensor, v: torch.Tensor, u: ModuleKV) -> None:
    """Copy unit ``u``'s states into ``k`` and ``v`` (L, H, T, D) views, dequantizing int8. One
    copy moves the unit for every layer at once; from pinned host memory to a GPU it is
    non-blocking, so the copy overlaps compute."""
    k.copy_(u.keys, non_blocking=True)
    v.copy_(u.values, non_blocking=True)
    if u.quantized:  # int8 in, dequantized in place: no temporary of the unit's size
        k.mul_(u.k_scale.to(device=k.device, dtype=k.dtype))
        v.mul_(u.v_scale.to(device=v.device, dtype=v.dtype))


class BufferLayer(DynamicLayer):
    """One layer of a :class:`Workspace`: writes new states into a preallocated buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self._k = keys  # (1, n_kv_heads, capacity, head_dim), a view into the workspace
        self._v = values
        self.length = 0
        self.device = keys.device
        self.is_initialized = True
        self.keys = keys[:, :, :0]
        self.values = values[:, :, :0]

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        end = self.length + n
        if end > self._k.shape[2]:
            raise RuntimeError(
                f"workspace holds {self._k.shape[2]} tokens; {end} needed (raise max_tokens)"
            )
        self._k[:, :, self.length : end].copy_(key_states)
        self._v[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys = self._k[:, :, :end]
        self.values = self._v[:, :, :end]
        return self.keys, self.values

    def set_length(self, n: int) -> None:
        self.length = n
        self.keys = self._k[:, :, :n]
        self.values = self._v[:, :, :n]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, (n_kv_heads, capacity, head_dim) each (the fused
        decode step writes its row at :attr:`length` and attends in place)."""
        return self._k[0], self._v[0]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, max_length: int) -> None:
        self.set_length(min(self.length, max_length))

    def reset(self) -> None:
        self.set_length(0)


class Workspace:
    """Reusable per-layer KV buffers: the assembled cache of the current prompt.

    ``assemble`` places units in order and remembers what it placed; the next
    call copies only from the first unit that differs, so a shared prefix
    (the preamble, a system message, the same documents) is never copied again.
    Tokens written by a forward pass go after the assembled prefix and are
    dropped by the next ``assemble``.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, head_dim_v: int, dtype, device, capacity: int):
        self.shape = (n_layers, n_kv_heads, head_dim, head_dim_v)
        self.dtype = dtype
        self.device = device
        self.capacity = 0
        self._resident: list[tuple[int, int]] = []  # (uid, end offset) of each placed unit
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        L, H, D, Dv = self.shape
        self.k = torch.empty((L, 1, H, capacity, D), dtype=self.dtype, device=self.device)
        self.v = torch.empty((L, 1, H, capacity, Dv), dtype=self.dtype, device=self.device)
        self.capacity = capacity
        self._resident = []
        self.layers = [BufferLayer(self.k[i], self.v[i]) for i in range(L)]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def ensure(self, tokens: int) -> None:
        """Grow (never shrink) to hold ``tokens``; growing drops what is resident."""
        if tokens > self.capacity:
            self._alloc(max(tokens, int(self.capacity * 1.5), 256))

    def assemble(self, units: list[ModuleKV], extra: int) -> tuple[int, int]:
        """Place ``units`` at the start of the buffers, with room for ``extra`` tokens.

        Returns ``(cached_length, copied_tokens)``.
        """
        total = sum(u.length for u in units)
        self.ensure(total + extra)
        off = 0
        keep = 0
        for i, u in enumerate(units):
            if i < len(self._resident) and self._resident[i] == (u.uid, off + u.length):
                keep = i + 1
                off += u.length
            else:
                break
        copied = 0
        resident = self._resident[:keep]
        for u in units[keep:]:
            end = off + u.length
            place(self.k[:, 0, :, off:end], self.v[:, 0, :, off:end], u)
            resident.append((u.uid, end))
            copied += u.length
            off = end
        self._resident = resident
        for layer in self.layers:
            layer.set_length(off)
        return off, copied

    def replace_rows(self, rows: torch.Tensor, src: int, n: int, tail: int) -> None:
        """After a recompute forward: the ``n`` fresh rows written at ``src`` replace the cache
        ``rows`` (n,), and the ``tail`` rows after them move down to ``src``. Units whose rows
        changed no longer hold their stored states, so they stop counting as resident."""
        k, v = self.k[:, 0], self.v[:, 0]  # (L, H, capacity, D)
        k.index_copy_(2, rows, k[:, :, src : src + n].clone())
        v.index_copy_(2, rows, v[:, :, src : src + n].clone())
        k[:, :, src : src + tail] = k[:, :, src + n : src + n + tail].clone()
        v[:, :, src : src + tail] = v[:, :, src + n : src + n + tail].clone()
        for layer in self.layers:
            layer.set_length(src + tail)
        first = int(rows.min())
        self._resident = [r for r in self._resident if r[1] <= first]

    def cache(self) -> Cache:
        """A transformers ``Cache`` view over the buffers (no copy)."""
        return Cache(layers=self.layers)

    def invalidate(self) -> None:
        self._resident = []


class RequestKV:
    """One request's own states while it decodes in a batch: its first ``length`` rows are
    its assembled cache and computed tokens, the rest is room for what comes next."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int, pos: torch.Tensor | None = None) -> None:
        self.k = k  # (n_layers, n_kv_heads, capacity, head_dim)
        self.v = v  # (n_layers, n_kv_heads, capacity, head_dim_v)
        self.length = length
        #: (capacity,) the position of each row (sliding windows are counted over them)
        self.pos = pos if pos is not None else torch.zeros(k.shape[2], dtype=torch.long, device=k.device)

    @classmethod
    def assemble(cls, units: list[ModuleKV], extra: int, shape: tuple[int, int, int, int], dtype,
                 device) -> RequestKV:
        """``units`` one after another in fresh rows (``shape``: layers, heads, key and value head
        sizes), with room for ``extra`` more."""
        L, H, D, Dv = shape
        T = sum(u.length for u in units)
        k = torch.empty((L, H, T + extra, D), dtype=dtype, device=device)
        v = torch.empty((L, H, T + extra, Dv), dtype=dtype, device=device)
        pos = torch.zeros(T + extra, dtype=torch.long, device=device)
        off = 0
        for u in units:
            place(k[:, :, off : off + u.length], v[:, :, off : off + u.length], u)
            pos[off : off + u.length] = u.position_ids
            off += u.length
        return cls(k, v, T, pos)

    @classmethod
    def from_workspace(cls, ws: Workspace, extra: int, positions: torch.Tensor | None = None) -> RequestKV:
        """A copy of the workspace's current rows, with room for ``extra`` more; ``positions``
        (rows,): theirs (a prefill's ``position_ids``)."""
        T = ws.layers[0].length
        L, H, D, Dv = ws.shape
        k = torch.empty((L, H, T + extra, D), dtype=ws.dtype, device=ws.device)
        v = torch.empty((L, H, T + extra, Dv), dtype=ws.dtype, device=ws.device)
        k[:, :, :T].copy_(ws.k[:, 0, :, :T])
        v[:, :, :T].copy_(ws.v[:, 0, :, :T])
        pos = torch.zeros(T + extra, dtype=torch.long, device=ws.device)
        if positions is not None:
            pos[:T] = positions[:T]
        return cls(k, v, T, pos)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def buffer_layers(self) -> list[BufferLayer]:
        """Every layer's rows as a :class:`BufferLayer` (no copy), at ``length``."""
        layers = []
        for i in range(self.k.shape[0]):
            layer = BufferLayer(self.k[i][None], self.v[i][None])  # (1, H, capacity, D) views
            layer.set_length(self.length)
            layers.append(layer)
        return layers

    def cache(self) -> Cache:
        """A transformers ``Cache`` over these rows (no copy): a forward writes after ``length``;
        read the new length back with :meth:`sync`."""
        return Cache(layers=self.buffer_layers())

    def sync(self, cache: Cache) -> None:
        """Take the length a forward over :meth:`cache` left."""
        self.length = cache.layers[0].length  # type: ignore[attr-defined]  # BufferLayer
