"""Cases run on every rank by tests/test_wan_parallel.py (see tests/distributed.py).

Sizes are chosen so that the token count divides none of the world sizes 2, 3, 4: latents of
5 x 10 x 14 (frames x height x width) give 5 * 5 * 7 = 175 tokens after the (1, 2, 2) patchify;
pipelines run at 17 frames, 80 x 112 pixels, which is the same latent.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from diffusers_sp import disable_sequence_parallel, enable_sequence_parallel
from diffusers_sp.tiny_models import tiny_wan_pipeline, tiny_wan_transformer

from distributed import compare, error_of

MODES = ("ulysses", "kv_gather")
TOKENS = 5 * 5 * 7
CALL = dict(height=80, width=112, num_frames=17, guidance_scale=5.0)


def _inputs(batch: int = 2, per_token_timestep: bool = False, in_channels: int = 16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, in_channels, 5, 10, 14, generator=g)
    t = (torch.randint(0, 1000, (batch, TOKENS), generator=g) if per_token_timestep
         else torch.tensor([500.0, 250.0][:batch]))
    return x, t, torch.randn(batch, 12, 32, generator=g)


def _count_kv_first(model) -> list:
    """Counts, per call, the self-attention calls that took the family's K/V-first path."""
    calls = []
    for block in model.blocks:
        proc = block.attn1.processor
        if getattr(proc, "kv_first", None) is not None:
            finish = proc._finish_kv
            proc._finish_kv = lambda *a, _f=finish, **k: (calls.append(1), _f(*a, **k))[1]
    return calls


def _forward_all_modes(model, kwargs) -> dict:
    with torch.no_grad():
        ref = model(**kwargs).sample
        results = {}
        for mode in MODES:
            handle = enable_sequence_parallel(model, mode=mode)
            calls = _count_kv_first(model)
            results[mode] = compare(ref, model(**kwargs).sample)
            results[mode]["resolved"] = handle.mode
            results[mode]["kv_first_calls"] = len(calls)
            handle.disable()
        # Without the K/V-first reordering: the model's processor with its attention call taken
        # over; both paths run the same operations, so they agree bit for bit.
        for mode in MODES:
            handle = enable_sequence_parallel(model, mode=mode, overlap_query_projection=False)
            calls = _count_kv_first(model)
            out = model(**kwargs).sample
            handle.disable()
            handle = enable_sequence_parallel(model, mode=mode)
            results[f"kv_first_vs_generic {mode}"] = compare(out, model(**kwargs).sample)
            results[f"kv_first_vs_generic {mode}"]["generic_kv_first_calls"] = len(calls)
            handle.disable()
        results["restored_bitwise"] = torch.equal(model(**kwargs).sample, ref)
    return results


def case_transformer_t2v():
    x, t, e = _inputs()
    return _forward_all_modes(tiny_wan_transformer(), dict(hidden_states=x, timestep=t, encoder_hidden_states=e))


def case_transformer_uneven_heads():
    # 5 heads divide none of 2, 3, 4: Ulysses splits them unevenly.
    x, t, e = _inputs()
    model = tiny_wan_transformer(num_attention_heads=5)
    return _forward_all_modes(model, dict(hidden_states=x, timestep=t, encoder_hidden_states=e))


def case_transformer_ti2v_per_token_timesteps():
    x, t, e = _inputs(per_token_timestep=True)
    return _forward_all_modes(tiny_wan_transformer(), dict(hidden_states=x, timestep=t, encoder_hidden_states=e))


def case_transformer_i2v_image_context():
    g = torch.Generator().manual_seed(2)
    x, t, _ = _inputs(in_channels=36)
    # Wan's I2V processor assumes 512 text tokens after the image tokens.
    e = torch.randn(2, 512, 32, generator=g)
    img = torch.randn(2, 9, 4, generator=g)
    model = tiny_wan_transformer(in_channels=36, image_dim=4)
    return _forward_all_modes(model, dict(hidden_states=x, timestep=t, encoder_hidden_states=e,
                                          encoder_hidden_states_image=img))


@functools.lru_cache(maxsize=None)
def _pipe(kind: str):
    return tiny_wan_pipeline(kind)


def _pipeline_all_modes(kind: str, output_type: str = "latent", modes=MODES, **extra) -> dict:
    pipe = _pipe(kind)
    call = dict(CALL, prompt="a cat runs on the grass", negative_prompt="rain", num_inference_steps=3,
                output_type=output_type, **extra)
    ref = torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
    results = {}
    for mode in modes:
        handle = enable_sequence_parallel(pipe, mode=mode)
        out = torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).frames)
        results[mode] = compare(ref, out)
        results[mode]["transformers"] = len(handle._models)
        disable_sequence_parallel(pipe)
    return results


def case_pipeline_t2v_latent():
    return _pipeline_all_modes("t2v")


def case_pipeline_t2v_decoded():
    return _pipeline_all_modes("t2v", output_type="np", modes=("kv_gather",))


def case_pipeline_i2v():
    from PIL import Image

    image = Image.fromarray((torch.rand(80, 112, 3, generator=torch.Generator().manual_seed(3)) * 255)
                            .to(torch.uint8).numpy())
    return _pipeline_all_modes("i2v", image=image)


def case_pipeline_wan22_two_transformers():
    return _pipeline_all_modes("t2v_moe")


def case_pipeline_ti2v():
    return _pipeline_all_modes("ti2v", modes=("ulysses",))


def case_random_draws_agree():
    """Ranks whose RNGs diverged before enable still start from identical latents (no generator passed)."""
    torch.rand(dist.get_rank() + 1)  # desynchronise the global RNGs
    pipe = _pipe("t2v")
    enable_sequence_parallel(pipe, mode="kv_gather")
    try:
        latents = pipe.prepare_latents(1, 16, 80, 112, 17, torch.float32, torch.device("cpu"))
        after = torch.rand(4)  # global RNG state synchronised at enable
    finally:
        disable_sequence_parallel(pipe)
    return {"latents": latents, "after": after}


def case_error_ulysses_too_few_heads():
    model = tiny_wan_transformer(num_attention_heads=1)
    return error_of(lambda: enable_sequence_parallel(model, mode="ulysses"))


def case_error_unknown_mode():
    return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), mode="ring"))


def case_error_vsa_bad_sparsity():
    return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), mode="vsa", vsa_sparsity=1.5))


def case_error_vsa_option_with_dense_mode():
    return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), mode="kv_gather", vsa_sparsity=0.5))


def case_error_bad_overlap_query_projection():
    return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), mode="kv_gather",
                                                     overlap_query_projection="yes"))


def case_error_already_enabled():
    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="kv_gather")
    try:
        return error_of(lambda: enable_sequence_parallel(model, mode="ulysses"))
    finally:
        handle.disable()


def case_error_unsupported_model():
    from diffusers import AutoencoderKLWan

    return error_of(lambda: enable_sequence_parallel(AutoencoderKLWan(base_dim=3, z_dim=4), mode="auto"))


def case_error_bad_process_group():
    return error_of(lambda: enable_sequence_parallel(tiny_wan_transformer(), process_group="world"))


def case_error_timestep_b1():
    """A timestep of shape [B, 1] (one process broadcasts it over the tokens) cannot be split over the
    ranks; the error named only the latent. It must name the argument and its
    shape, on every rank, during the forward."""
    model = tiny_wan_transformer()
    g = torch.Generator().manual_seed(0)
    kwargs = dict(hidden_states=torch.randn(1, 16, 5, 10, 14, generator=g), timestep=torch.tensor([[500.0]]),
                  encoder_hidden_states=torch.randn(1, 7, 32, generator=g))
    handle = enable_sequence_parallel(model, mode="kv_gather")
    try:
        with torch.no_grad():
            return error_of(lambda: model(**kwargs))
    finally:
        handle.disable()


def case_transformer_grad_mode():
    """With grad mode on (no torch.no_grad, parameters requiring grad), both dense modes give one
    process's output; Ulysses failed with an in-place write into a view.
    A backward pass through the exchanges raises instead of returning wrong gradients."""
    x, t, e = _inputs()
    model = tiny_wan_transformer()
    kwargs = dict(hidden_states=x, timestep=t, encoder_hidden_states=e)
    ref = model(**kwargs).sample.detach()
    results = {}
    for mode in MODES:
        for overlap in (True, False):
            handle = enable_sequence_parallel(model, mode=mode, overlap_query_projection=overlap)
            try:
                out = model(**kwargs).sample
                results[f"{mode} overlap={overlap}"] = compare(ref, out.detach())
                try:
                    out.sum().backward()
                    results[f"{mode} overlap={overlap}"]["backward"] = "no error"
                except RuntimeError as exc:
                    results[f"{mode} overlap={overlap}"]["backward"] = str(exc)
            finally:
                handle.disable()
    return results


def _timestep_error(timestep) -> str:
    x, _, e = _inputs(batch=1)
    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="kv_gather")
    try:
        with torch.no_grad():
            return error_of(lambda: model(hidden_states=x, timestep=timestep, encoder_hidden_states=e[:1]))
    finally:
        handle.disable()


def case_error_timestep_one_token_short():
    """A per-token timestep one entry shorter than the video tokens: rank 0 got a shape error while the
    other ranks waited in a collective until the timeout."""
    return _timestep_error(torch.full((1, TOKENS - 1), 500.0))


def case_error_timestep_one_per_rank():
    """A timestep ``[1, P]`` split into ``[1, 1]`` per rank, which broadcasts: each rank ran with its
    own timestep, silently. One process raises on this input."""
    return _timestep_error(torch.linspace(900.0, 100.0, dist.get_world_size()).view(1, -1))


def case_error_attention_without_sdpa():
    """A self-attention processor that attends without F.scaled_dot_product_attention (as a processor
    does under a Diffusers attention backend set globally, when it passes no backend of its own) left
    nothing for the wrapper to take over: each rank attended to its own tokens, silently. Refused at
    the call, alike on every rank."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class ManualAttention(WanAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
            weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            return attn.to_out[1](attn.to_out[0](weights @ v))

    model = tiny_wan_transformer()
    for block in model.blocks:
        block.attn1.set_processor(ManualAttention())
    x, t, e = _inputs()
    handle = enable_sequence_parallel(model, mode="kv_gather")
    try:
        with torch.no_grad():
            return error_of(lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=e))
    finally:
        handle.disable()


def case_pipeline_scheduler_noise_after_rng_drift():
    """Ranks whose global RNGs drift apart after enable (here on purpose) still agree with one process
    when the scheduler draws noise from the global RNG in its steps (a stochastic flow-matching
    scheduler, no generator): the RNG is re-synchronised at every call (
    the ranks differed by up to 4.2 before)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = tiny_wan_pipeline("t2v")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    call = dict(CALL, prompt="a cat", negative_prompt="rain", num_inference_steps=3, output_type="latent")
    torch.manual_seed(5)
    torch.rand(1)  # what rank 0 draws below, so that the reference starts from rank 0's state
    ref = torch.as_tensor(pipe(**call).frames)
    handle = enable_sequence_parallel(pipe, mode="kv_gather")
    try:
        torch.manual_seed(5)
        torch.rand(dist.get_rank() + 1)
        return compare(ref, torch.as_tensor(pipe(**call).frames))
    finally:
        handle.disable()


def case_group_usable_after_errors():
    """After every error case, the group still works: nothing was left half-way in a collective."""
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    out = case_transformer_t2v()
    return {"sum": x.item(), "forward": out}


def case_backend_of_a_device_list_group():
    """A group made with a per-device backend list (what Accelerate's PartialState() makes on CPU) reports
    "undefined" through dist.get_backend; the handle's transport must still name gloo."""
    from diffusers_sp.groups import backend_name

    group = dist.new_group(backend="cpu:gloo")
    model = tiny_wan_transformer()
    handle = enable_sequence_parallel(model, mode="kv_gather", process_group=group)
    try:
        return {"torch_says": dist.get_backend(group), "ours": backend_name(group), "transport": handle.transport}
    finally:
        handle.disable()
