"""Bria FIBO: BriaFiboTransformer2DModel (Flux's joint attention, text first, a full-sequence key padding
mask when a prompt is padded; one text-encoder layer mixed into the text per block)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, flux_ids, gen, image

#: The tiny SmolLM3's width; the pipelines join its last two layers (2 x 16) into the prompt embedding.
_TEXT = 16


def _transformer(in_channels: int = 64, seed: int = 0):
    """A ``BriaFiboTransformer2DModel``: 3 heads of 16 (uneven over 2 ranks), one dual- and one single-stream
    block (two text layers mixed in), 64 input channels (the Wan VAE's 16 latent channels packed 2 x 2; the
    edit pipeline packs none: 16)."""
    from diffusers import BriaFiboTransformer2DModel

    torch.manual_seed(seed)
    return BriaFiboTransformer2DModel(patch_size=1, in_channels=in_channels, num_layers=1, num_single_layers=1,
                                      attention_head_dim=16, num_attention_heads=3, joint_attention_dim=2 * _TEXT,
                                      axes_dims_rope=[4, 4, 8], text_encoder_dim=_TEXT).eval()


def _forward():
    """5 x 7 image tokens; two prompts of 7 text tokens, the second padded after 4: the pipeline's key padding
    mask ``[B, 1, 1, T + S]`` over the full sequence."""
    g = gen()
    text = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    mask = torch.cat([text, torch.ones(2, 35, dtype=torch.bool)], dim=1)[:, None, None, :]
    return _transformer(), dict(
        hidden_states=torch.randn(2, 35, 64, generator=g), encoder_hidden_states=torch.randn(2, 7, 2 * _TEXT, generator=g),
        text_encoder_layers=[torch.randn(2, 7, _TEXT, generator=g) for _ in range(2)], timestep=torch.tensor([0.5, 0.25]),
        img_ids=flux_ids(), txt_ids=torch.zeros(7, 3), joint_attention_kwargs={"attention_mask": mask})


FORWARDS = {"ragged_prompts": _forward}


def _build(cls_name: str, in_channels: int = 64):
    """``() -> pipeline``: a one-layer SmolLM3 (two hidden states: the two text layers the blocks take) over the
    tiny word tokenizer, the tiny Wan VAE (8 x down, 16 channels)."""
    def build():
        import diffusers
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        torch.manual_seed(0)
        encoder = SmolLM3ForCausalLM(SmolLM3Config(hidden_size=_TEXT, intermediate_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                                   pad_token_id=0)).eval()
        return getattr(diffusers, cls_name)(transformer=_transformer(in_channels), text_encoder=encoder, tokenizer=tm.tiny_tokenizer(),
                                            vae=tm.tiny_wan_vae(), scheduler=tm._flow_scheduler())
    return build


_CFG = dict(guidance_scale=4.0, negative_prompt=["rain", "snow at night over the city"])

PIPELINES = {
    # 80 x 112 pixels: 10 x 14 latents, packed 2 x 2 into 5 x 7 tokens; CFG folded into the batch.
    "BriaFiboPipeline": Pipe(_build("BriaFiboPipeline"), lambda: dict(height=80, width=112, **_CFG)),
    # Edit prompts are JSON with an "edit_instruction"; the latents are not packed and the pipeline rounds the
    # output size down to multiples of 32 pixels (5 x 7 = 35 tokens), while the reference image keeps its
    # 10 x 14 = 140: 175 tokens joined.
    "BriaFiboEditPipeline": Pipe(_build("BriaFiboEditPipeline", in_channels=16), lambda: dict(
        prompt=['{"edit_instruction": "a cat runs on the grass"}', '{"edit_instruction": "a dog"}'],
        image=image(112, 80), height=80, width=112, **_CFG), tokens=175),
}
