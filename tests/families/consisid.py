"""ConsisID: ConsisIDTransformer3DModel (CogVideoX with a face branch: text first in joint attention, no
text mask; perceiver cross-attention from the video tokens to 4 face tokens after every block)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Pipe, draw_zero_weights, gen, image

#: The face branch: a 2-layer local facial extractor over an 8-wide face embedding and 2 face-ViT scales of 8
#: channels (the released model reads five), making 4 face tokens of 53 channels: Diffusers sizes the
#: cross-attention's keys as int(2/3 x the model width), 80 here. A 2-head perceiver cross-attention reads
#: them after every block.
_FACE = dict(is_train_face=True, cross_attn_interval=1, cross_attn_dim_head=8, cross_attn_num_heads=2, LFE_id_dim=8,
             LFE_vit_dim=8, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2, LFE_num_querie=4,
             LFE_output_dim=53, LFE_ff_mult=1, LFE_num_scale=2)


def _transformer(seed: int = 0, **overrides):
    """A ``ConsisIDTransformer3DModel`` of the tiny CogVideoX size (5 heads of 16, 2 blocks, patch 2), its
    input the 4 latent channels and the 4 image-latent channels, RoPE as CogVideoX 5b."""
    from diffusers import ConsisIDTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(num_attention_heads=5, attention_head_dim=16, in_channels=8, out_channels=4, time_embed_dim=2,
               text_embed_dim=32, num_layers=2, sample_width=14, sample_height=10, sample_frames=1, patch_size=2,
               temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True, **_FACE)
    cfg.update(overrides)
    return draw_zero_weights(ConsisIDTransformer3DModel(**cfg).eval())


def _face(batch: int, g):
    """``id_cond`` [B, 8] and ``id_vit_hidden`` (2 x [B, 6, 8]): what the pipeline's face models make."""
    return dict(id_cond=torch.randn(batch, 8, generator=g),
                id_vit_hidden=[torch.randn(batch, 6, 8, generator=g) for _ in range(2)])


def _forward():
    """One latent frame of 10 x 14 (35 tokens at patch 2) after 8 text tokens; RoPE tables for the 35."""
    g = gen()
    rope = (torch.randn(35, 16, generator=g), torch.randn(35, 16, generator=g))
    return _transformer(), dict(hidden_states=torch.randn(2, 1, 8, 10, 14, generator=g),
                                encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([500, 250]),
                                image_rotary_emb=rope, **_face(2, g))


FORWARDS = {"": _forward}


def _pipeline():
    """``ConsisIDPipeline`` with the tiny CogVideoX components (8x spatial / 4x temporal VAE, 4 latent
    channels: 80 x 112 pixels are 5 x 7 tokens per latent frame) and :func:`_transformer`."""
    from diffusers import CogVideoXDPMScheduler, ConsisIDPipeline

    parts = tm.tiny_cogvideox_pipeline().components
    parts.update(transformer=_transformer(), scheduler=CogVideoXDPMScheduler())
    return ConsisIDPipeline(**parts)


# The face embeddings come from the user's face models (Diffusers' consisid_utils: insightface and a face
# ViT); the pipeline takes them as tensors. One face image per prompt and a batch of one: the pipeline
# passes the face embeddings whole to both CFG halves. 5 frames are 2 latent frames: 70 tokens.
PIPELINES = {
    "ConsisIDPipeline": Pipe(_pipeline, lambda: dict(
        prompt=families.PROMPTS[0], image=image(112, 80), height=80, width=112, num_frames=5, max_sequence_length=8,
        guidance_scale=6.0, **_face(1, gen(2))), tokens=70),
}
