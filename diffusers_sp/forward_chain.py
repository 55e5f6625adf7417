"""A Diffusers ``ModelHook`` placed innermost in a module's ``forward`` chain, and taken out of it again.

A module's ``forward`` can be wrapped by two mechanisms, in any order and any number of times:

* Diffusers' ``HookRegistry.register_hook`` (caches, group offloading, layerwise casting, CFG
  parallelism's hook): the registry keeps one ``HookFunctionReference`` per hook, whose
  ``forward`` (or, for a hook with ``new_forward``, ``original_forward``) is the callable it wraps,
  and sets ``module.forward`` to a new callable that runs the hook;
* Accelerate's ``add_hook_to_module`` (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``):
  ``module._old_forward`` keeps the callable it wraps and ``module.forward`` becomes its wrapper.
  ``remove_hook_from_module`` (which ``enable_model_cpu_offload`` runs again after every pipeline
  call) sets ``module.forward = module._old_forward``, dropping whatever was registered above it.

:func:`register_innermost` registers a hook directly around the module's own ``forward``, below
every Diffusers hook and below Accelerate's wrapper: Accelerate's re-wrapping never drops it, and
hooks registered before it (a cache's hook on the model) still run outside it. :func:`unregister`
takes a hook out wherever it sits, rewiring whatever referred to it (the next Diffusers hook,
Accelerate's ``_old_forward`` or ``module.forward``) to what it wrapped. Diffusers' own
``remove_hook`` assumes nothing else wraps the module and, for a hook below one with
``new_forward``, rewires that hook's ``forward`` instead of its ``original_forward``, which drops
the outer hook's own function from the chain.

These read the registry's private lists (``_hook_order``, ``_fn_refs``), as in Diffusers 0.42.1.
"""

from __future__ import annotations

import functools

import torch
from diffusers.hooks import HookRegistry, ModelHook

_MISSING = object()


def _input(fn_ref) -> object:
    """The callable a registry entry wraps."""
    return fn_ref.original_forward if fn_ref.original_forward is not None else fn_ref.forward


def _set_input(fn_ref, value) -> None:
    if fn_ref.original_forward is not None:
        fn_ref.original_forward = value
    else:
        fn_ref.forward = value


def _is_accelerate_wrapper(module: torch.nn.Module, value) -> bool:
    """Whether ``value`` is the wrapper Accelerate's ``add_hook_to_module`` made for ``module``."""
    func = getattr(value, "func", None)
    return (isinstance(value, functools.partial) and "_old_forward" in vars(module)
            and getattr(func, "__module__", "").startswith("accelerate"))


def register_innermost(module: torch.nn.Module, hook: ModelHook, name: str):
    """Registers ``hook`` as ``name`` in ``module``'s Diffusers ``HookRegistry``, directly around the
    module's own ``forward`` (see the module docstring).

    Returns:
        The callable that runs the hook (what the next layer of the chain now calls); pass it to
        :func:`unregister`.

    Raises:
        ValueError: from Diffusers, when the registry already has a hook named ``name``.
    """
    registry = HookRegistry.check_if_exists_or_initialize(module)
    own = vars(module)
    # The slot holding the innermost callable: the first registry entry's input, unless that is
    # Accelerate's wrapper (Accelerate came first); Accelerate's _old_forward; else module.forward.
    if registry._fn_refs and not _is_accelerate_wrapper(module, _input(registry._fn_refs[0])):
        fn_ref0 = registry._fn_refs[0]
        base, put = _input(fn_ref0), functools.partial(_set_input, fn_ref0)
    elif "_old_forward" in own:
        base, put = own["_old_forward"], functools.partial(setattr, module, "_old_forward")
    else:
        base, put = module.forward, functools.partial(setattr, module, "forward")
    top = own.get("forward", _MISSING)
    module.forward = base  # Diffusers wraps whatever module.forward is
    try:
        registry.register_hook(hook, name)
    finally:
        wrapped = module.forward
        if top is _MISSING:
            own.pop("forward", None)
        else:
            module.forward = top
    put(wrapped)
    # The new entry is innermost: first in the registry's order.
    registry._hook_order.insert(0, registry._hook_order.pop())
    registry._fn_refs.insert(0, registry._fn_refs.pop())
    return wrapped


def unregister(module: torch.nn.Module, name: str, wrapped) -> None:
    """Takes the hook registered as ``name`` (whose wrapper is ``wrapped``, from
    :func:`register_innermost`) out of ``module``'s forward chain wherever it now sits, and out of
    the registry. A no-op when the registry has no such hook."""
    registry = vars(module).get("_diffusers_hook")
    if registry is None or name not in registry.hooks:
        return
    index = registry._hook_order.index(name)
    inner = _input(registry._fn_refs[index])
    own = vars(module)
    for j, fn_ref in enumerate(registry._fn_refs):
        if j != index and _input(fn_ref) is wrapped:
            _set_input(fn_ref, inner)
            break
    else:
        if own.get("_old_forward") is wrapped:
            module._old_forward = inner
        elif own.get("forward") is wrapped:
            module.forward = inner
    hook = registry.hooks.pop(name)
    registry._hook_order.pop(index)
    registry._fn_refs.pop(index)
    hook.deinitalize_hook(module)
