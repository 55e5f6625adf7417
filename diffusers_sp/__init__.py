"""diffusers-sp: sequence-parallel attention (Ulysses, K/V-gather, VSA) for Hugging Face Diffusers DiTs.

Public API only; see README.md.
"""

# Before anything imports Diffusers: its import warnings about a torchao without compiled extensions
# are dropped (see diffusers_sp.import_noise).
from . import import_noise as _import_noise

_import_noise.install()

from .api import SequenceParallelHandle, disable_sequence_parallel, enable_sequence_parallel
from .sharded_load import load_pipeline_for_sharding  # noqa: E402
from .processors import KVGatherAttnProcessor, UlyssesAttnProcessor, VideoSparseAttnProcessor
from .traits import ModelTraits, PipelineTraits
from .errors import SequenceParallelConfigError

__version__ = "0.1.0"

__all__ = [
    "enable_sequence_parallel",
    "disable_sequence_parallel",
    "SequenceParallelHandle",
    "SequenceParallelConfigError",
    "load_pipeline_for_sharding",
    "UlyssesAttnProcessor",
    "KVGatherAttnProcessor",
    "VideoSparseAttnProcessor",
    "ModelTraits",
    "PipelineTraits",
]
