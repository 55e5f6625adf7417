"""AnyFlow: AnyFlowTransformer3DModel (Wan-style video self-attention with 3-D RoPE passed as a dict, text in
cross-attention, per-token modulation from per-frame flow-map timesteps)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen


def _transformer(seed: int = 0):
    """An ``AnyFlowTransformer3DModel``: 3 heads of 12 (uneven over 2 ranks), two blocks, patch (1, 2, 2), 16
    latent channels (the tiny Wan VAE's), text width 32 (the tiny UMT5's)."""
    from diffusers import AnyFlowTransformer3DModel

    torch.manual_seed(seed)
    return AnyFlowTransformer3DModel(num_attention_heads=3, attention_head_dim=12, in_channels=16, out_channels=16,
                                     text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32).eval()


def _forward():
    """2 frames of 10 x 14 latents at patch (1, 2, 2): 2 x 5 x 7 = 70 tokens, a timestep pair per frame (the
    first frame a clean context at 0); two prompts of 7 text tokens."""
    g = gen()
    timestep = torch.tensor([[0.0, 800.0], [0.0, 400.0]])
    return _transformer(), dict(hidden_states=torch.randn(2, 2, 16, 10, 14, generator=g), timestep=timestep,
                                r_timestep=timestep * 0.5, encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


FORWARDS = {"": Forward(_forward, tokens=70)}


def _pipeline():
    """A tiny ``AnyFlowPipeline``: the tiny Wan components (UMT5, Wan VAE: 8 x spatial, 4 x temporal down)."""
    from diffusers import AnyFlowPipeline, FlowMapEulerDiscreteScheduler

    parts = tm.tiny_wan_pipeline().components
    return AnyFlowPipeline(transformer=_transformer(), text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"],
                           vae=parts["vae"], scheduler=FlowMapEulerDiscreteScheduler())


PIPELINES = {
    # 5 frames of 80 x 112 pixels: 2 latent frames of 10 x 14, 70 tokens; CFG folded into the batch.
    "AnyFlowPipeline": Pipe(_pipeline, lambda: dict(height=80, width=112, num_frames=5, max_sequence_length=8,
                                                    guidance_scale=4.0,
                                                    negative_prompt=["rain", "snow at night over the city"]), tokens=70),
}
