"""Attention processors, one per sequence-parallel strategy."""

from .base import SequenceParallelAttnProcessor
from .kv_gather import KVGatherAttnProcessor, SplitKVAttnProcessor
from .ulysses import UlyssesAttnProcessor
from .vsa import VideoSparseAttnProcessor

PROCESSORS = {"ulysses": UlyssesAttnProcessor, "kv_gather": KVGatherAttnProcessor, "vsa": VideoSparseAttnProcessor}

__all__ = ["SequenceParallelAttnProcessor", "UlyssesAttnProcessor", "KVGatherAttnProcessor", "VideoSparseAttnProcessor",
           "SplitKVAttnProcessor", "PROCESSORS"]
