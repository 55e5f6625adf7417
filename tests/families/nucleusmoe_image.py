"""NucleusMoE-Image: NucleusMoEImageTransformer2DModel (image queries over [image; text] keys with the text's
key padding mask; expert-choice mixture-of-experts layers)."""

import torch

from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _transformer(seed: int = 0):
    """A ``NucleusMoEImageTransformer2DModel``: 3 query heads of 16 over 1 K/V head, three blocks (the first
    dense, the others expert-choice MoE of 4 experts), 16 input channels (4 latent channels packed 2 x 2),
    text width 32."""
    from diffusers import NucleusMoEImageTransformer2DModel

    torch.manual_seed(seed)
    model = NucleusMoEImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                              attention_head_dim=16, num_attention_heads=3, num_key_value_heads=1,
                                              joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6), mlp_ratio=2.0,
                                              dense_moe_strategy="leave_first_block_dense", num_experts=4,
                                              moe_intermediate_dim=16, capacity_factors=1.0).eval()
    with torch.no_grad():  # the experts' weights are left uninitialised (torch.empty) for checkpoints to fill
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0.0, 0.2)
    return model


def _forward():
    """5 x 7 image tokens; two prompts of 7 and 4 text tokens (masked)."""
    g = gen()
    return _transformer(), dict(hidden_states=torch.randn(2, 35, 16, generator=g), img_shapes=[(1, 5, 7)] * 2,
                                encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                                encoder_hidden_states_mask=ragged_mask([7, 4], 7).bool(), timestep=torch.tensor([0.5, 0.25]))


FORWARDS = {"ragged_prompts": _forward}


def _pipeline():
    """A tiny ``NucleusMoEImagePipeline``: a two-layer Qwen3-VL (its vision tower never called) whose last
    hidden states are the text (the real encoder's eighth from last), the tiny word tokenizer with a chat
    template as the processor (the pipeline passes it text only), the tiny QwenImage VAE (4 x down)."""
    from diffusers import NucleusMoEImagePipeline
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, vocab_size=64,
                         rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           deepstack_visual_indexes=[0]))).eval()
    processor = tm.tiny_tokenizer()
    processor.chat_template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                               "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}")
    pipe = NucleusMoEImagePipeline(transformer=_transformer(), text_encoder=encoder, processor=processor,
                                   vae=tm.tiny_qwenimage_pipeline().vae, scheduler=tm._flow_scheduler())
    pipe.default_return_index = -1
    return pipe


PIPELINES = {
    # 40 x 56 pixels: 10 x 14 latents, 5 x 7 tokens; CFG as two calls, with negative prompts.
    "NucleusMoEImagePipeline": Pipe(_pipeline, lambda: dict(height=40, width=56, guidance_scale=4.0,
                                                            negative_prompt=["rain", "snow at night over the city"])),
}
