"""Z-Image: ZImageTransformer2DModel (one unified [image; caption] sequence per sample, parts padded to
multiples of 32, the batch padded to its longest sample with a key padding mask).

Token counts: 5 x 7 = 35 image tokens are padded to 64; captions of 40 and 7 tokens to 64 and 32, so the
two samples' unified sequences are 128 and 96 tokens long and the split sequence is 128 (32 of the
second sample masked). Every count is a multiple of 32 (the model pads so): even over 2 ranks, uneven
over 3. The pipelines' chat template adds 24 words, so the long prompt of :data:`families.PROMPTS`
(11 tokens) gives a 64-token caption part, the short one (3) and the empty negative prompts 32.
"""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Forward, Modular, Pipe, gen

#: 3 heads of 16 (uneven over 2 ranks under Ulysses); two main layers, one refiner of each kind.
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
                   n_refiner_layers=1, n_heads=3, n_kv_heads=3, cap_feat_dim=16, axes_dims=[4, 6, 6],
                   axes_lens=[256, 32, 32])
SIGLIP_DIM = 8


def tiny_z_image_transformer(seed: int = 0, **overrides):
    """A ``ZImageTransformer2DModel`` of :data:`TRANSFORMER`. Diffusers starts its pad tokens at zero
    and its norms at one; trained weights differ, and so do these (random)."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**{**TRANSFORMER, **overrides}).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("pad_token") or ("norm" in name and name.endswith("weight")):
                param.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def _forward():
    """Two samples, captions of 40 and 7 tokens: unified lengths 128 and 96, a [2, 128] key mask."""
    g = gen()
    return tiny_z_image_transformer(), dict(
        x=[torch.randn(4, 1, 10, 14, generator=g) for _ in range(2)], t=torch.tensor([0.5, 0.25]),
        cap_feats=[torch.randn(40, 16, generator=g), torch.randn(7, 16, generator=g)])


def _forward_omni():
    """Omni: per sample a condition image (6 x 6 latent: 9 tokens, padded to 32) and the target (35,
    padded to 64), a caption per image, SigLIP tokens of the condition (2 x 3: padded to 32; the
    target's slot is a 32-token pad), and the noise mask [0, 1] that modulates the condition's tokens
    with t = 1 and the target's with t. Unified: 2 x 32 captions + 96 images + 64 SigLIP = 224."""
    g = gen()
    x = [[torch.randn(4, 1, 6, 6, generator=g), torch.randn(4, 1, 10, 14, generator=g)] for _ in range(2)]
    caps = [[torch.randn(12, 16, generator=g), torch.randn(5, 16, generator=g)] for _ in range(2)]
    sig = [[torch.randn(2, 3, SIGLIP_DIM, generator=g), None] for _ in range(2)]
    return tiny_z_image_transformer(siglip_feat_dim=SIGLIP_DIM), dict(
        x=x, t=torch.tensor([0.5, 0.25]), cap_feats=caps, siglip_feats=sig, image_noise_mask=[[0, 1], [0, 1]])


FORWARDS = {"": Forward(_forward, tokens=128), "omni": Forward(_forward_omni, tokens=224)}


# ------------------------------------------------------------------ tiny pipelines
# The tiny VAE does not downsample and Z-Image patchifies 2 x 2 latents, so 10 x 14 pixels give
# 5 x 7 = 35 image tokens (padded to 64).

H, W = 10, 14
#: What the chat template puts before the prompt (the real template's role markers, as 24 words).
_PREAMBLE = ("the sky over the city at night the sky over the city at night the sky over the city at night "
             "under the sun")


def _tokenizer():
    """The word-level tiny tokenizer with a chat template (the pipelines call ``apply_chat_template``)."""
    tok = tm.tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}" + _PREAMBLE + " {{ m['content'] }}{% endfor %}")
    return tok


def _text_encoder(seed: int = 0):
    """A 2-layer ``Qwen3Model`` of hidden size 16 (= ``cap_feat_dim``); the pipelines read its
    next-to-last hidden states."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    return Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=128)).eval()


def _controlnet(seed: int = 1):
    """A ``ZImageControlNetModel`` of the tiny transformer's size: control layers at both main layers,
    a control input of 4 + 1 + 4 channels (the inpaint pipeline's control latents, mask and masked
    image; the plain pipeline pads its 4 with zeros). Diffusers zero-initializes its ``before_proj`` /
    ``after_proj`` (a fresh ControlNet adds nothing); they get random weights here."""
    from diffusers import ZImageControlNetModel

    torch.manual_seed(seed)
    keys = ("all_patch_size", "all_f_patch_size", "dim", "n_refiner_layers", "n_heads", "n_kv_heads")
    net = ZImageControlNetModel(control_layers_places=[0, 1], control_refiner_layers_places=[0], control_in_dim=9,
                                **{k: TRANSFORMER[k] for k in keys}).eval()
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "before_proj" in name or "after_proj" in name:
                param.normal_(0.0, 0.2)
    return net


def _omni_vae(seed: int = 0):
    """An ``AutoencoderKL`` with 8x downsampling in bfloat16: the Omni pipeline refuses condition images
    under 64 pixels a side (8 x 8 latents here) and encodes them in bfloat16."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(4,) * 4, layers_per_block=1,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035).eval().to(torch.bfloat16)


def _build(name: str, controlnet: bool = False, omni: bool = False):
    """``() -> pipeline`` for the Diffusers pipeline class ``name``."""
    def build():
        import diffusers

        extra = {}
        if controlnet:
            extra["controlnet"] = _controlnet()
        transformer = tiny_z_image_transformer(**({"siglip_feat_dim": SIGLIP_DIM} if omni else {}))
        vae = _omni_vae() if omni else tm._tiny_kl_vae(4, 0)
        if omni:
            from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

            torch.manual_seed(2)
            extra["siglip"] = Siglip2VisionModel(Siglip2VisionConfig(
                hidden_size=SIGLIP_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_patches=16, patch_size=4)).eval()
            extra["siglip_processor"] = Siglip2ImageProcessor(patch_size=4, max_num_patches=16)
        return getattr(diffusers, name)(scheduler=tm._flow_scheduler(), vae=vae, text_encoder=_text_encoder(),
                                        tokenizer=_tokenizer(), transformer=transformer, **extra)
    return build


def _text2img(**extra):
    return {"height": H, "width": W, "max_sequence_length": 64, "guidance_scale": 4.0, **extra}


def _img2img(**extra):
    """4 scheduler steps at strength 0.5: 2 denoising steps from the noised input image."""
    return _text2img(image=families.image(W, H), num_inference_steps=4, strength=0.5, **extra)


def _control():
    return families.image(W, H, seed=1)


PIPELINES = {
    "ZImagePipeline": Pipe(_build("ZImagePipeline"), _text2img, tokens=128),
    "ZImageImg2ImgPipeline": Pipe(_build("ZImageImg2ImgPipeline"), _img2img, tokens=128),
    "ZImageInpaintPipeline": Pipe(_build("ZImageInpaintPipeline"),
                                  lambda: _img2img(mask_image=families.mask_image(W, H)), tokens=128),
    "ZImageControlNetPipeline": Pipe(_build("ZImageControlNetPipeline", controlnet=True),
                                     lambda: _text2img(control_image=_control()), tokens=128),
    "ZImageControlNetInpaintPipeline": Pipe(
        _build("ZImageControlNetInpaintPipeline", controlnet=True),
        # One prompt: the pipeline concatenates its one mask to a control image per prompt, which fails for
        # two (Diffusers 0.42). Its empty negative prompt still makes the CFG batch ragged (64 and 32).
        lambda: _text2img(prompt=families.PROMPTS[0], image=families.image(W, H), mask_image=families.mask_image(W, H),
                          control_image=_control()),
        tokens=128),
    # 80 x 112 pixels (8x VAE): 35 target tokens; a 64 x 64 condition image: 8 x 8 latents, 16 tokens.
    "ZImageOmniPipeline": Pipe(_build("ZImageOmniPipeline", omni=True), lambda: _text2img(
        height=80, width=112, image=[families.image(64, 64, seed=2)]), tokens=256),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "ZImageModularPipeline": Modular("ZImagePipeline"),
}
