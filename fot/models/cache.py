"""Generation cache for FoT models: K, V, the running gate cumsum and the KV-shift state.

Forgetting attention needs, per layer, the keys and values of every past token, the gate
cumsum ``c_j = sum_{l<=j} log f_l`` at every past token (the bias is ``c_i - c_j``) and, with
KV-shift, the last *pre-shift* key/value projection (``k~_{t-1}``), which the next token mixes
with its own. This is not a transformers ``DynamicCache`` (that holds K and V only), so the model
opts out of HF's default cache and returns its own ``FoTCache`` from ``forward``; ``generate()``
then feeds it back step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FoTLayerCache:
    """Cached state of one attention layer.

    Attributes:
        keys: ``[B, Tk, H, D]`` keys after shift/norm/RoPE, as attention consumed them.
        values: ``[B, Tk, H, D]``.
        cumsum: ``[B, Tk, HQ]`` float32, running gate cumsum ``c`` at each cached position.
        k_shift: ``[B, H, D]`` last pre-shift key projection (``None`` without KV-shift).
        v_shift: ``[B, H, D]`` last pre-shift value projection (``None`` without KV-shift).
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    cumsum: torch.Tensor | None = None
    k_shift: torch.Tensor | None = None
    v_shift: torch.Tensor | None = None

    @property
    def seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

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
            k, v: ``[B, T, H, D]`` keys/values as attention consumes them.
            log_fgate: ``[B, T, HQ]`` float32 log forget gates of the new positions.
            k_pre, v_pre: ``[B, T, H, D]`` pre-shift projections (KV-shift), or None.

        Returns:
            ``[B, T, HQ]`` float32 cumsum ``c`` at the new positions (continuing the cached one;
            summed in float64).
        """
        c = torch.cumsum(log_fgate.double(), dim=1)
        if self.seq_length:
            c = (c + self.cumsum[:, -1:].double()).float()
            self.keys = torch.cat([self.keys, k], dim=1)
            self.values = torch.cat([self.values, v], dim=1)
            self.cumsum = torch.cat([self.cumsum, c], dim=1)
        else:
            c = c.float()
            self.keys, self.values, self.cumsum = k, v, c
        if k_pre is not None:
            self.k_shift = k_pre[:, -1]
        if v_pre is not None:
            self.v_shift = v_pre[:, -1]
        return c

    def map(self, fn) -> None:
        for name in ("keys", "values", "cumsum", "k_shift", "v_shift"):
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
