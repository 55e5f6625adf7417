"""Wan Animate: WanAnimateTransformer3DModel (Wan 2.1 with pose latents and a per-frame face adapter;
text and the reference image's CLIP states in cross-attention)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Forward, Pipe, gen

#: 5 heads (uneven over 2 and 3 ranks), two blocks with a face adapter after each
#: (``inject_face_latents_blocks=1``), a motion encoder for 8 x 8 face crops.
_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=5, attention_head_dim=12, in_channels=36, latent_channels=16,
             out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", image_dim=4, added_kv_proj_dim=60, rope_max_seq_len=32,
             motion_encoder_channel_sizes={"8": 4, "4": 4}, motion_encoder_size=8, motion_style_dim=8, motion_dim=4,
             motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2, inject_face_latents_blocks=1)


def _transformer(seed: int = 0):
    """A ``WanAnimateTransformer3DModel`` of :data:`_TINY` size with random weights (norm weights too)."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(seed)
    model = WanAnimateTransformer3DModel(**_TINY).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _forward():
    """5 latent frames (the reference frame and 4 of the segment) of 1 x 7 patches, 35 tokens: the
    face adapter groups them by frame (7 each), so every shard ends inside a frame. 13 face frames
    make 4 motion frames after the face encoder's two stride-2 convolutions, plus the model's zero
    frame for the reference. The processors take the last 512 context tokens for text."""
    g = gen()
    return _transformer(), dict(
        hidden_states=torch.randn(2, 36, 5, 2, 14, generator=g), timestep=torch.tensor([700, 300]),
        encoder_hidden_states=torch.randn(2, 512, 32, generator=g),
        encoder_hidden_states_image=torch.randn(2, 3, 4, generator=g),
        pose_hidden_states=torch.randn(2, 16, 4, 2, 14, generator=g),
        face_pixel_values=torch.rand(2, 3, 13, 8, 8, generator=g) * 2 - 1)


FORWARDS = {"pose_and_face": Forward(_forward, modes=("ulysses", "kv_gather", "vsa"))}


def _pipeline():
    from diffusers import WanAnimatePipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                                               image_size=32, intermediate_size=16, patch_size=8)).eval()
    return WanAnimatePipeline(tokenizer=tm.tiny_tokenizer(), text_encoder=tm.tiny_umt5_encoder(), vae=tm.tiny_wan_vae(),
                              scheduler=tm._flow_scheduler(shift=5.0), image_processor=CLIPImageProcessor(crop_size=32, size=32),
                              image_encoder=encoder, transformer=_transformer())


# One segment of 13 frames at 16 x 112 pixels: 4 latent frames and the reference frame of 1 x 7
# patches, 35 tokens. One prompt (the pipeline does not batch prompts); CFG on, whose unconditional
# call blanks the face video.
PIPELINES = {
    "WanAnimatePipeline": Pipe(_pipeline, lambda: dict(
        prompt=families.PROMPTS[0], negative_prompt="rain", image=families.image(112, 16),
        pose_video=[families.image(112, 16, seed=i) for i in range(13)],
        face_video=[families.image(8, 8, seed=20 + i) for i in range(13)], height=16, width=112,
        segment_frame_length=13, guidance_scale=2.0, max_sequence_length=512)),
}
