"""Sana: SanaTransformer2DModel (linear self-attention, convolutional feed-forward over the token grid;
text in cross-attention with its mask).

Patch size 1: 5 x 7 latents are 35 tokens in a 5 x 7 grid, so over 3 ranks (12, 12, 11 tokens) every
shard starts and ends inside a row and reads neighbour rows of both other ranks' shards.
"""

import torch

import families
from diffusers_sp import tiny_models as tm
from families import Pipe, gen

#: 3 heads of 8 (the linear self-attention), 2 cross-attention heads of 8, two blocks.
TRANSFORMER = dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8, num_layers=2,
                   num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=24,
                   caption_channels=16, sample_size=8, patch_size=1)
#: Sana 1.0: sin-cos position embedding added in the patch embedding.
SANA_1_0 = dict(interpolation_scale=1)
#: Sana 1.5 / Sprint: RMS QK-norm in both attentions, no position embedding; Sprint adds guidance.
SANA_SPRINT = dict(qk_norm="rms_norm_across_heads", guidance_embeds=True, timestep_scale=1000.0)


def tiny_sana_transformer(seed: int = 0, **overrides):
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(seed)
    return SanaTransformer2DModel(**{**TRANSFORMER, **overrides}).eval()


def _forward(**overrides):
    def build():
        g = gen()
        kwargs = dict(hidden_states=torch.randn(2, 4, 5, 7, generator=g),
                      encoder_hidden_states=torch.randn(2, 6, 16, generator=g), timestep=torch.tensor([500, 250]),
                      encoder_attention_mask=families.ragged_mask([6, 3], 6))
        if overrides.get("guidance_embeds"):
            kwargs["guidance"] = torch.tensor([4.5, 4.5])
        return tiny_sana_transformer(**overrides), kwargs
    return build


def _forward_controlnet():
    """ControlNet residuals (a tuple of [B, 35, C], one per block) added to the image tokens."""
    model, kwargs = _forward(**SANA_1_0)()
    g = gen(2)
    kwargs["controlnet_block_samples"] = tuple(torch.randn(2, 35, 24, generator=g) for _ in range(2))
    return model, kwargs


FORWARDS = {"": _forward(**SANA_1_0), "sprint": _forward(**SANA_SPRINT), "controlnet": _forward_controlnet}


# ------------------------------------------------------------------ tiny pipelines
# The pipelines want sizes divisible by 32, so the DC-AE compresses 32x as the released one does (six
# stages of 8 channels): 160 x 224 pixels give 5 x 7 = 35 tokens. Resolution binning (to the trained
# aspect ratios) is off; the complex human instruction the pipelines prepend to every prompt by
# default is left out (it is written for the real tokenizer).

H, W = 160, 224


def _vae(seed: int = 0):
    """An ``AutoencoderDC`` with six stages of 8 channels (32x compression), 4 latent channels."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    return AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=4, encoder_block_types="ResBlock",
                         decoder_block_types="ResBlock", encoder_block_out_channels=(8,) * 6,
                         decoder_block_out_channels=(8,) * 6, encoder_layers_per_block=(1,) * 6,
                         decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 6,
                         decoder_qkv_multiscales=((),) * 6,
                         decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41).eval()


def _gemma2(seed: int = 0):
    """A 2-layer ``Gemma2Model`` of hidden size 16 (= ``caption_channels``)."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    return Gemma2Model(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    max_position_embeddings=64, sliding_window=8)).eval()


def _controlnet(seed: int = 1):
    """A ``SanaControlNetModel`` of the tiny transformer's size (Sana 1.0 style), one residual per
    block. Diffusers zero-initializes its input and output layers; they get random weights here."""
    from diffusers import SanaControlNetModel

    torch.manual_seed(seed)
    keys = [k for k in TRANSFORMER if k not in ("out_channels",)]
    net = SanaControlNetModel(**{k: TRANSFORMER[k] for k in keys}, **SANA_1_0).eval()
    with torch.no_grad():
        for module in (net.input_block, *net.controlnet_blocks):
            for param in module.parameters():
                param.normal_(0.0, 0.2)
    return net


def _build(name: str, transformer: dict, scheduler, controlnet: bool = False):
    def build():
        import diffusers

        extra = {"controlnet": _controlnet()} if controlnet else {}
        return getattr(diffusers, name)(tokenizer=tm.tiny_tokenizer(), text_encoder=_gemma2(), vae=_vae(),
                                        transformer=tiny_sana_transformer(**transformer), scheduler=scheduler(),
                                        **extra)
    return build


def _dpm():
    """Sana's scheduler as released: DPM-Solver++ on flow-matching sigmas."""
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _scm():
    from diffusers import SCMScheduler

    return SCMScheduler()


def _call(**extra):
    return {"height": H, "width": W, "max_sequence_length": 8, "complex_human_instruction": None,
            "use_resolution_binning": False, **extra}


PIPELINES = {
    "SanaPipeline": Pipe(_build("SanaPipeline", SANA_1_0, _dpm), lambda: _call(guidance_scale=4.5)),
    "SanaControlNetPipeline": Pipe(_build("SanaControlNetPipeline", SANA_1_0, _dpm, controlnet=True),
                                   lambda: _call(guidance_scale=4.5, control_image=families.image(W, H, seed=1))),
    "SanaSprintPipeline": Pipe(_build("SanaSprintPipeline", SANA_SPRINT, _scm), _call),
    "SanaSprintImg2ImgPipeline": Pipe(_build("SanaSprintImg2ImgPipeline", SANA_SPRINT, _scm),
                                      lambda: _call(image=families.image(W, H), strength=0.8)),
}


def _pag():
    """A ``SanaPAGPipeline`` with perturbed-attention guidance at block 0: for each call, that block's
    self-attention processor is swapped for a PAG one (wrapped at the next forward)."""
    from diffusers import SanaPAGPipeline

    return SanaPAGPipeline(tokenizer=tm.tiny_tokenizer(), text_encoder=_gemma2(), vae=_vae(),
                           transformer=tiny_sana_transformer(**SANA_1_0), scheduler=tm._flow_scheduler(),
                           pag_applied_layers="transformer_blocks.0")


# CFG and PAG: the batch is [uncond, cond, perturbed] (PAGCFGSanaLinearAttnProcessor2_0).
PIPELINES["SanaPAGPipeline"] = Pipe(_pag, lambda: _call(guidance_scale=4.5, pag_scale=3.0))
