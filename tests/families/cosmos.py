"""Cosmos: CosmosTransformer3DModel (video self-attention, text in cross-attention; Predict 1, 2, 2.5 and
Transfer 2.5)."""

import torch

import families
from families import Forward, Pipe, gen, ragged_mask


def _torchvision_stand_in():
    """Cosmos' models resize their padding mask with ``torchvision.transforms.functional.resize``
    (nearest), and torchvision is not installed here. Where it is missing, the models' modules get an
    object with that one function, as torchvision computes it for tensors (``F.interpolate``, mode
    "nearest"); the pipelines' padding masks are zeros anyway."""
    import types

    from diffusers.models.controlnets import controlnet_cosmos
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return

    def resize(x, size, interpolation=None):
        return torch.nn.functional.interpolate(x, size=list(size), mode="nearest")

    stand_in = types.SimpleNamespace(functional=types.SimpleNamespace(resize=resize),
                                     InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))
    transformer_cosmos.transforms = controlnet_cosmos.transforms = stand_in


def _transformer(seed: int = 0, in_channels: int = 4, **overrides):
    """3 heads of 16 (RoPE 8 + 4 + 4), two blocks, AdaLN-LoRA 4, text width 32 (the tiny T5's)."""
    from diffusers import CosmosTransformer3DModel

    _torchvision_stand_in()
    torch.manual_seed(seed)
    cfg = dict(in_channels=in_channels, out_channels=4, num_attention_heads=3, attention_head_dim=16, num_layers=2,
               mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=4, max_size=(32, 64, 64), patch_size=(1, 2, 2),
               rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=True, extra_pos_embed_type=None)
    cfg.update(overrides)
    model = CosmosTransformer3DModel(**cfg).eval()
    with torch.no_grad():  # norm weights start at ones (QK-norms then equal); trained ones do not
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _inputs(frames: int, height: int, width: int, per_frame: bool, channels: int = 5, **extra):
    """Two samples, text of 6 tokens (ragged: 6 and 2 valid, a cross-attention mask); a timestep per
    frame ``[B, 1, T, 1, 1]`` (video-to-world: the first frame conditioning) or per sample."""
    g = gen()
    timestep = (torch.rand(2, 1, frames, 1, 1, generator=g) if per_frame else torch.tensor([0.7, 0.3]))
    return dict(hidden_states=torch.randn(2, channels - 1, frames, height, width, generator=g), timestep=timestep,
                encoder_hidden_states=torch.randn(2, 6, 32, generator=g), attention_mask=ragged_mask([6, 2], 6).bool(),
                condition_mask=torch.zeros(2, 1, frames, height, width).index_fill_(2, torch.tensor([0]), 1.0),
                padding_mask=torch.zeros(1, 1, height, width), fps=16, **extra)


def _predict2_video():
    """Predict 2 video-to-world: 5 frames of 1 x 7 patches (35 tokens), a timestep per frame."""
    return _transformer(in_channels=5), _inputs(5, 2, 14, per_frame=True)


def _predict1():
    """Predict 1: learnable positional embedding (split at its module), one frame of 5 x 7 patches."""
    return _transformer(in_channels=5, extra_pos_embed_type="learnable"), _inputs(1, 10, 14, per_frame=False)


def _transfer25():
    """Transfer 2.5's transformer: image context in cross-attention, text projected, ControlNet residuals for
    every block (``[B, S, C]``), a timestep per frame; 35 tokens (5 frames of 1 x 7)."""
    model = _transformer(in_channels=5, controlnet_block_every_n=1, img_context_dim_in=8, img_context_num_tokens=3,
                         img_context_dim_out=48, use_crossattn_projection=True, crossattn_proj_in_channels=24,
                         encoder_hidden_states_channels=32)
    g = gen(3)
    kwargs = _inputs(5, 2, 14, per_frame=True)
    kwargs["encoder_hidden_states"] = (torch.randn(2, 6, 24, generator=g), torch.randn(2, 3, 8, generator=g))
    kwargs["block_controlnet_hidden_states"] = [torch.randn(2, 35, 48, generator=g) * 0.5 for _ in range(2)]
    kwargs["attention_mask"] = None  # with image context, masks are a (text, image) pair; Transfer passes none
    return model, kwargs


FORWARDS = {"predict2_video_per_frame_timestep": Forward(_predict2_video, modes=("ulysses", "kv_gather", "vsa")),
            "predict1_learnable_positions": _predict1,
            "transfer25_controlnet_image_context": _transfer25}


# ------------------------------------------------------------------ tiny pipelines


def _safety_checker():
    """Stands for ``cosmos_guardrail.CosmosSafetyChecker`` (a large model, not installed), which every Cosmos
    pipeline requires: every prompt is safe, every video is returned unchanged. Diffusers' own pipeline
    tests stand a dummy checker in the same way. A model (one unused parameter) so that the pipeline
    finds its device like any component's."""
    from diffusers import ConfigMixin, ModelMixin

    class PassThroughSafetyChecker(ModelMixin, ConfigMixin):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def check_text_safety(self, prompt: str) -> bool:
            return True

        def check_video_safety(self, video):
            return video

    return PassThroughSafetyChecker()


def _wan_vae(seed: int = 0):
    """An ``AutoencoderKLWan`` with 4 latent channels (8x spatial, 4x temporal compression)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                            latents_std=[1.0] * 4).eval()


def _t5_parts(seed: int = 0) -> dict:
    from diffusers_sp import tiny_models as tm

    return dict(text_encoder=tm.tiny_t5_encoder(seed=seed), tokenizer=tm.tiny_tokenizer(),
                safety_checker=_safety_checker())


def _qwen_parts(seed: int = 0) -> dict:
    """Cosmos 2.5's text encoder: a tiny Qwen2.5-VL (2 layers of 16: the pipeline joins every layer's
    normalized states, 32 wide) and a chat template that keeps the texts of the messages' parts."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1000000.0),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=64, vision_start_token_id=60, vision_end_token_id=61, vision_token_id=62,
        image_token_id=63, video_token_id=59)).eval()
    tokenizer = tm.tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }} {% endfor %}{% endfor %}"
    return dict(text_encoder=encoder, tokenizer=tokenizer, safety_checker=_safety_checker())


def _cosmos2(name: str, in_channels: int):
    def build():
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        return getattr(diffusers, name)(
            transformer=_transformer(in_channels=in_channels), vae=_wan_vae(),
            scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True), **_t5_parts())
    return build


def _cosmos25_predict():
    from diffusers import Cosmos2_5_PredictBasePipeline, UniPCMultistepScheduler

    return Cosmos2_5_PredictBasePipeline(
        transformer=_transformer(in_channels=5, use_crossattn_projection=True, crossattn_proj_in_channels=32,
                                 encoder_hidden_states_channels=32),
        vae=_wan_vae(), scheduler=UniPCMultistepScheduler(), **_qwen_parts())


def _cosmos25_transfer():
    """Transfer 2.5: image context (zeros, as the pipeline passes it) and a ControlNet of 2 blocks whose
    residuals go to every transformer block; its output projections get random weights (fresh ones
    would add zeros)."""
    from diffusers import Cosmos2_5_TransferPipeline, CosmosControlNetModel, UniPCMultistepScheduler

    model = _transformer(in_channels=5, controlnet_block_every_n=1, img_context_dim_in=8, img_context_num_tokens=3,
                         img_context_dim_out=48, use_crossattn_projection=True, crossattn_proj_in_channels=32,
                         encoder_hidden_states_channels=32)
    torch.manual_seed(1)
    controlnet = CosmosControlNetModel(
        n_controlnet_blocks=2, in_channels=4 + 1 + 1, latent_channels=4 + 1 + 1, model_channels=48,
        num_attention_heads=3, attention_head_dim=16, mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=4,
        patch_size=(1, 2, 2), max_size=(32, 64, 64), rope_scale=(1.0, 1.0, 1.0), img_context_dim_in=8,
        img_context_dim_out=48, use_crossattn_projection=True, crossattn_proj_in_channels=32,
        encoder_hidden_states_channels=32).eval()
    with torch.no_grad():
        for block in controlnet.control_blocks:
            for proj in (block.before_proj, block.after_proj):
                if proj is not None:
                    proj.weight.normal_(0.0, 0.2)
    return Cosmos2_5_TransferPipeline(transformer=model, controlnet=controlnet, vae=_wan_vae(),
                                      scheduler=UniPCMultistepScheduler(), **_qwen_parts())


def _cosmos1(name: str, in_channels: int):
    """Predict 1: learnable positions, the Cosmos VAE (8x spatial, 4x temporal), the EDM scheduler."""
    def build():
        import diffusers
        from diffusers import AutoencoderKLCosmos, EDMEulerScheduler

        torch.manual_seed(0)
        vae = AutoencoderKLCosmos(latent_channels=4, encoder_block_out_channels=(8, 8, 8, 8),
                                  decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(8,), resolution=64,
                                  num_layers=1, patch_size=4, spatial_compression_ratio=8,
                                  temporal_compression_ratio=4).eval()
        scheduler = EDMEulerScheduler(sigma_min=0.002, sigma_max=80, sigma_data=0.5, sigma_schedule="karras",
                                      num_train_timesteps=1000, prediction_type="epsilon", rho=7.0,
                                      final_sigmas_type="sigma_min")
        return getattr(diffusers, name)(
            transformer=_transformer(in_channels=in_channels, extra_pos_embed_type="learnable"), vae=vae,
            scheduler=scheduler, **_t5_parts())
    return build


# Tokens: with either VAE (8x spatial, 4x temporal), 80 x 112 pixels, one frame, are 5 x 7 patches; 16 x 112 pixels
# and 17 frames are 5 frames of 1 x 7: 35 tokens.
def _video(height: int, width: int, seed: int = 2):
    """One input frame ``[1, 3, 1, H, W]`` in [-1, 1] (Predict 2.5 takes a video tensor as it is)."""
    return torch.rand(1, 3, 1, height, width, generator=gen(seed)) * 2 - 1


PIPELINES = {
    "Cosmos2TextToImagePipeline": Pipe(_cosmos2("Cosmos2TextToImagePipeline", 4), lambda: dict(
        height=80, width=112, max_sequence_length=8, guidance_scale=3.0)),
    "Cosmos2VideoToWorldPipeline": Pipe(_cosmos2("Cosmos2VideoToWorldPipeline", 5), lambda: dict(
        image=families.image(112, 16), height=16, width=112, num_frames=17, max_sequence_length=8,
        guidance_scale=3.0)),
    "Cosmos2_5_PredictBasePipeline": Pipe(_cosmos25_predict, lambda: dict(
        video=_video(16, 112), num_latent_conditional_frames=1, prompt=families.PROMPTS[0],  # a video: one prompt
        height=16, width=112, num_frames=17, max_sequence_length=8, guidance_scale=3.0)),
    # Five control frames, one chunk of five (the pipeline's shortest: 2 latent frames of 1 x 7, 14 tokens; the
    # VAE encodes every control frame, so one prompt); the transformer's forward case has 35 tokens.
    "Cosmos2_5_TransferPipeline": Pipe(_cosmos25_transfer, lambda: dict(
        controls=[torch.rand(3, 16, 112, generator=gen(i)) * 2 - 1 for i in range(5)], prompt=families.PROMPTS[0],
        height=16, width=112, num_frames_per_chunk=5, max_sequence_length=8, guidance_scale=3.0), tokens=14),
    "CosmosTextToWorldPipeline": Pipe(_cosmos1("CosmosTextToWorldPipeline", 4), lambda: dict(
        height=80, width=112, num_frames=1, max_sequence_length=8, guidance_scale=3.0)),
    "CosmosVideoToWorldPipeline": Pipe(_cosmos1("CosmosVideoToWorldPipeline", 5), lambda: dict(
        image=families.image(112, 16), height=16, width=112, num_frames=17, max_sequence_length=8,
        guidance_scale=3.0)),
}
