"""diffusers-sp: sequence-parallel attention (Ulysses, K/V-gather, VSA) for Hugging Face Diffusers DiTs.

Public API only; see README.md.
"""

from .api import SequenceParallelHandle, disable_sequence_parallel, enable_sequence_parallel
from .processors import KVGatherAttnProcessor, UlyssesAttnProcessor, VideoSparseAttnProcessor
from .traits import ModelTraits, PipelineTraits
from .validation import SequenceParallelConfigError

__version__ = "0.1.0"

__all__ = [
    "enable_sequence_parallel",
    "disable_sequence_parallel",
    "SequenceParallelHandle",
    "SequenceParallelConfigError",
    "UlyssesAttnProcessor",
    "KVGatherAttnProcessor",
    "VideoSparseAttnProcessor",
    "ModelTraits",
    "PipelineTraits",
]
