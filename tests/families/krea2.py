"""Krea 2: Krea2Transformer2DModel (one [text; image] sequence, text first, with the text's key padding mask;
text fused from several encoder layers; grouped-query attention)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, qwen3_vl_config, ragged_mask

#: Text width and the encoder layers the pipeline taps: the tiny Qwen3-VL's two layers.
_TEXT_DIM, _TAPS = 16, (1, 2)


def _transformer(seed: int = 0):
    """A ``Krea2Transformer2DModel``: 3 query heads of 16 over 1 K/V head (grouped-query, uneven over 2 ranks),
    two blocks, 16 input channels (4 latent channels packed 2 x 2), a one-block text fusion over two taps."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(seed)
    return Krea2Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=3,
                                   num_key_value_heads=1, intermediate_size=32, timestep_embed_dim=16,
                                   text_hidden_dim=_TEXT_DIM, num_text_layers=len(_TAPS), text_num_attention_heads=2,
                                   text_num_key_value_heads=2, text_intermediate_size=16, num_layerwise_text_blocks=1,
                                   num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6)).eval()


def _forward():
    """5 x 7 image tokens after two prompts of 7 and 4 text tokens (masked), with the pipeline's position ids."""
    from diffusers import Krea2Pipeline

    g = gen()
    return _transformer(), dict(
        hidden_states=torch.randn(2, 35, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 7, len(_TAPS), _TEXT_DIM, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7).bool(), timestep=torch.tensor([0.5, 0.25]),
        position_ids=Krea2Pipeline.prepare_position_ids(7, 5, 7, "cpu"))


FORWARDS = {"ragged_prompts": _forward}


def _text_encoder():
    """A two-layer ``Qwen3VLModel`` of width 16 (a one-block vision tower the pipeline never calls)."""
    from transformers import Qwen3VLModel

    torch.manual_seed(0)
    return Qwen3VLModel(qwen3_vl_config(_TEXT_DIM)).eval()


def _pipeline():
    """A tiny ``Krea2Pipeline``: :func:`_text_encoder` over the tiny word tokenizer, tapping both layers, the
    tiny QwenImage VAE (4 x down); its chat template replaced by an empty prefix and a one-word suffix (the
    real template's token counts assume the real tokenizer)."""
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline(transformer=_transformer(), text_encoder=_text_encoder(), tokenizer=tm.tiny_tokenizer(),
                         vae=tm.tiny_qwenimage_pipeline().vae, scheduler=tm._flow_scheduler(),
                         text_encoder_select_layers=_TAPS)
    pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_start_idx = "", 0
    pipe.prompt_template_encode_suffix, pipe.prompt_template_encode_num_suffix_tokens = "sky", 1
    return pipe


PIPELINES = {
    # 40 x 56 pixels: 10 x 14 latents, 5 x 7 tokens; CFG as two calls, with negative prompts.
    "Krea2Pipeline": Pipe(_pipeline, lambda: dict(height=40, width=56, max_sequence_length=8, guidance_scale=4.0,
                                                  negative_prompt=["rain", "snow at night over the city"])),
}
