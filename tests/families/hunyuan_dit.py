"""HunyuanDiT: HunyuanDiT2DModel (image-only self-attention with 2-D RoPE from the pipeline, BERT and mT5
text in cross-attention, long skips; PAG and ControlNet pipelines)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Pipe, gen, kl_vae, ragged_mask

#: The text lengths HunyuanDiT's pipelines pad to (BERT 77, mT5 256); the model's padding embedding has that many rows.
_TEXT = dict(text_len=77, text_len_t5=256)
_CONFIG = dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, patch_size=2, hidden_size=24,
               cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16, sample_size=32, **_TEXT)


def _transformer(seed: int = 0):
    """A ``HunyuanDiT2DModel``: 3 heads of 8 (uneven over 2 ranks), 4 blocks (one long skip), patch 2, 4
    latent channels (8 out: learned sigma), text width 32 (the tiny BERT's and T5's)."""
    from diffusers import HunyuanDiT2DModel

    torch.manual_seed(seed)
    return families.randomize_norms(HunyuanDiT2DModel(num_layers=4, **_CONFIG).eval())


def _inputs(g):
    """10 x 14 latents at patch 2 (5 x 7 tokens), the RoPE tables over them, two prompts ragged in both texts."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    rope = get_2d_rotary_pos_embed(8, ((0, 0), (5, 7)), (5, 7))
    return dict(hidden_states=torch.randn(2, 4, 10, 14, generator=g), timestep=torch.tensor([500.0, 250.0]),
                encoder_hidden_states=torch.randn(2, 77, 32, generator=g), text_embedding_mask=ragged_mask([77, 9], 77),
                encoder_hidden_states_t5=torch.randn(2, 256, 32, generator=g),
                text_embedding_mask_t5=ragged_mask([256, 5], 256), image_meta_size=torch.tensor([[40, 56, 40, 56, 0, 0]] * 2),
                style=torch.tensor([0, 0]), image_rotary_emb=rope)


FORWARDS = {"ragged_prompts": lambda: (_transformer(), _inputs(gen()))}


def _controlnet():
    """A ``HunyuanDiT2DControlNetModel`` over the transformer's 4 blocks (one residual per skip)."""
    from diffusers import HunyuanDiT2DControlNetModel

    torch.manual_seed(1)
    return HunyuanDiT2DControlNetModel(transformer_num_layers=4, **_CONFIG).eval()


def _build(cls_name: str, **extra):
    """``() -> pipeline``: a one-layer BERT and the tiny T5 over the tiny word tokenizer, an 8 x VAE (the
    pipelines size the RoPE grid for one), and the pipeline's ``extra`` components. DPM-Solver instead of the
    pipelines' DDPM, whose first step divides the noise prediction by sqrt(alpha_bar) ~ 0.006 and so lifts
    float32 rounding (1e-7) to the tests' tolerance."""
    def build():
        import diffusers
        from diffusers import DPMSolverMultistepScheduler
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                    vocab_size=64), add_pooling_layer=False).eval()
        return getattr(diffusers, cls_name)(
            transformer=_transformer(), vae=kl_vae(4, 4), text_encoder=bert, tokenizer=tm.tiny_tokenizer(),
            text_encoder_2=tm.tiny_t5_encoder(), tokenizer_2=tm.tiny_tokenizer(), scheduler=DPMSolverMultistepScheduler(),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
            **{k: v() for k, v in extra.items()})
    return build


def _call(**extra):
    """80 x 112 pixels: 10 x 14 latents, 5 x 7 tokens at patch 2 (no resolution binning, which resizes to about
    1024 x 1024); CFG folded into the batch, with negative prompts."""
    return dict(height=80, width=112, use_resolution_binning=False, guidance_scale=4.0,
                negative_prompt=["rain", "snow at night over the city"], **extra)


PIPELINES = {
    "HunyuanDiTPipeline": Pipe(_build("HunyuanDiTPipeline"), _call),
    # PAG on the pipeline's default layer ("blocks.1"): CFG and the perturbed pass in one batch of 3.
    "HunyuanDiTPAGPipeline": Pipe(_build("HunyuanDiTPAGPipeline"), lambda: _call(pag_scale=3.0)),
    "HunyuanDiTControlNetPipeline": Pipe(_build("HunyuanDiTControlNetPipeline", controlnet=_controlnet),
                                         lambda: _call(control_image=families.image(112, 80))),
}
