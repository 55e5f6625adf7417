"""Drops the warnings that importing Diffusers prints when torchao is installed on a torch it has no
compiled extensions for (a CPU build of torch, or a Python its wheels were not built for), and
Transformers' note about a missing torchvision.

With torchao 0.18 (the ``test`` extra) and torch 2.13 on a CPU machine, ``import diffusers`` prints
on every rank, before any code of this package runs:

- torchao: ``Failed to load .../torchao/_C_*.so: ...`` for each CUDA or other-Python extension, or
  ``Skipping import of cpp extensions ...`` (logger ``torchao``);
- torch: ``<enum '...'> is an Enum subclass and is now natively supported by torch.compile ...``
  for torchao's enums (logger ``torch.utils._pytree``);
- Diffusers: ``Unable to import `torchao` Tensor objects ...`` (logger
  ``diffusers.quantizers.torchao.torchao_quantizer``: Diffusers 0.42 looks for torchao classes that
  torchao 0.18 moved).

And one without torchao: Transformers 5 says ``[transformers] `CLIPImageProcessor` requires
torchvision (not installed); falling back to `CLIPImageProcessorPil` ...`` when Diffusers' Wan
pipelines import the CLIP image processor (logger ``transformers.utils.import_utils``); the PIL
fallback it takes is the processor those pipelines used before.

None of them changes what runs: torchao's Python quantization works without those extensions, and
diffusers-sp loads no torchao-serialized checkpoint. They look like errors to a user, so
:func:`install` (called when ``diffusers_sp`` is imported, before it imports Diffusers) adds one
filter to each of those loggers that drops exactly these messages and nothing else. A script
that imports Diffusers before ``diffusers_sp`` still sees them: that is the libraries' own output.
"""

from __future__ import annotations

import logging

#: ``{logger name: substrings, one of which marks a message as the known import warning}``.
NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
}


class _DropImportNoise(logging.Filter):
    """Refuses the records of one logger whose unformatted message holds one of ``markers``; for the
    pytree logger only those about torchao's enums."""

    def __init__(self, markers: tuple[str, ...]):
        super().__init__()
        self.markers = markers

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(m in str(record.msg) for m in self.markers):
            return True
        if record.name == "torch.utils._pytree":
            args = record.args if isinstance(record.args, tuple) else ()
            return not (args and getattr(args[0], "__module__", "").startswith("torchao"))
        return False


def install() -> None:
    """Adds the filter to each logger in :data:`NOISE` (once; calling again changes nothing)."""
    for name, markers in NOISE.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in log.filters):
            log.addFilter(_DropImportNoise(markers))
