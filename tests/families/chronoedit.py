"""ChronoEdit: ChronoEditTransformer3DModel (Wan-like: text and CLIP image tokens in cross-attention).
No family module: it runs through its Diffusers ``_cp_plan`` (diffusers_sp.pipelines.cp_plan)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, image, randomize_norms


def tiny_transformer(seed: int = 0, **overrides):
    """A ``ChronoEditTransformer3DModel``: 3 heads of 12, two blocks, patch (1, 2, 2); with ``image_dim``
    and ``added_kv_proj_dim`` it takes CLIP image tokens in its cross-attention (the processor reads
    the last 512 context tokens as text)."""
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=36, out_channels=16,
               text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32, image_dim=4,
               added_kv_proj_dim=36)
    cfg.update(overrides)
    return randomize_norms(ChronoEditTransformer3DModel(**cfg).eval())


def _forward():
    """5 frames of 2 x 14 latents: 5 x 1 x 7 = 35 tokens; 512 text tokens after 17 image tokens."""
    g = gen()
    return tiny_transformer(), dict(
        hidden_states=torch.randn(2, 36, 5, 2, 14, generator=g), timestep=torch.tensor([500, 250]),
        encoder_hidden_states=torch.randn(2, 512, 32, generator=g),
        encoder_hidden_states_image=torch.randn(2, 17, 4, generator=g))


FORWARDS = {"image_context": _forward}


def tiny_chronoedit_pipeline(seed: int = 0):
    """``ChronoEditPipeline`` (UMT5, CLIP vision, Wan VAE)."""
    from diffusers import ChronoEditPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8)).eval()
    return ChronoEditPipeline(tokenizer=tm.tiny_tokenizer(), text_encoder=tm.tiny_umt5_encoder(seed=seed),
                              image_encoder=image_encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32),
                              transformer=tiny_transformer(seed), vae=tm.tiny_wan_vae(seed),
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


PIPELINES = {
    # Temporal reasoning over 17 frames (5 latent frames) for both steps; 16 x 112 pixels: 5 x 1 x 7 tokens.
    "ChronoEditPipeline": Pipe(tiny_chronoedit_pipeline, lambda: dict(
        image=image(112, 16), height=16, width=112, num_frames=17, enable_temporal_reasoning=True,
        num_temporal_reasoning_steps=2)),
}
