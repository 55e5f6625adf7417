"""Flux.2: Flux2Transformer2DModel (joint attention, text first, no text mask; reference images joined
to the image tokens). Flux2Pipeline's text encoder is a Mistral3ForConditionalGeneration, Klein's a
Qwen3ForCausalLM; both tiny, with a word-level tokenizer whose chat template keeps the text only (the
real processors need downloads or torchvision)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Modular, Pipe, Refusal, gen, image, mask_image, randomize_norms

# Chat messages -> their text: string contents, or the text items of a list of content items.
_CHAT = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
         "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}"
         "{% endif %}{% endfor %}")


def tiny_transformer(seed: int = 0, **overrides):
    """A ``Flux2Transformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one single-stream block."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
               num_attention_heads=3, joint_attention_dim=16, timestep_guidance_channels=32, mlp_ratio=2.0,
               axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    cfg.update(overrides)
    return randomize_norms(Flux2Transformer2DModel(**cfg).eval())


def _tokenizer():
    tok = tm.tiny_tokenizer()
    tok.chat_template = _CHAT
    return tok


def _vae(seed: int = 0):
    """An ``AutoencoderKLFlux2`` of four one-layer blocks (8x down, 1 latent channel, patchified 2 x 2 to 4)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    return AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                              up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(4,) * 4, layers_per_block=1,
                              latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False).eval()


def _mistral3(seed: int = 0):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=64, hidden_size=16, intermediate_size=32,
                         max_position_embeddings=64, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                         sliding_window=None, pad_token_id=0),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=16, image_size=32, patch_size=8),
        image_token_index=63, pad_token_id=0)).eval()


def _qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                       max_position_embeddings=64)).eval()


def tiny_flux2_pipeline(seed: int = 0):
    """``Flux2Pipeline`` (Mistral3): 80 x 112 pixels give 5 x 7 image tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(seed), text_encoder=_mistral3(seed),
                         tokenizer=_tokenizer(), transformer=tiny_transformer(seed))


def tiny_klein_pipeline(cls: str = "Flux2KleinPipeline", seed: int = 0):
    """A Klein pipeline (``cls``: Klein, Klein inpainting or Klein KV; Qwen3): 80 x 112 pixels give 5 x 7 tokens."""
    import diffusers

    return getattr(diffusers, cls)(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=_vae(seed),
                                   text_encoder=_qwen3(seed), tokenizer=_tokenizer(),
                                   transformer=tiny_transformer(seed, guidance_embeds=False))


def _ids(batch: int = 2, height: int = 5, width: int = 7, t: int = 0):
    """Flux.2 position ids ``[B, H * W, 4]`` (t, h, w, l), as the pipelines make them."""
    ids = torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width), torch.arange(1))
    return ids[None].expand(batch, -1, -1)


def _forward():
    g = gen()
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(8))
    return tiny_transformer(), dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
        timestep=torch.tensor([0.5, 0.25]), guidance=torch.tensor([3.5, 3.5]), img_ids=_ids(),
        txt_ids=txt[None].expand(2, -1, -1))


def _forward_reference_2d_ids():
    """A reference image's 15 tokens (t = 10) after the 20 generated ones, with ``[S, 4]`` ids (the
    forward takes them as well as ``[B, S, 4]``)."""
    g = gen()
    ids = torch.cat([_ids(1, 4, 5)[0], _ids(1, 3, 5, t=10)[0]])
    return tiny_transformer(guidance_embeds=False), dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
        timestep=torch.tensor([0.5, 0.25]), img_ids=ids, txt_ids=torch.zeros(6, 4))


FORWARDS = {"": _forward, "reference_2d_ids": _forward_reference_2d_ids}

# Every call: 8 text tokens (the prompts padded to max_sequence_length), the text encoder's hidden state 1.
_TEXT = dict(max_sequence_length=8, text_encoder_out_layers=(1,))

PIPELINES = {
    # A 64 x 80 reference image (the smallest side Flux.2 takes is 64): 4 x 5 tokens after the 35 generated ones.
    "Flux2Pipeline": Pipe(tiny_flux2_pipeline, lambda: dict(height=80, width=112, guidance_scale=3.5,
                                                            image=image(80, 64), **_TEXT), tokens=55),
    # Klein runs CFG as two calls (guidance_scale 4 by default).
    "Flux2KleinPipeline": Pipe(tiny_klein_pipeline, lambda: dict(height=80, width=112, image=image(80, 64), **_TEXT),
                               tokens=55),
    # The source image's 35 tokens join the 35 generated ones, then a 16 x 48 reference image's 1 x 3.
    "Flux2KleinInpaintPipeline": Pipe(
        lambda: tiny_klein_pipeline("Flux2KleinInpaintPipeline"),
        lambda: dict(height=80, width=112, image=image(112, 80), mask_image=mask_image(112, 80),
                     image_reference=image(48, 16), strength=1.0, **_TEXT), tokens=73),
    # Without reference images the K/V pipeline makes ordinary calls (refused with them: REFUSALS).
    "Flux2KleinKVPipeline": Pipe(lambda: tiny_klein_pipeline("Flux2KleinKVPipeline"),
                                 lambda: dict(height=80, width=112, **_TEXT)),
}

REFUSALS = {
    "Flux2KleinKVPipeline": Refusal(lambda: tiny_klein_pipeline("Flux2KleinKVPipeline"),
                                    lambda: dict(height=80, width=112, image=image(80, 64), **_TEXT),
                                    match="Flux2KleinKVPipeline: Flux2Transformer2DModel was called with 'kv_cache_mode'"),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "Flux2ModularPipeline": Modular("Flux2Pipeline"),
    "Flux2KleinModularPipeline": Modular("Flux2KleinPipeline"),
    "Flux2KleinBaseModularPipeline": Modular("Flux2KleinPipeline"),
}
