"""Ovis-Image: OvisImageTransformer2DModel (Flux's joint attention, text first, no text mask, Qwen3 text)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, flux_ids, gen


def _transformer(seed: int = 0):
    """An ``OvisImageTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one
    single-stream block, in_channels 4 (one latent channel packed 2 x 2)."""
    from diffusers import OvisImageTransformer2DModel

    torch.manual_seed(seed)
    return OvisImageTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=3, joint_attention_dim=32,
                                       axes_dims_rope=(4, 4, 8)).eval()


def _forward():
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 35, 4, generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                                timestep=torch.tensor([0.5, 0.25]), img_ids=flux_ids(), txt_ids=torch.zeros(7, 3))


FORWARDS = {"": _forward}


def _pipeline():
    """A tiny ``OvisImagePipeline``: a one-layer Qwen3 text encoder over the tiny word tokenizer (with a chat
    template that joins the messages), the no-downsampling one-channel VAE: 10 x 14 pixels give 5 x 7 tokens."""
    from diffusers import OvisImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    encoder = Qwen3Model(Qwen3Config(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, head_dim=16, vocab_size=64)).eval()
    tokenizer = tm.tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return OvisImagePipeline(transformer=_transformer(), text_encoder=encoder, tokenizer=tokenizer,
                             vae=tm._tiny_kl_vae(1, 0), scheduler=tm._flow_scheduler())


PIPELINES = {
    # CFG as two calls (guidance_scale > 1), with negative prompts.
    "OvisImagePipeline": Pipe(_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8, guidance_scale=4.0,
                                                      negative_prompt=["rain", "snow at night over the city"])),
}
