"""Forgetting-attention kernels (imported as ``fot.kernels``)."""

from .reference import forgetting_attention_decode_reference, forgetting_attention_reference

__all__ = ["forgetting_attention_decode_reference", "forgetting_attention_reference"]
