"""aMUSEd: UVit2DModel (convolutional blocks around transformer layers over VQ token ids; CLIP text in
cross-attention)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, image, mask_image

#: Codebook of the tiny VQ model; the transformer's vocabulary adds the mask token.
_CODEBOOK = 16


def _transformer(seed: int = 0):
    """A ``UVit2DModel``: 3 heads of 8 (uneven over 2 ranks) in two transformer layers, one residual block
    in each convolutional block, a codebook of 16 (+ the mask token), CLIP text width 32."""
    from diffusers import UVit2DModel

    torch.manual_seed(seed)
    return UVit2DModel(hidden_size=24, cond_embed_dim=32, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
                       encoder_hidden_size=32, vocab_size=_CODEBOOK + 1, codebook_size=_CODEBOOK, in_channels=8,
                       block_out_channels=8, num_res_blocks=1, block_num_heads=1, num_hidden_layers=2,
                       num_attention_heads=3, intermediate_size=32, sample_size=5).eval()


def _forward():
    """A 5 x 7 grid of token ids: 35 tokens; two prompts of 7 text tokens."""
    g = gen()
    return _transformer(), dict(input_ids=torch.randint(0, _CODEBOOK, (2, 5, 7), generator=g),
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                                pooled_text_emb=torch.randn(2, 32, generator=g), micro_conds=torch.randn(2, 5, generator=g))


FORWARDS = {"": _forward}


def _build(cls_name: str):
    """``() -> pipeline``: the tiny CLIP with a projection of 32 over the word tokenizer, a one-block ``VQModel``
    (no downsampling, a codebook of 16), the aMUSEd scheduler (mask token 16)."""
    def build():
        import diffusers
        from diffusers import AmusedScheduler, VQModel

        torch.manual_seed(0)
        vqvae = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=2, num_vq_embeddings=_CODEBOOK, vq_embed_dim=4).eval()
        return getattr(diffusers, cls_name)(transformer=_transformer(), vqvae=vqvae, tokenizer=tm.tiny_tokenizer(16),
                                            text_encoder=tm.tiny_clip_text_encoder(projection_dim=32),
                                            scheduler=AmusedScheduler(mask_token_id=_CODEBOOK))
    return build


_CFG = dict(guidance_scale=4.0, negative_prompt=["rain", "snow at night over the city"])
_ONE = dict(prompt="a cat runs on the grass", guidance_scale=4.0, negative_prompt="rain")

PIPELINES = {
    # 5 x 7 pixels through the no-downsampling VQ model: 35 tokens; CFG folded into the batch.
    "AmusedPipeline": Pipe(_build("AmusedPipeline"), lambda: dict(height=5, width=7, **_CFG)),
    # One prompt for the one input image (its tokens are not repeated per prompt).
    "AmusedImg2ImgPipeline": Pipe(_build("AmusedImg2ImgPipeline"), lambda: dict(image=image(7, 5), strength=0.9, **_ONE)),
    "AmusedInpaintPipeline": Pipe(_build("AmusedInpaintPipeline"), lambda: dict(
        image=image(7, 5), mask_image=mask_image(7, 5), **_ONE)),
}
