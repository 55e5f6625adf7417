"""Attention processors, one per sequence-parallel strategy."""

from .base import SequenceParallelAttnProcessor
from .hybrid import HybridAttnProcessor
from .kv_gather import KVGatherAttnProcessor, PrefixKVAttnProcessor, SplitKVAttnProcessor, SuffixKVAttnProcessor
from .linear import LinearAttnProcessor
from .ulysses import UlyssesAttnProcessor
from .vsa import VideoSparseAttnProcessor

PROCESSORS = {"ulysses": UlyssesAttnProcessor, "kv_gather": KVGatherAttnProcessor, "hybrid": HybridAttnProcessor,
              "vsa": VideoSparseAttnProcessor}

__all__ = ["SequenceParallelAttnProcessor", "UlyssesAttnProcessor", "KVGatherAttnProcessor", "VideoSparseAttnProcessor",
           "HybridAttnProcessor", "SplitKVAttnProcessor", "LinearAttnProcessor", "PrefixKVAttnProcessor",
           "SuffixKVAttnProcessor", "PROCESSORS"]
