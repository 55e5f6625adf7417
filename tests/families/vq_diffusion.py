"""VQ-Diffusion: Transformer2DModel with token-id inputs (image-only self-attention, CLIP text in
cross-attention)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen

#: Codebook of the tiny VQ model; the transformer's classes add the mask token.
_CODEBOOK = 16


def _transformer(seed: int = 0):
    """A ``Transformer2DModel`` over a 5 x 5 grid of token ids (the class takes square grids) of a codebook of 16
    (+ the mask class): 3 heads of 8 (uneven over 2 ranks), two layers, CLIP text width 32, 4 diffusion steps."""
    from diffusers import Transformer2DModel

    torch.manual_seed(seed)
    return Transformer2DModel(num_attention_heads=3, attention_head_dim=8, num_vector_embeds=_CODEBOOK + 1,
                              sample_size=5, num_layers=2, cross_attention_dim=32, norm_num_groups=1,
                              num_embeds_ada_norm=4, activation_fn="geglu-approximate").eval()


def _forward():
    """A 5 x 5 grid of token ids: 25 tokens; two prompts of 7 text tokens; one timestep (as the pipeline passes it)."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randint(0, _CODEBOOK + 1, (2, 25), generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor(3))


FORWARDS = {"": Forward(_forward, tokens=25)}


def _pipeline():
    """A tiny ``VQDiffusionPipeline``: the tiny CLIP over the word tokenizer, a one-block ``VQModel`` (no
    downsampling, a codebook of 16), the VQ-Diffusion scheduler over 4 steps, fixed (not learned) CFG embeddings."""
    from diffusers import VQDiffusionPipeline, VQDiffusionScheduler, VQModel
    from diffusers.pipelines.deprecated.vq_diffusion.pipeline_vq_diffusion import LearnedClassifierFreeSamplingEmbeddings

    torch.manual_seed(0)
    vqvae = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                    up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1, latent_channels=4,
                    norm_num_groups=2, num_vq_embeddings=_CODEBOOK, vq_embed_dim=4).eval()
    return VQDiffusionPipeline(vqvae=vqvae, text_encoder=tm.tiny_clip_text_encoder(), tokenizer=tm.tiny_tokenizer(16),
                               transformer=_transformer(), scheduler=VQDiffusionScheduler(_CODEBOOK + 1, 4),
                               learned_classifier_free_sampling_embeddings=LearnedClassifierFreeSamplingEmbeddings(False))


PIPELINES = {
    # The transformer's 5 x 5 grid: 25 tokens; CFG folded into the batch (guidance_scale > 1).
    "VQDiffusionPipeline": Pipe(_pipeline, lambda: dict(guidance_scale=4.0, output_type="np"), tokens=25),
}
