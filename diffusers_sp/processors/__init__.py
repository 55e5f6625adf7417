"""Attention processors, one per sequence-parallel strategy."""

from .base import SequenceParallelAttnProcessor
from .kv_gather import KVGatherAttnProcessor
from .ulysses import UlyssesAttnProcessor

PROCESSORS = {"ulysses": UlyssesAttnProcessor, "kv_gather": KVGatherAttnProcessor}

__all__ = ["SequenceParallelAttnProcessor", "UlyssesAttnProcessor", "KVGatherAttnProcessor", "PROCESSORS"]
