"""HunyuanVideo Framepack: HunyuanVideoFramepackTransformer3DModel (history at 1x, 2x, 4x joined to the latents;
joint attention, text last, text mask built over the unsplit sequence)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Pipe, gen, ragged_mask


def _transformer(seed: int = 0):
    """3 heads of 16, one dual- and one single-stream block, patch 2 (the history embeddings' 1x),
    the history and SigLIP image embeddings."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(4, 6, 6), has_image_proj=True, image_proj_dim=12,
        has_clean_x_embedder=True).eval()
    with torch.no_grad():  # norm weights start at ones (QK-norms then equal); trained ones do not
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _forward():
    """Latents of 2 x 14 (1 x 7 patches): 1 frame (7 tokens) after 2 clean frames (14), 2 frames at 2x
    (1 x 4 after padding: 4) and 20 frames at 4x (5 x 1 x 2: 10), 35 tokens in all; two samples with
    ragged prompts (the model's mask over the whole sequence)."""
    g = gen()

    def latents(frames):
        return torch.randn(2, 4, frames, 2, 14, generator=g)

    return _transformer(), dict(
        hidden_states=latents(1), timestep=torch.tensor([900.0, 500.0]), encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        encoder_attention_mask=ragged_mask([7, 4], 7), pooled_projections=torch.randn(2, 8, generator=g),
        image_embeds=torch.randn(2, 3, 12, generator=g), indices_latents=torch.tensor([3]),
        guidance=torch.tensor([6000.0, 6000.0]), latents_clean=latents(2), indices_latents_clean=torch.tensor([0, 4]),
        latents_history_2x=latents(2), indices_latents_history_2x=torch.tensor([5, 6]),
        latents_history_4x=latents(20), indices_latents_history_4x=torch.arange(7, 27))


FORWARDS = {"history_ragged_prompts": _forward}


# ------------------------------------------------------------------ tiny pipeline
# The tiny VAE compresses 16x in space and 4x in time. 32 x 224 pixels are latents of 2 x 14 (1 x 7
# patches); a window of 3 latent frames (21 tokens) after the clean frames (the image and the last
# frame made: 14 tokens), 2 frames at 2x (4) and 16 at 4x (4 x 1 x 2: 8): 47 tokens. 18 frames are
# two sections of a window each, so the second section's history holds the first one's frames.
H, W = 32, 224
_TOKENS = 21 + 14 + 4 + 8


def _pipeline():
    """The tiny HunyuanVideo components (Llama, CLIP, 16x VAE), a tiny SigLIP (16 x 16 pixels in 8 x 8
    patches: 4 image tokens of width 12) and the Framepack transformer."""
    from diffusers import HunyuanVideoFramepackPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    parts = tm.tiny_hunyuan_video_pipeline().components
    torch.manual_seed(1)
    siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=12, intermediate_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=16, patch_size=8)).eval()
    return HunyuanVideoFramepackPipeline(
        text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"], transformer=_transformer(), vae=parts["vae"],
        scheduler=parts["scheduler"], text_encoder_2=parts["text_encoder_2"], tokenizer_2=parts["tokenizer_2"],
        image_encoder=siglip, feature_extractor=SiglipImageProcessor(size={"height": 16, "width": 16}))


def _call():
    """One prompt (the pipeline encodes one image, a batch of 1: the model drops the text padding and
    passes no mask) with true CFG (a second transformer call per step, the negative prompt's text).
    With latents out the pipeline returns the history after each section (two tensors), all compared."""
    return dict(image=families.image(W, H), prompt=families.PROMPTS[0], negative_prompt=families.PROMPTS[1],
                true_cfg_scale=2.0, height=H, width=W, num_frames=18, latent_window_size=3, max_sequence_length=16,
                prompt_template={"template": "{}", "crop_start": 0})


PIPELINES = {"HunyuanVideoFramepackPipeline": Pipe(_pipeline, _call, tokens=_TOKENS)}
