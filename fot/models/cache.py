"""Generation cache for FoT models: K, V, the running gate cumsum and the KV-shift state.

Forgetting attention needs, per layer, the keys and values of every past token, the gate
cumsum ``c_j = sum_{l<=j} log f_l`` at every past token (the bias is ``c_i - c_j``) and, with
KV-shift, the last *pre-shift* key/value projection (``k~_{t-1}``), which the next token mixes
with its own. This is not a transformers ``DynamicCache`` (that holds K and V only), so the model
opts out of HF's default cache and returns its own ``FoTCache`` from ``forward``; ``generate()``
then feeds it back step by step.

A cache with a fixed ``capacity`` also runs one-token decode steps with every index on the
device (:meth:`FoTCache.static_step`), so that a step can be captured once as a CUDA graph and
replayed: an eager decode step of a 760M model launches ~1,000 small kernels and is bound by
the host (~90% of its time), a replayed graph is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Keys a static step reads are rounded up to a multiple of this: one CUDA graph serves up to
# this many consecutive steps (the extra keys are masked out and cost a little bandwidth).
GRAPH_BUCKET = 1024


@dataclass
class StaticStep:
    """Device-side position and masks of one static decode step (shared by all layers).

    Attributes:
        pos: ``[1]`` int64, cached positions before the step (where the new token is written).
        bucket: number of buffer positions the step's attention reads (a Python constant of the
            captured graph; positions ``>= pos + 1`` are masked).
        mask: ``[B, capacity]`` bool, the ``attention_mask`` of the cached tokens and the new one
            (False = padding).
        arange: ``[capacity]`` int64, ``0 .. capacity - 1``.
    """

    pos: torch.Tensor
    bucket: int
    mask: torch.Tensor
    arange: torch.Tensor

    def key_mask(self, window_size: int | None) -> torch.Tensor:
        """``[B, bucket]`` bool: the keys the new token attends (causal, padding, window)."""
        j = self.arange[: self.bucket]
        visible = j <= self.pos  # (bucket,)
        if window_size is not None:
            visible = visible & (j > self.pos - window_size)
        return self.mask[:, : self.bucket] & visible[None]

    def positions(self) -> torch.Tensor:
        """``[B, 1]`` int64 RoPE position of the new token: real tokens before it (padding
        excluded), as the eager path counts them."""
        j = self.arange[: self.bucket]
        real = self.mask[:, : self.bucket] & (j <= self.pos)[None]  # (B, bucket)
        return (real.sum(-1, keepdim=True) - 1).clamp(min=0)


class FoTLayerCache:
    """Cached state of one attention layer.

    Keys and values live in head-major buffers ``[B, H, capacity, D]`` in the dtype attention
    consumed them in (the model dtype), grown by ~1/8 at a time: appending a token writes one
    row instead of copying the whole cache (``torch.cat``), and the decode attention can read
    each head's keys as one ``[Tk, D]`` matrix without a copy. With a fixed ``capacity`` the
    buffers are allocated once (zero-filled) and never move.

    Attributes:
        keys: ``[B, Tk, H, D]`` keys after shift/norm/RoPE, as attention consumed them (a view
            of the buffer; read-only use). During a static step: the step's ``bucket`` first
            buffer positions.
        values: ``[B, Tk, H, D]`` (a view).
        cumsum: ``[B, Tk, HQ]`` float64, running gate cumsum ``c`` at each cached position
            (float64: after 32k tokens ``|c|`` may be ~4e4, where float32 would round
            ``c_i - c_j`` by ~4e-3).
        k_shift: ``[B, H, D]`` last pre-shift key projection (``None`` without KV-shift).
        v_shift: ``[B, H, D]`` last pre-shift value projection (``None`` without KV-shift).
        step: the :class:`StaticStep` in progress, set by :class:`FoTCache` (else None).
    """

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        cumsum: torch.Tensor | None = None,
        k_shift: torch.Tensor | None = None,
        v_shift: torch.Tensor | None = None,
        *,
        capacity: int | None = None,
    ) -> None:
        self._k = self._v = self._c = None  # (B, H, cap, D), (B, H, cap, D), (B, cap, HQ)
        self._len = 0
        self.capacity = capacity
        self.step: StaticStep | None = None
        if keys is not None:
            self._set(keys, values, cumsum)
        self.k_shift, self.v_shift = k_shift, v_shift

    # -- storage -------------------------------------------------------------------------

    def _check_room(self, need: int) -> None:
        if self.capacity is not None and need > self.capacity:
            raise ValueError(
                f"the cache holds at most {self.capacity} positions (its capacity), {need} were "
                "needed: create the FoTCache with a larger capacity or enlarge it with "
                f"cache.grow({need}) (generate() does this itself from its max_length)"
            )

    def _set(self, keys: torch.Tensor, values: torch.Tensor, cumsum: torch.Tensor) -> None:
        """Replace the cached positions by ``keys``/``values`` ``[B, Tk, H, D]``, ``cumsum``."""
        B, T, H, D = keys.shape
        self._len = T
        if self.capacity is None:
            self._k = keys.transpose(1, 2).contiguous()  # (B, H, Tk, D)
            self._v = values.transpose(1, 2).contiguous()
            self._c = cumsum.to(torch.float64).contiguous()  # (B, Tk, HQ)
            return
        self._check_room(T)
        # Zero-filled: the positions a static step reads beyond the cached ones are masked,
        # and must be finite (0 * NaN would leak through the probabilities' matmul).
        cap = self.capacity
        self._k = keys.new_zeros(B, H, cap, D)
        self._v = values.new_zeros(B, H, cap, values.shape[-1])
        self._c = cumsum.new_zeros(B, cap, cumsum.shape[-1], dtype=torch.float64)
        self._k[:, :, :T] = keys.transpose(1, 2)
        self._v[:, :, :T] = values.transpose(1, 2)
        self._c[:, :T] = cumsum

    def _reserve(self, need: int) -> None:
        """Grow the buffers to hold ``need`` positions (amortised: +1/8, at least 256)."""
        self._check_room(need)
        if need > self._k.shape[2]:
            self._move(need + max(256, need // 8))

    def _move(self, new_cap: int) -> None:
        """Copy the cached positions into new buffers of ``new_cap`` positions (zero-filled
        with a fixed capacity, see :meth:`_set`)."""
        n = self._len
        for name, dim in (("_k", 2), ("_v", 2), ("_c", 1)):
            old = getattr(self, name)
            shape = list(old.shape)
            shape[dim] = new_cap
            buf = old.new_zeros(shape) if self.capacity is not None else old.new_empty(shape)
            buf.narrow(dim, 0, n).copy_(old.narrow(dim, 0, n))
            setattr(self, name, buf)

    def grow(self, capacity: int) -> None:
        """Raise a fixed capacity to ``capacity`` positions, keeping the cached ones (the
        buffers move: see :meth:`FoTCache.grow`)."""
        self.capacity = capacity
        if self._k is not None:
            self._move(capacity)

    def _visible(self) -> int:
        return self.step.bucket if self.step is not None else self._len

    @property
    def keys(self) -> torch.Tensor | None:
        """Cached keys ``[B, T, H, D]`` (a view; ``T`` includes a static step's bucket
        padding), or ``None`` before the first append."""
        return None if self._k is None else self._k[:, :, : self._visible()].transpose(1, 2)

    @property
    def values(self) -> torch.Tensor | None:
        """Cached values ``[B, T, H, D]`` (a view, like :attr:`keys`), or ``None``."""
        return None if self._v is None else self._v[:, :, : self._visible()].transpose(1, 2)

    @property
    def cumsum(self) -> torch.Tensor | None:
        """Forget-gate cumsum of the cached positions ``[B, T, HQ]`` float64, or ``None``."""
        return None if self._c is None else self._c[:, : self._visible()]

    @property
    def seq_length(self) -> int:
        """Number of cached positions (padding included)."""
        return self._len

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor,
        k_pre: torch.Tensor | None,
        v_pre: torch.Tensor | None,
        fused: bool = False,
    ) -> torch.Tensor:
        """Append ``T`` new positions; return their running gate cumsum.

        Args:
            k, v: ``[B, T, H, D]`` keys/values as attention consumes them (stored in the dtype
                of the first call's keys).
            log_fgate: ``[B, T, HQ]`` float32 log forget gates of the new positions.
            k_pre, v_pre: ``[B, T, H, D]`` pre-shift projections (KV-shift), or None.
            fused: a static step may write with one Triton launch
                (:func:`fot.kernels.decode.decode_append`, on CUDA) instead of ~ten PyTorch
                ops; the same numbers.

        Returns:
            ``[B, T, HQ]`` float64 cumsum ``c`` at the new positions (continuing the cached
            one).
        """
        if self.step is not None:
            return self._append_static(k, v, log_fgate, k_pre, v_pre, fused)
        c = torch.cumsum(log_fgate.double(), dim=1)
        if self._len:
            c = c + self._c[:, self._len - 1 : self._len]
            n, T = self._len, k.shape[1]
            self._reserve(n + T)
            self._k[:, :, n : n + T] = k.transpose(1, 2)  # (B, H, T, D), cast to cache dtype
            self._v[:, :, n : n + T] = v.transpose(1, 2)
            self._c[:, n : n + T] = c
            self._len = n + T
        else:
            self._set(k, v, c)
        for name, pre in (("k_shift", k_pre), ("v_shift", v_pre)):
            if pre is None:
                continue
            old = getattr(self, name)
            if self.capacity is not None and old is not None and old.shape == pre[:, -1].shape:
                old.copy_(pre[:, -1])  # in place: a captured step reads this buffer
            else:
                # A copy, not a view: a view would keep the whole [B, T, H, D] input alive.
                setattr(self, name, pre[:, -1].clone())
        return c

    def _append_static(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor,
        k_pre: torch.Tensor | None,
        v_pre: torch.Tensor | None,
        fused: bool,
    ) -> torch.Tensor:
        """:meth:`append` of one token at the device position ``step.pos`` (no host value is
        read or changed: :class:`FoTCache` advances the length after the step)."""
        pos = self.step.pos.to(self._c.device)  # the layer's device (a device_map over GPUs)
        if fused:
            from fot.kernels.decode import decode_append, decode_append_supported

            if decode_append_supported(self._k, k, v, k_pre, v_pre, log_fgate=log_fgate):
                return decode_append(  # one launch instead of ~ten
                    self._k, self._v, self._c, k, v, log_fgate, pos,
                    k_pre, self.k_shift if k_pre is not None else None,
                    v_pre, self.v_shift if v_pre is not None else None,
                )  # fmt: skip
        prev = self._c.index_select(1, pos - 1)  # (B, 1, HQ) cumsum of the last cached token
        c = log_fgate.double() + prev  # (B, 1, HQ) float64, as append
        self._k.index_copy_(2, pos, k.transpose(1, 2).to(self._k.dtype))  # (B, H, 1, D)
        self._v.index_copy_(2, pos, v.transpose(1, 2).to(self._v.dtype))
        self._c.index_copy_(1, pos, c)
        if k_pre is not None:
            self.k_shift.copy_(k_pre[:, -1])
        if v_pre is not None:
            self.v_shift.copy_(v_pre[:, -1])
        return c

    def append_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor,
        *,
        k_logits: torch.Tensor | None = None,
        v_logits: torch.Tensor | None = None,
        k_norm: tuple[torch.Tensor, float] | None = None,
        q_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A static step's KV-shift (continuing from :attr:`k_shift` / :attr:`v_shift`), q/k
        RMSNorm and :meth:`append`, in one launch
        (:func:`fot.kernels.decode.decode_shift_norm_append`).

        Args:
            q: ``[B, 1, HQ, D]`` the new token's query projection.
            k, v: ``[B, 1, H, D]`` its key and value projections, before shift and norm.
            log_fgate: ``[B, 1, HQ]`` float32 log forget gates.
            k_logits, v_logits: ``[B, 1, H]`` KV-shift logits, or None (no shift).
            k_norm, q_norm: ``(weight [H or HQ, D], eps)`` of the per-head RMSNorm, or None.

        Returns:
            ``(q, c)``: the query as attention takes it ``[B, 1, HQ, D]`` and the new token's
            cumsum ``[B, 1, HQ]`` float64; or None where the kernel does not apply (no static
            step, not on CUDA or the interpreter, gradients, no shift state): nothing was
            written, and the caller shifts, normalises and calls :meth:`append` itself.
        """
        if self.step is None:  # every cached forward asks: answer before importing Triton code
            return None
        from fot.kernels.decode import decode_append_supported, decode_shift_norm_append

        if (
            (k_logits is not None and self.k_shift is None)
            or (v_logits is not None and self.v_shift is None)
            or not decode_append_supported(
                self._k, q, k, v, k_logits, v_logits, log_fgate=log_fgate
            )
        ):
            return None
        k_weight, k_eps = k_norm if k_norm is not None else (None, 1e-6)
        q_weight, q_eps = q_norm if q_norm is not None else (None, 1e-6)
        c, q = decode_shift_norm_append(
            self._k, self._v, self._c, k, v, log_fgate, self.step.pos.to(self._c.device), q,
            k_logits=k_logits, k_shift=self.k_shift if k_logits is not None else None,
            k_weight=k_weight, k_eps=k_eps,
            v_logits=v_logits, v_shift=self.v_shift if v_logits is not None else None,
            q_weight=q_weight, q_eps=q_eps,
        )  # fmt: skip
        return q, c

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Apply ``fn`` (a batch-dim op: index_select, repeat_interleave) to every tensor.

        Returns:
            True if a buffer was replaced (its shape changed), False if every tensor was
            updated in place (a fixed-capacity cache keeps its buffers where it can).
        """
        replaced = False
        if self.capacity is not None:
            for name in ("_k", "_v", "_c", "k_shift", "v_shift"):
                old = getattr(self, name)
                if old is None:
                    continue
                new = fn(old)
                if new.shape == old.shape:
                    old.copy_(new)
                else:
                    setattr(self, name, new.contiguous())
                    replaced = True
            return replaced
        if self._len:
            self._set(fn(self.keys), fn(self.values), fn(self.cumsum))
        for name in ("k_shift", "v_shift"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))
        return True


class FoTCache:
    """Per-layer :class:`FoTLayerCache` list, the cache of ``generate()`` and ``forward``
    (``past_key_values=`` or, from transformers 5.24 on, ``cache=``).

    Args:
        num_layers: number of attention layers of the model.
        capacity: if set, the most positions the cache will hold: buffers of that size are
            allocated at the first append and never move (unless :meth:`grow` enlarges them),
            and one-token decode steps run through :meth:`static_step`; ``forward`` past it
            raises. ``generate()`` grows a fixed-capacity cache it is passed (its own from an
            earlier call, or one made by the user) to its ``max_length``, so that generation
            continues from a returned cache. ``None`` (default): buffers grow as needed.
        cuda_graphs: capture static steps on CUDA as CUDA graphs (one per batch size and
            :data:`GRAPH_BUCKET` of cached length) and replay them. Needs ``capacity``.
            ``FoTForCausalLM.generate`` turns both on for CUDA models
            (``FoTConfig.decode_cuda_graphs``).
    """

    is_compileable = False
    is_croppable = False

    def __init__(
        self, num_layers: int, *, capacity: int | None = None, cuda_graphs: bool = False
    ) -> None:
        if capacity is not None and (
            not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1
        ):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        if cuda_graphs and capacity is None:
            raise ValueError("cuda_graphs=True needs a fixed capacity (pass capacity=...)")
        self.capacity = capacity
        self.cuda_graphs = cuda_graphs
        self.layers = [FoTLayerCache(capacity=capacity) for _ in range(num_layers)]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._inputs: dict[str, torch.Tensor] | None = None  # the static steps' input buffers

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it holds a fixed-size recurrent state (transformers >= 5.24 asks):
        never here, every layer keeps K, V and the gate cumsum of each position, so ``generate``
        feeds only the tokens past :meth:`get_seq_length`."""
        return [False] * len(self.layers)

    def __getitem__(self, layer_idx: int) -> FoTLayerCache:
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Number of cached positions (padding included)."""
        return self.layers[layer_idx or 0].seq_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The fixed capacity in positions, or -1 for a cache that grows."""
        return -1 if self.capacity is None else self.capacity

    @property
    def step(self) -> StaticStep | None:
        """The static step in progress (the model builds its masks from it), else None."""
        return self.layers[0].step if self.layers else None

    def _step_inputs(self, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Input buffers of the static steps for this batch size (made once, reused by every
        captured graph; a new batch size or device drops the graphs)."""
        inp = self._inputs
        if inp is None or inp["ids"].shape[0] != batch or inp["ids"].device != device:
            self._graphs.clear()
            inp = self._inputs = {
                "ids": torch.zeros(batch, 1, dtype=torch.long, device=device),
                "mask": torch.ones(batch, self.capacity, dtype=torch.bool, device=device),
                "pos": torch.zeros(1, dtype=torch.long, device=device),
                "arange": torch.arange(self.capacity, device=device),
            }
        return inp

    def static_step(
        self,
        run: Callable[[torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decode step of one token per sequence, with every index on the device.

        The layers write the new token at the device position ``pos`` and attend over the
        first ``bucket`` buffer positions with a device mask, so the same kernels serve every
        step of a bucket: with ``cuda_graphs`` on CUDA (autograd and autocast off) the first
        step of a bucket runs eagerly, is then captured as a CUDA graph, and later steps replay
        it.

        Args:
            run: ``run(input_ids [B, 1]) -> logits [B, 1, V]`` float32, the model's forward with
                this cache (it reads :attr:`step` for the masks and positions).
            input_ids: ``[B, 1]`` int64, the new tokens.
            attention_mask: ``[B, past + 1]`` (1 = token, 0 = padding) or None.

        Returns:
            ``[B, 1, V]`` float32 logits of the step (a fresh tensor).
        """
        n = self.get_seq_length()
        B = input_ids.shape[0]
        if input_ids.shape[1] != 1 or n == 0:
            raise ValueError(
                f"a static step takes one new token per sequence after a prefill, got input_ids "
                f"{tuple(input_ids.shape)} with {n} cached positions"
            )
        self.layers[0]._check_room(n + 1)  # every layer has this capacity and length
        inp = self._step_inputs(B, input_ids.device)
        inp["ids"].copy_(input_ids)
        if attention_mask is None:
            inp["mask"][:, : n + 1] = True
        else:
            if tuple(attention_mask.shape) != (B, n + 1):
                raise ValueError(
                    f"attention_mask must be [B, past + 1] = {(B, n + 1)}, got "
                    f"{tuple(attention_mask.shape)}"
                )
            inp["mask"][:, : n + 1] = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        inp["pos"].fill_(n)
        bucket = min(self.capacity, -(-(n + 1) // GRAPH_BUCKET) * GRAPH_BUCKET)
        step = StaticStep(inp["pos"], bucket, inp["mask"], inp["arange"])
        for layer in self.layers:
            layer.step = step
        try:
            if (
                self.cuda_graphs
                and input_ids.is_cuda
                # a model split over GPUs (device_map) runs eagerly: a capture records one
                # device's stream only
                and all(layer._c.device == input_ids.device for layer in self.layers)
                and not torch.is_grad_enabled()
                # autocast's cache of cast weights is freed when its region ends: a graph
                # captured inside one would read freed memory afterwards
                and not torch.is_autocast_enabled(input_ids.device.type)
            ):
                logits = self._graph_step(run, inp["ids"], bucket)
            else:
                logits = run(inp["ids"])
        finally:
            for layer in self.layers:
                layer.step = None
        for layer in self.layers:
            layer._len = n + 1
        return logits

    def _graph_step(
        self, run: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, bucket: int
    ) -> torch.Tensor:
        with torch.cuda.device(ids.device):  # capture and replay on the model's GPU
            return self._graph_step_here(run, ids, bucket)

    def _graph_step_here(
        self, run: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, bucket: int
    ) -> torch.Tensor:
        key = (ids.shape[0], bucket)
        entry = self._graphs.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out.clone()
        # First step of this bucket: run it for real (this also compiles any Triton kernel and
        # initialises cuBLAS, which a capture must not do), on a side stream as PyTorch's
        # capture recipe asks; then capture the same step without running it.
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            logits = run(ids)
        current = torch.cuda.current_stream(ids.device)
        current.wait_stream(side)
        logits.record_stream(current)  # made on the side stream, used on this one
        # The cache only grows: graphs of smaller buckets will not be replayed again.
        for old in [k for k in self._graphs if k[0] == key[0] and k[1] < bucket]:
            del self._graphs[old]
        graph = torch.cuda.CUDAGraph()
        try:
            # on a stream of this GPU: torch.cuda.graph's default capture stream belongs to
            # the GPU that was current when the first graph of the process was made
            with torch.cuda.graph(graph, stream=side):
                out = run(ids)
        except Exception as err:
            raise RuntimeError(
                f"capturing the decode step as a CUDA graph failed ({type(err).__name__}: "
                f"{str(err)[:300]}). Decode without graphs: set model.config.decode_cuda_graphs "
                "= False for generate(), or pass a FoTCache without cuda_graphs. A failed capture "
                "can leave CUDA's random generator unusable: restart the process."
            ) from err
        self._graphs[key] = (graph, out)
        return logits

    def grow(self, capacity: int) -> None:
        """Enlarge a fixed-capacity cache to hold ``capacity`` positions, keeping the cached
        ones (copied into new zero-filled buffers; nothing happens if it holds as many
        already). The captured CUDA graphs read the old buffers: they are dropped, and the
        next step of each bucket is captured again.

        Raises:
            ValueError: the cache has no fixed capacity (it grows by itself), or ``capacity``
                is not a positive int.
        """
        if self.capacity is None:
            raise ValueError("grow() enlarges a fixed-capacity cache; this one grows by itself")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if capacity <= self.capacity:
            return
        for layer in self.layers:
            layer.grow(capacity)
        self.capacity = capacity
        self._graphs.clear()
        self._inputs = None  # the step inputs are [capacity] wide

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if any([layer.map(fn) for layer in self.layers]):
            self._graphs.clear()  # the captured graphs read the old buffers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows ``beam_idx`` (beam search)."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (int64 ``[B']``), as :meth:`reorder_cache`."""
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (``B -> B * repeats``, e.g. for beams)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        """Not supported: always raises ``NotImplementedError`` naming the strategies that work."""
        raise NotImplementedError(
            "FoTCache cannot be cropped: the KV-shift state of an earlier position is not kept; "
            "use a decoding strategy without cache rollback (greedy, sampling, beam search)"
        )


__all__ = ["GRAPH_BUCKET", "FoTCache", "FoTLayerCache", "StaticStep"]
