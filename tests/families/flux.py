"""Flux: FluxTransformer2DModel (joint attention, text first, no text mask)."""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import FEW_TOKENS, Forward, Modular, Pipe, gen


def _ids(batched: bool = False):
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    return ids.reshape(1, -1, 3) if batched else ids.reshape(-1, 3)


def _forward():
    g = gen()
    return tm.tiny_flux_transformer(guidance_embeds=True), dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.25]),
        guidance=torch.tensor([3.5, 3.5]), img_ids=_ids(), txt_ids=torch.zeros(7, 3))


def _forward_3d_ids():
    """The deprecated ``[B, S, 3]`` ids Diffusers still accepts (its forward takes ``ids[0]``): the 3-D
    ``img_ids`` once passed unsplit, and each rank's RoPE covered every image token."""
    g = gen()
    return tm.tiny_flux_transformer(guidance_embeds=True), dict(
        hidden_states=torch.randn(1, 35, 4, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]), img_ids=_ids(batched=True), txt_ids=torch.zeros(1, 7, 3))


def _forward_few_tokens():
    """2 image tokens (1 x 2), fewer than 3 ranks, after the text."""
    g = gen()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(1.0), torch.arange(2.0), indexing="ij"), -1)
    return tm.tiny_flux_transformer(guidance_embeds=True), dict(
        hidden_states=torch.randn(2, 2, 4, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.25]),
        guidance=torch.tensor([3.5, 3.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(7, 3))

FORWARDS = {"": _forward, "3d_ids": _forward_3d_ids, "few_tokens": Forward(_forward_few_tokens, tokens=FEW_TOKENS)}


# ------------------------------------------------------------------ tiny pipelines
# The tiny VAE does not downsample and Flux packs 2 x 2 latents into one token, so H x W pixels give
# (H / 2) x (W / 2) tokens: 10 x 14 pixels give 5 x 7 = 35 image tokens. Pipelines that join more
# tokens to them (a reference image) say how many in their ``tokens``.

H, W = 10, 14


def _pipeline(cls, transformer=None, seed: int = 0, **extra):
    """A tiny pipeline of class ``cls`` with the components of ``tm.tiny_flux_pipeline`` (CLIP + T5,
    1-channel no-downsampling VAE), ``transformer`` (default: 4 input channels, one packed latent) and
    the pipeline's ``extra`` components (a ControlNet)."""
    return cls(transformer=transformer or tm.tiny_flux_transformer(seed=seed, guidance_embeds=True),
               text_encoder=tm.tiny_clip_text_encoder(seed=seed), tokenizer=tm.tiny_tokenizer(16),
               text_encoder_2=tm.tiny_t5_encoder(seed=seed), tokenizer_2=tm.tiny_tokenizer(),
               vae=tm._tiny_kl_vae(1, seed), scheduler=tm._flow_scheduler(), **extra)


def _transformer(in_channels: int):
    """A transformer whose input joins conditions to the 4 latent channels along the channels (Fill:
    masked image and mask, 4 + 4 + 4; Control: control image, 4 + 4) and predicts the 4 latent channels."""
    return tm.tiny_flux_transformer(guidance_embeds=True, in_channels=in_channels, out_channels=4)


def _controlnet(seed: int = 1):
    """A ``FluxControlNetModel`` of the tiny transformer's size, InstantX style (no input hint block:
    the control image is VAE-encoded and packed like the latents), one residual per block of each
    kind. Diffusers zero-initializes its output layers (a fresh ControlNet adds nothing); they get
    random weights here so that the residuals added to the image tokens are not zero."""
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed)
    net = FluxControlNetModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                              num_attention_heads=3, joint_attention_dim=32, pooled_projection_dim=32,
                              guidance_embeds=True, axes_dims_rope=[4, 4, 8]).eval()
    with torch.no_grad():
        for module in (*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder):
            for param in module.parameters():
                param.normal_(0.0, 0.2)
    return net


def _build(name: str, in_channels: int = 4, controlnet: bool = False):
    """``() -> pipeline`` for the Diffusers pipeline class ``name``."""
    def build():
        import diffusers

        extra = {"controlnet": _controlnet()} if controlnet else {}
        return _pipeline(getattr(diffusers, name), transformer=_transformer(in_channels), **extra)
    return build


def _text2img(**extra):
    return dict(height=H, width=W, max_sequence_length=8, guidance_scale=3.5, **extra)


def _img2img(**extra):
    """4 scheduler steps at strength 0.5: 2 denoising steps from the noised input image."""
    return _text2img(image=families.image(W, H), num_inference_steps=4, strength=0.5, **extra)


def _inpaint(**extra):
    return _img2img(mask_image=families.mask_image(W, H), **extra)


def _control():
    return families.image(W, H, seed=1)


# FluxKontext joins the reference image's tokens to the image tokens (hidden_states and img_ids). An
# 8 x 6 reference gives 4 x 3 = 12 of them, 35 + 12 = 47 in all. `_auto_resize=False` keeps the
# reference's size (Kontext otherwise resizes it to one of its ~1 MP training resolutions);
# `max_area=H * W` keeps the output at H x W.
_REFERENCE = (8, 6)
_KONTEXT_TOKENS = 35 + (_REFERENCE[0] // 2) * (_REFERENCE[1] // 2)


def _kontext():
    return _text2img(image=families.image(*_REFERENCE, seed=2), max_area=H * W, _auto_resize=False)


def _kontext_inpaint():
    """The output takes the input image's size (H x W; `max_area` only keeps Kontext from first
    sizing the output at 1024 x 1024, a warning); the reference is joined as in Kontext."""
    return _inpaint(image_reference=families.image(*_REFERENCE, seed=2), max_area=H * W, _auto_resize=False)


# VisualCloze lays out a grid of images (rows: in-context examples, then the query with its targets
# as None) side by side; every row is resized to about resolution**2 pixels and the rows' tokens are
# concatenated. One in-context example (an 8 x 4 image at resolution 6: 4 x 8 pixels, 2 x 4 tokens)
# and the target (a blank 6 x 6 query: 3 x 3 tokens) give 8 + 9 = 17 tokens. Rows of 2 images or
# 3 rows would give an even count or a multiple of 3 (every row holds (h/2) x n (w/2) tokens).
_CLOZE_RESOLUTION = 6
_CLOZE_TOKENS = 2 * 4 + 3 * 3


def _cloze(name: str):
    """``() -> pipeline`` for a VisualCloze pipeline: the transformer takes Fill's 12 channels (latents,
    masked image, mask); the combined pipeline's inner pipelines get no progress bars either."""
    def build():
        import diffusers

        pipe = _pipeline(getattr(diffusers, name), transformer=_transformer(12), resolution=_CLOZE_RESOLUTION)
        for inner in (getattr(pipe, "generation_pipe", None), getattr(pipe, "upsampling_pipe", None)):
            if inner is not None:
                inner.set_progress_bar_config(disable=True)
        return pipe
    return build


def _cloze_call(**extra):
    """A batch of two samples (the two ragged prompts as task prompts), each one example + query."""
    grid = [[families.image(8, 4, seed=3)], [None]]
    return dict(task_prompt=families.PROMPTS, content_prompt=["a red bird", "a small tree in the snow"],
                image=[grid, grid], max_sequence_length=8, guidance_scale=3.5, **extra)


PIPELINES = {
    "FluxPipeline": Pipe(tm.tiny_flux_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8,
                                                             guidance_scale=3.5)),
    "FluxImg2ImgPipeline": Pipe(_build("FluxImg2ImgPipeline"), _img2img),
    "FluxInpaintPipeline": Pipe(_build("FluxInpaintPipeline"), _inpaint),
    "FluxFillPipeline": Pipe(_build("FluxFillPipeline", in_channels=12), _inpaint),
    "FluxControlPipeline": Pipe(_build("FluxControlPipeline", in_channels=8),
                                lambda: _text2img(control_image=_control())),
    "FluxControlImg2ImgPipeline": Pipe(_build("FluxControlImg2ImgPipeline", in_channels=8),
                                       lambda: _img2img(control_image=_control())),
    "FluxControlInpaintPipeline": Pipe(_build("FluxControlInpaintPipeline", in_channels=8),
                                       lambda: _inpaint(control_image=_control())),
    "FluxKontextPipeline": Pipe(_build("FluxKontextPipeline"), _kontext, tokens=_KONTEXT_TOKENS),
    "FluxKontextInpaintPipeline": Pipe(_build("FluxKontextInpaintPipeline"), _kontext_inpaint,
                                       tokens=_KONTEXT_TOKENS),
    "FluxControlNetPipeline": Pipe(_build("FluxControlNetPipeline", controlnet=True),
                                   lambda: _text2img(control_image=_control())),
    "FluxControlNetImg2ImgPipeline": Pipe(_build("FluxControlNetImg2ImgPipeline", controlnet=True),
                                          lambda: _img2img(control_image=_control())),
    "FluxControlNetInpaintPipeline": Pipe(_build("FluxControlNetInpaintPipeline", controlnet=True),
                                          lambda: _inpaint(control_image=_control())),
    "VisualClozeGenerationPipeline": Pipe(_cloze("VisualClozeGenerationPipeline"), _cloze_call,
                                          tokens=_CLOZE_TOKENS),
    # The generation stage (17 tokens, 4 steps), then the upsampling stage (a Fill pass over the
    # generated target resized to H x W: 35 tokens, the last forward's; 2 steps at strength 0.5).
    "VisualClozePipeline": Pipe(_cloze("VisualClozePipeline"), lambda: _cloze_call(
        upsampling_height=H, upsampling_width=W, upsampling_strength=0.5, num_inference_steps=4)),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "FluxModularPipeline": Modular("FluxPipeline"),
    # One prompt: the modular Kontext blocks do not repeat the reference image's latents over a batch of prompts.
    "FluxKontextModularPipeline": Modular("FluxKontextPipeline", lambda: dict(prompt=families.PROMPTS[0])),
}
