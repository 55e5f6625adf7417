"""Loading a pipeline for ``shard_weights=True`` without a whole copy of its big weights on every rank.

``DiffusionPipeline.from_pretrained`` gives every rank the whole pipeline in host memory: N copies
of a 14B transformer on one machine. :func:`load_pipeline_for_sharding` builds the transformers and
text encoders with their parameters on the ``meta`` device (no storage; buffers such as RoPE tables
are real) and remembers their safetensors files; everything else (VAE, scheduler, tokenizers) loads
as usual. ``enable_sequence_parallel(pipe, shard_weights=True)`` then reads each FSDP unit's
parameters from the files just before sharding it (:func:`materialize`), so a rank holds at most
one unit whole at a time, and its shards: peak host memory per rank stays near ``1/N`` of the
weights plus one block. The files are read with safetensors' ``safe_open`` (memory-mapped, one
tensor at a time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import SequenceParallelConfigError

#: The attribute under which a module built here keeps ``{state-dict key: safetensors file}``.
WEIGHT_FILES_ATTR = "_diffusers_sp_weight_files"


def _weight_files(folder: Path) -> dict[str, str]:
    """``{tensor name: file}`` of the safetensors files in ``folder`` (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SequenceParallelConfigError(
            f"{folder}: no .safetensors file; load_pipeline_for_sharding reads safetensors weights only.")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update({key: str(file) for key in f.keys()})
    return names


def _empty_model(cls, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A ``cls`` (a Diffusers or Transformers model class) from the config in ``folder``, its parameters on
    the meta device in ``dtype`` (the class's ``_keep_in_fp32_modules`` in float32, as their loaders do)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # Diffusers' ModelMixin
            model = cls.from_config(cls.load_config(str(folder)))
        else:  # Transformers' PreTrainedModel
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(str(folder)))
    model.to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.to(torch.float32)
    if hasattr(model, "tie_weights"):  # last (a cast unties): tied embeddings are one parameter, saved once
        model.tie_weights()
    return model.eval()


def load_pipeline_for_sharding(pipeline_cls, path: str, *, dtype: torch.dtype = torch.bfloat16, **kwargs):
    """Loads the pipeline at ``path`` (a local folder saved by ``save_pretrained``) with its
    transformers and text encoders left empty (meta parameters) for ``enable_sequence_parallel(pipe,
    shard_weights=True)`` to fill unit by unit (see the module docstring).

    Args:
        pipeline_cls: The Diffusers pipeline class (``WanPipeline``, ``FluxPipeline``, ...).
        path: The pipeline's folder (``model_index.json`` and one subfolder per component, weights as
            ``.safetensors``); download a Hub repository first (``huggingface_hub.snapshot_download``).
        dtype: The dtype of the weights (``torch.bfloat16`` by default).
        kwargs: Passed on to ``pipeline_cls.from_pretrained`` for the other components.

    Returns:
        The pipeline. Its transformers and text encoders cannot run before sequence parallelism is
        enabled with ``shard_weights=True``.

    Raises:
        SequenceParallelConfigError: ``path`` is not a local pipeline folder, or a component to shard
            has no safetensors weights.
    """
    import importlib

    root = Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        raise SequenceParallelConfigError(
            f"{path}: no model_index.json; load_pipeline_for_sharding takes a local pipeline folder "
            f"(huggingface_hub.snapshot_download(repo_id) makes one from a Hub repository).")
    components = {}
    for name, entry in json.loads(index.read_text()).items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry or name in kwargs:
            continue
        if not ("transformer" in name or name.startswith("text_encoder")):
            continue
        library, class_name = entry
        cls = getattr(importlib.import_module(library), class_name)
        model = _empty_model(cls, root / name, dtype)
        setattr(model, WEIGHT_FILES_ATTR, _weight_files(root / name))
        components[name] = model
    return pipeline_cls.from_pretrained(str(root), dtype=dtype, **components, **kwargs)


def has_empty_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built by :func:`load_pipeline_for_sharding` and still has parameters on
    the meta device. (Meta parameters alone do not say so: Accelerate's sequential CPU offload keeps
    its modules' parameters on the meta device between calls.)"""
    return getattr(module, WEIGHT_FILES_ATTR, None) is not None and any(p.is_meta for p in module.parameters())


def materialize(unit: torch.nn.Module, root: torch.nn.Module, prefix: str) -> None:
    """Reads the meta parameters of ``unit`` (``root``'s submodule at ``prefix``; ``""`` for the root)
    from ``root``'s safetensors files, in their dtype, on the CPU. A parameter shared by several
    modules (tied embeddings) is read once, under whichever of its names the files hold.

    Raises:
        SequenceParallelConfigError: ``root`` was not built by :func:`load_pipeline_for_sharding`, or a
            parameter is in none of its files.
    """
    from safetensors import safe_open

    files = getattr(root, WEIGHT_FILES_ATTR, None)
    if files is None:
        raise SequenceParallelConfigError(
            f"{type(root).__name__} has parameters on the meta device but no weight files: load the pipeline "
            f"with diffusers_sp.load_pipeline_for_sharding (or from_pretrained without low_cpu_mem_usage tricks).")
    names = {}
    for name, param in unit.named_parameters(remove_duplicate=False):
        if param.is_meta:
            names.setdefault(id(param), []).append(name)
    owners = {name: (module, local) for module_name, module in unit.named_modules(remove_duplicate=False)
              for local, p in module.named_parameters(recurse=False, remove_duplicate=False)
              for name in [f"{module_name}.{local}" if module_name else local] if p.is_meta}
    for aliases in names.values():
        key = next((f"{prefix}.{a}" if prefix else a for a in aliases if (f"{prefix}.{a}" if prefix else a) in files),
                   None)
        if key is None:
            raise SequenceParallelConfigError(
                f"{type(root).__name__}: parameter {aliases[0]!r} of {prefix or 'the model'} is in none of its "
                f"safetensors files.")
        module, local = owners[aliases[0]]
        dtype = getattr(module, local).dtype
        with safe_open(files[key], framework="pt") as f:
            value = torch.nn.Parameter(f.get_tensor(key).to(dtype))  # requires_grad as from_pretrained gives it
        for alias in aliases:
            owner, name = owners[alias]
            owner._parameters[name] = value
