"""Generation cache for FoT models: K, V, the running gate cumsum and the KV-shift state.

Forgetting attention needs, per layer, the keys and values of every past token, the gate
cumsum ``c_j = sum_{l<=j} log f_l`` at every past token (the bias is ``c_i - c_j``) and, with
KV-shift, the last *pre-shift* key/value projection (``k~_{t-1}``), which the next token mixes
with its own. This is not a transformers ``DynamicCache`` (that holds K and V only), so the model
opts out of HF's default cache and returns its own ``FoTCache`` from ``forward``; ``generate()``
then feeds it back step by step.
"""

from __future__ import annotations

import torch


class FoTLayerCache:
    """Cached state of one attention layer.

    Keys and values live in head-major buffers ``[B, H, capacity, D]`` in the dtype attention
    consumed them in (the model dtype), grown by ~1/8 at a time: appending a token writes one
    row instead of copying the whole cache (``torch.cat``), and the decode attention can read
    each head's keys as one ``[Tk, D]`` matrix without a copy.

    Attributes:
        keys: ``[B, Tk, H, D]`` keys after shift/norm/RoPE, as attention consumed them (a view
            of the buffer; read-only use).
        values: ``[B, Tk, H, D]`` (a view).
        cumsum: ``[B, Tk, HQ]`` float32, running gate cumsum ``c`` at each cached position.
        k_shift: ``[B, H, D]`` last pre-shift key projection (``None`` without KV-shift).
        v_shift: ``[B, H, D]`` last pre-shift value projection (``None`` without KV-shift).
    """

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        cumsum: torch.Tensor | None = None,
        k_shift: torch.Tensor | None = None,
        v_shift: torch.Tensor | None = None,
    ) -> None:
        self._k = self._v = self._c = None  # (B, H, cap, D), (B, H, cap, D), (B, cap, HQ)
        self._len = 0
        if keys is not None:
            self._set(keys, values, cumsum)
        self.k_shift, self.v_shift = k_shift, v_shift

    # -- storage -------------------------------------------------------------------------

    def _set(self, keys: torch.Tensor, values: torch.Tensor, cumsum: torch.Tensor) -> None:
        """Replace the cached positions by ``keys``/``values`` ``[B, Tk, H, D]``, ``cumsum``."""
        self._k = keys.transpose(1, 2).contiguous()  # (B, H, Tk, D)
        self._v = values.transpose(1, 2).contiguous()
        self._c = cumsum.contiguous()  # (B, Tk, HQ)
        self._len = keys.shape[1]

    def _reserve(self, need: int) -> None:
        """Grow the buffers to hold ``need`` positions (amortised: +1/8, at least 256)."""
        cap = self._k.shape[2]
        if need <= cap:
            return
        new_cap = need + max(256, need // 8)
        n = self._len
        for name, dim in (("_k", 2), ("_v", 2), ("_c", 1)):
            old = getattr(self, name)
            shape = list(old.shape)
            shape[dim] = new_cap
            buf = old.new_empty(shape)
            buf.narrow(dim, 0, n).copy_(old.narrow(dim, 0, n))
            setattr(self, name, buf)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self._len].transpose(1, 2)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self._len].transpose(1, 2)

    @property
    def cumsum(self) -> torch.Tensor | None:
        return None if self._c is None else self._c[:, : self._len]

    @property
    def seq_length(self) -> int:
        return self._len

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor,
        k_pre: torch.Tensor | None,
        v_pre: torch.Tensor | None,
    ) -> torch.Tensor:
        """Append ``T`` new positions; return their running gate cumsum.

        Args:
            k, v: ``[B, T, H, D]`` keys/values as attention consumes them (stored in the dtype
                of the first call's keys).
            log_fgate: ``[B, T, HQ]`` float32 log forget gates of the new positions.
            k_pre, v_pre: ``[B, T, H, D]`` pre-shift projections (KV-shift), or None.

        Returns:
            ``[B, T, HQ]`` float32 cumsum ``c`` at the new positions (continuing the cached one;
            summed in float64).
        """
        c = torch.cumsum(log_fgate.double(), dim=1)
        if self._len:
            c = (c + self._c[:, self._len - 1 : self._len].double()).float()
            n, T = self._len, k.shape[1]
            self._reserve(n + T)
            self._k[:, :, n : n + T] = k.transpose(1, 2)  # (B, H, T, D), cast to cache dtype
            self._v[:, :, n : n + T] = v.transpose(1, 2)
            self._c[:, n : n + T] = c
            self._len = n + T
        else:
            c = c.float()
            self._set(k, v, c)
        if k_pre is not None:
            self.k_shift = k_pre[:, -1]
        if v_pre is not None:
            self.v_shift = v_pre[:, -1]
        return c

    def map(self, fn) -> None:
        """Apply ``fn`` (a batch-dim op: index_select, repeat_interleave) to every tensor."""
        if self._len:
            self._set(fn(self.keys), fn(self.values), fn(self.cumsum))
        for name in ("k_shift", "v_shift"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))


class FoTCache:
    """Per-layer :class:`FoTLayerCache` list, usable as ``past_key_values`` in ``generate()``.

    Args:
        num_layers: number of attention layers of the model.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int) -> None:
        self.layers = [FoTLayerCache() for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> FoTLayerCache:
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Number of cached positions (padding included)."""
        return self.layers[layer_idx or 0].seq_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # grows without bound

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows ``beam_idx`` (beam search)."""
        for layer in self.layers:
            layer.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "FoTCache cannot be cropped: the KV-shift state of an earlier position is not kept; "
            "use a decoding strategy without cache rollback (greedy, sampling, beam search)"
        )


__all__ = ["FoTCache", "FoTLayerCache"]
