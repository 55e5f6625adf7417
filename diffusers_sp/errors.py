"""The error types of diffusers-sp: the bottom layer, imported by every other module and importing none."""

from __future__ import annotations


class SequenceParallelConfigError(ValueError):
    """A mode, pipeline, model or option combination that cannot run exactly.

    Raised by :func:`diffusers_sp.enable_sequence_parallel` before any collective, with the same
    message on every rank, and by the processors during a forward when the model produces a shape
    the sharding plan did not expect. The message names the pipeline or model, the conflicting
    trait, and the modes (or settings) that would work.
    """
