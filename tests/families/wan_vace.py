"""Wan VACE: WanVACETransformer3DModel (Wan with the VACE control branch; text in cross-attention)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Forward, Modular, Pipe, gen

#: 5 heads (uneven over 2 and 3 ranks); two main blocks, each a VACE layer. The control input has the
#: tiny Wan VAE's 16 + 16 latent channels (inactive, reactive) and its 8 x 8 spatial mask (64).
_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=5, attention_head_dim=12, in_channels=16, out_channels=16,
             text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 1], vace_in_channels=96)


def _transformer(seed: int = 0):
    """A ``WanVACETransformer3DModel`` of :data:`_TINY` size with random weights (norm weights too; the
    VACE output projections, which Diffusers does not zero, as they come)."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(seed)
    model = WanVACETransformer3DModel(**_TINY).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _control(frames: int):
    """One frame of 5 x 7 patches; ``frames`` control frames, fewer than the video's leave the model
    to zero-pad the control tokens up to the video's."""
    g = gen()
    return _transformer(), dict(
        hidden_states=torch.randn(2, 16, 5, 2, 14, generator=g) if frames != 1 else torch.randn(2, 16, 1, 10, 14, generator=g),
        control_hidden_states=(torch.randn(2, 96, frames, 2, 14, generator=g) if frames != 1
                               else torch.randn(2, 96, 1, 10, 14, generator=g)),
        control_hidden_states_scale=torch.tensor([1.0, 0.5]), timestep=torch.tensor([700, 300]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


FORWARDS = {
    "control": Forward(lambda: _control(1), modes=("ulysses", "kv_gather", "vsa")),
    # 5 frames of 1 x 7 patches, control for the first 3 (21 tokens, padded to 35 by the model).
    "control_padded": lambda: _control(3),
}


def _pipeline():
    """A Wan 2.2-style WanVACEPipeline: two transformers switched at ``boundary_ratio``."""
    from diffusers import WanVACEPipeline

    first, second = _transformer(), _transformer(seed=1)
    return WanVACEPipeline(tokenizer=tm.tiny_tokenizer(), text_encoder=tm.tiny_umt5_encoder(), vae=tm.tiny_wan_vae(),
                           scheduler=tm._flow_scheduler(shift=3.0), transformer=first, transformer_2=second,
                           boundary_ratio=0.875)


# 9 frames (3 latent frames) and 2 reference images (one latent frame each) at 16 x 112 pixels:
# 5 latent frames of 1 x 7 patches, 35 tokens; a control video and mask for the 9 frames. One prompt
# (WanVACEPipeline refuses a list); 4 steps, 1 on the first transformer, 3 on the second.
PIPELINES = {
    "WanVACEPipeline": Pipe(_pipeline, lambda: dict(
        prompt=families.PROMPTS[0], negative_prompt="rain", height=16, width=112, num_frames=9, guidance_scale=5.0,
        guidance_scale_2=3.0, max_sequence_length=8, num_inference_steps=4,
        video=[families.image(112, 16, seed=i) for i in range(9)], mask=[families.mask_image(112, 16)] * 9,
        reference_images=[families.image(56, 16, seed=10), families.image(112, 32, seed=11)])),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "Wan22VaceModularPipeline": Modular("WanVACEPipeline"),
}
