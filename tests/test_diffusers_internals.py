"""The Diffusers internals diffusers-sp relies on, one test each: a Diffusers release that changes one
fails here, by name, rather than in a user's output. Tested with Diffusers 0.42.1 (setup.cfg pins
``>=0.42.1,<0.43``)."""

from __future__ import annotations

import dataclasses
import inspect

import torch


def test_context_parallel_plan_entries():
    """``_cp_plan`` entries (diffusers_sp.sharding, the families): ContextParallelInput's split_dim,
    expected_dims, split_output and ContextParallelOutput's gather_dim, expected_dims."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    assert {"split_dim", "expected_dims", "split_output"} <= {f.name for f in dataclasses.fields(ContextParallelInput)}
    assert {"gather_dim", "expected_dims"} <= {f.name for f in dataclasses.fields(ContextParallelOutput)}
    entry = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    assert (entry.split_dim, entry.expected_dims, entry.split_output) == (1, 3, True)


def test_models_ship_cp_plans_in_the_format_read():
    """Families reuse the ``_cp_plan`` of Wan, Flux, QwenImage and LTX: a dict from submodule name to a
    dict of entries or an output entry."""
    from diffusers import FluxTransformer2DModel, LTXVideoTransformer3DModel, QwenImageTransformer2DModel, WanTransformer3DModel
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    for cls in (WanTransformer3DModel, FluxTransformer2DModel, QwenImageTransformer2DModel, LTXVideoTransformer3DModel):
        plan = cls._cp_plan
        assert isinstance(plan, dict) and plan, cls.__name__
        for name, entry in plan.items():
            assert isinstance(name, str), (cls.__name__, name)
            values = entry.values() if isinstance(entry, dict) else entry if isinstance(entry, (list, tuple)) else [entry]
            assert all(isinstance(v, (ContextParallelInput, ContextParallelOutput, list, tuple)) for v in values), \
                (cls.__name__, name, entry)


def test_model_hook_interface():
    """diffusers_sp.sharding's hooks have ModelHook's interface: initialize_hook(module),
    pre_forward(module, *args, **kwargs) -> (args, kwargs), post_forward(module, output)."""
    from diffusers.hooks import ModelHook

    params = {name: list(inspect.signature(getattr(ModelHook, name)).parameters) for name in
              ("initialize_hook", "pre_forward", "post_forward")}
    assert params["initialize_hook"] == ["self", "module"]
    assert params["pre_forward"] == ["self", "module", "args", "kwargs"]
    assert params["post_forward"] == ["self", "module", "output"]


def test_hook_registry_internals():
    """diffusers_sp.forward_chain places a hook innermost in a module's forward chain and removes it
    again through HookRegistry's ``hooks``, ``_hook_order`` and ``_fn_refs``; caches.py finds
    registries as the module attribute ``_diffusers_hook``."""
    from diffusers.hooks import HookRegistry, ModelHook

    module = torch.nn.Linear(2, 2)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(ModelHook(), "probe")
    assert vars(module)["_diffusers_hook"] is registry
    assert list(registry.hooks) == ["probe"] and registry._hook_order == ["probe"] and len(registry._fn_refs) == 1


def test_cache_context_internals():
    """diffusers_sp.cfg_parallel pairs the conditional and unconditional calls by the names the
    pipelines give through ``cache_context``, read from hooks.StateManager and _set_cache_context."""
    from diffusers.hooks.hooks import StateManager, _set_cache_context

    assert callable(_set_cache_context)
    assert {"set_context", "get_state", "reset"} <= set(dir(StateManager))


def test_dispatch_attention_fn_is_a_module_global_of_the_processors():
    """Dispatch mode (processors/base.py, capture.py) replaces the global ``dispatch_attention_fn`` of a
    processor's ``__call__``, and marks the calls to split with ``_parallel_config``."""
    from diffusers.models.transformers import transformer_flux, transformer_wan

    for processor in (transformer_wan.WanAttnProcessor, transformer_flux.FluxAttnProcessor):
        assert "dispatch_attention_fn" in processor.__call__.__globals__, processor.__name__
        assert "_parallel_config" in vars(processor) or hasattr(processor(), "_parallel_config"), processor.__name__
        assert hasattr(processor(), "_attention_backend"), processor.__name__


def test_cache_hook_classes_and_modules():
    """caches.py recognises Diffusers' cache hooks by class and by the diffusers.hooks module they come
    from."""
    from diffusers.hooks.faster_cache import FasterCacheBlockHook, FasterCacheDenoiserHook
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from diffusers.hooks.mag_cache import MagCacheBlockHook
    from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastHook
    from diffusers.hooks.sea_cache import SeaCacheLeaderBlockHook, SeaCacheRootHook

    for cls in (FasterCacheBlockHook, FasterCacheDenoiserHook, FBCHeadBlockHook, MagCacheBlockHook,
                PyramidAttentionBroadcastHook, SeaCacheLeaderBlockHook, SeaCacheRootHook):
        assert cls.__module__.startswith("diffusers.hooks."), cls
