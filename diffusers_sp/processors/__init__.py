"""Attention processors, one per sequence-parallel strategy."""

from .base import SequenceParallelAttnProcessor
from .kv_gather import KVGatherAttnProcessor, PrefixKVAttnProcessor, SplitKVAttnProcessor
from .linear import LinearAttnProcessor
from .ulysses import UlyssesAttnProcessor
from .vsa import VideoSparseAttnProcessor

PROCESSORS = {"ulysses": UlyssesAttnProcessor, "kv_gather": KVGatherAttnProcessor, "vsa": VideoSparseAttnProcessor}

__all__ = ["SequenceParallelAttnProcessor", "UlyssesAttnProcessor", "KVGatherAttnProcessor", "VideoSparseAttnProcessor",
           "SplitKVAttnProcessor", "LinearAttnProcessor", "PrefixKVAttnProcessor", "PROCESSORS"]
