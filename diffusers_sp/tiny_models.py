"""Tiny pipelines built from the real Diffusers / Transformers config classes with random weights.

Used by the main job's default (``examples/generate_video.py`` with no ``--model``), the tests and
the CPU side of the benchmarks: nothing is downloaded. The weights are saved with safetensors and
loaded back through the normal ``from_pretrained`` path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: Default size of the tiny Wan transformer: 6 heads split evenly over 2 and 3 ranks, unevenly over 4.
TINY_WAN = dict(num_attention_heads=6, attention_head_dim=12, num_layers=2, ffn_dim=32, text_dim=32, freq_dim=32)

_WORDS = ("a cat dog bird fish runs walks flies swims on in the grass water sky tree red blue green small big "
          "over under beach city night day snow rain sun moon").split()


def tiny_tokenizer(model_max_length: int = 512):
    """A word-level ``PreTrainedTokenizerFast`` over a small English vocabulary (unknown words map to <unk>).

    ``model_max_length`` is what pipelines that pad to the tokenizer's length (CLIP in Flux, SD3) use.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=model_max_length)


def tiny_umt5_encoder(d_model: int = 32, seed: int = 0):
    """A 2-layer ``UMT5EncoderModel`` (Wan's text encoder class) with random weights."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    cfg = UMT5Config(vocab_size=64, d_model=d_model, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return UMT5EncoderModel(cfg).eval()


def tiny_wan_transformer(in_channels: int = 16, seed: int = 0, image_dim: int | None = None, **overrides):
    """A ``WanTransformer3DModel`` of :data:`TINY_WAN` size (patch (1, 2, 2)) with random weights."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(TINY_WAN, patch_size=(1, 2, 2), in_channels=in_channels, out_channels=16, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=image_dim)
    cfg.update(overrides)
    model = WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        # RMSNorm/LayerNorm weights start at ones, which makes e.g. norm_q and norm_k the same function;
        # trained checkpoints differ, and so must the tests' models.
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def tiny_wan_vae(seed: int = 0):
    """An ``AutoencoderKLWan`` with base_dim 3 (z_dim 16, 8x spatial and 4x temporal compression)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def tiny_wan_pipeline(kind: str = "t2v", seed: int = 0, **transformer_overrides):
    """A tiny Wan pipeline.

    Args:
        kind: ``"t2v"`` (``WanPipeline``, Wan 2.1), ``"i2v"`` (``WanImageToVideoPipeline`` with a CLIP
            image encoder, Wan 2.1), ``"t2v_moe"`` (Wan 2.2 A14B style: ``transformer`` and
            ``transformer_2`` switched at ``boundary_ratio``), ``"i2v_moe"`` (the Wan 2.2 I2V
            counterpart, no image encoder), ``"ti2v"`` (Wan 2.2 TI2V: per-token timesteps).
        seed: Seed of the random weights.
        transformer_overrides: Passed to :func:`tiny_wan_transformer` (e.g. ``num_attention_heads``).

    Raises:
        ValueError: unknown ``kind``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    kinds = ("t2v", "i2v", "t2v_moe", "i2v_moe", "ti2v")
    if kind not in kinds:
        raise ValueError(f"unknown tiny Wan pipeline kind {kind!r}; choose one of {kinds}")
    common = dict(tokenizer=tiny_tokenizer(), text_encoder=tiny_umt5_encoder(seed=seed), vae=tiny_wan_vae(seed),
                  scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    if kind == "t2v":
        return WanPipeline(transformer=tiny_wan_transformer(seed=seed, **transformer_overrides), **common)
    if kind == "ti2v":
        return WanPipeline(transformer=tiny_wan_transformer(seed=seed, **transformer_overrides),
                           expand_timesteps=True, **common)
    if kind == "t2v_moe":
        return WanPipeline(transformer=tiny_wan_transformer(seed=seed, **transformer_overrides),
                           transformer_2=tiny_wan_transformer(seed=seed + 1, **transformer_overrides),
                           boundary_ratio=0.875, **common)
    if kind == "i2v_moe":
        return WanImageToVideoPipeline(
            transformer=tiny_wan_transformer(in_channels=36, seed=seed, **transformer_overrides),
            transformer_2=tiny_wan_transformer(in_channels=36, seed=seed + 1, **transformer_overrides),
            boundary_ratio=0.9, image_encoder=None, image_processor=None, **common)
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8)).eval()
    image_processor = CLIPImageProcessor(crop_size=32, size=32)
    return WanImageToVideoPipeline(
        transformer=tiny_wan_transformer(in_channels=36, image_dim=4, seed=seed, **transformer_overrides),
        image_encoder=image_encoder, image_processor=image_processor, **common)


def default_cache_dir() -> Path:
    """Where the tiny default pipeline is saved: ``$DIFFUSERS_SP_CACHE`` or ``~/.cache/diffusers_sp``."""
    return Path(os.environ.get("DIFFUSERS_SP_CACHE", Path.home() / ".cache" / "diffusers_sp"))


def save_tiny_wan_pipeline(path: str | os.PathLike, kind: str = "t2v") -> Path:
    """Builds :func:`tiny_wan_pipeline` and saves it with safetensors to ``path`` (a folder); see
    :func:`save_tiny_pipeline`."""
    return save_tiny_pipeline(path, lambda: tiny_wan_pipeline(kind))


def save_tiny_pipeline(path: str | os.PathLike, build) -> Path:
    """Saves ``build()`` (a tiny pipeline) with safetensors to ``path`` (a folder) unless it is there.

    Writes to a temporary sibling folder and renames it, so concurrent callers never see a half-written
    pipeline. Returns ``path``.
    """
    path = Path(path)
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    build().save_pretrained(tmp, safe_serialization=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------------
# Tiny transformers of the other supported families. Sizes follow Diffusers' own unit
# tests; head counts are chosen so that Ulysses splits heads unevenly at 2 or 3 ranks.
# ---------------------------------------------------------------------------------------------


def tiny_flux_transformer(seed: int = 0, **overrides):
    """A ``FluxTransformer2DModel``: 3 heads of 16, one dual- and one single-stream block, in_channels 4."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
               num_attention_heads=3, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    cfg.update(overrides)
    return FluxTransformer2DModel(**cfg).eval()


def tiny_hunyuan_video_transformer(seed: int = 0, **overrides):
    """A ``HunyuanVideoTransformer3DModel``: 3 heads of 10, guidance embedding, one refiner layer."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=10, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
               text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))
    cfg.update(overrides)
    return HunyuanVideoTransformer3DModel(**cfg).eval()


def tiny_qwenimage_transformer(seed: int = 0, **overrides):
    """A ``QwenImageTransformer2DModel``: 5 heads of 16 (uneven over 2 and 3 ranks), two blocks."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
               num_attention_heads=5, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    cfg.update(overrides)
    return QwenImageTransformer2DModel(**cfg).eval()


def tiny_cogvideox_transformer(seed: int = 0, **overrides):
    """A ``CogVideoXTransformer3DModel`` (2b style: sin-cos positions, no RoPE): 5 heads of 16."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(num_attention_heads=5, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
               text_embed_dim=32, num_layers=2, sample_width=14, sample_height=10, sample_frames=1, patch_size=2,
               temporal_compression_ratio=4, max_text_seq_length=8)
    cfg.update(overrides)
    return CogVideoXTransformer3DModel(**cfg).eval()


def tiny_ltx_transformer(seed: int = 0, **overrides):
    """An ``LTXVideoTransformer3DModel``: 3 heads of 8, patch 1, cross-attention dim 24."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=3,
               attention_head_dim=8, cross_attention_dim=24, num_layers=2, caption_channels=32)
    cfg.update(overrides)
    return LTXVideoTransformer3DModel(**cfg).eval()


def tiny_mochi_transformer(seed: int = 0, **overrides):
    """A ``MochiTransformer3DModel``: 3 heads of 8, two blocks (the last one context-pre-only)."""
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(seed)
    cfg = dict(patch_size=2, num_attention_heads=3, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
               in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
               activation_fn="swiglu", max_sequence_length=16)
    cfg.update(overrides)
    return MochiTransformer3DModel(**cfg).eval()


def tiny_sd3_transformer(seed: int = 0, **overrides):
    """An ``SD3Transformer2DModel``: 3 heads of 8, two blocks (SD3.5 dual attention in the first)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    cfg = dict(sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
               num_attention_heads=3, caption_projection_dim=24, joint_attention_dim=32, pooled_projection_dim=64,
               out_channels=4, dual_attention_layers=(0,), qk_norm="rms_norm")
    cfg.update(overrides)
    return SD3Transformer2DModel(**cfg).eval()


# ---------------------------------------------------------------------------------------------
# Tiny pipelines of the other supported families. Sizes are chosen so that the default call in
# ``tests/cases_families.py`` gives 35 (5 x 7) image/video tokens, which divides neither 2 nor 3.
# ---------------------------------------------------------------------------------------------


def tiny_t5_encoder(d_model: int = 32, seed: int = 0):
    """A 2-layer ``T5EncoderModel`` with random weights (Flux, SD3, CogVideoX, LTX, Mochi)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=64, d_model=d_model, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return T5EncoderModel(cfg).eval()


def tiny_clip_text_encoder(hidden_size: int = 32, projection_dim: int | None = None, seed: int = 0):
    """A 2-layer ``CLIPTextModel`` (or ``CLIPTextModelWithProjection`` when ``projection_dim`` is set)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_size=hidden_size,
                         intermediate_size=32, num_attention_heads=2, num_hidden_layers=2, vocab_size=64,
                         max_position_embeddings=77, projection_dim=projection_dim or hidden_size)
    cls = CLIPTextModelWithProjection if projection_dim else CLIPTextModel
    return cls(cfg).eval()


def _flow_scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


def _tiny_kl_vae(latent_channels: int, seed: int):
    """An ``AutoencoderKL`` with one block (no downsampling) and ``latent_channels`` channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()


def tiny_flux_pipeline(seed: int = 0):
    """A tiny ``FluxPipeline`` (CLIP + T5, no-downsampling VAE): height 10, width 14 give 5 x 7 tokens."""
    from diffusers import FluxPipeline

    return FluxPipeline(transformer=tiny_flux_transformer(seed=seed, guidance_embeds=True),
                        text_encoder=tiny_clip_text_encoder(seed=seed), tokenizer=tiny_tokenizer(16),
                        text_encoder_2=tiny_t5_encoder(seed=seed), tokenizer_2=tiny_tokenizer(),
                        vae=_tiny_kl_vae(1, seed), scheduler=_flow_scheduler())


def tiny_sd3_pipeline(seed: int = 0):
    """A tiny ``StableDiffusion3Pipeline`` (two CLIPs with projection + T5): height 5, width 7 give 35 tokens."""
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(seed=seed), vae=_tiny_kl_vae(4, seed), scheduler=_flow_scheduler(),
        text_encoder=tiny_clip_text_encoder(16, projection_dim=32, seed=seed), tokenizer=tiny_tokenizer(8),
        text_encoder_2=tiny_clip_text_encoder(16, projection_dim=32, seed=seed + 1), tokenizer_2=tiny_tokenizer(8),
        text_encoder_3=tiny_t5_encoder(seed=seed), tokenizer_3=tiny_tokenizer())


def tiny_hunyuan_video_pipeline(seed: int = 0):
    """A tiny ``HunyuanVideoPipeline`` (Llama + CLIP, 16x spatial VAE): 1 frame of 80 x 112 gives 5 x 7 tokens.

    Call it with ``prompt_template={"template": "{}", "crop_start": 0}`` (the default template's
    crop offset is for the real Llama tokenizer).
    """
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    llama = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 5,
        up_block_types=("HunyuanVideoUpBlock3D",) * 5, block_out_channels=(8,) * 5, layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=16,
        temporal_compression_ratio=4, mid_block_add_attention=True).eval()
    return HunyuanVideoPipeline(text_encoder=llama, tokenizer=tiny_tokenizer(),
                                transformer=tiny_hunyuan_video_transformer(seed=seed), vae=vae,
                                scheduler=_flow_scheduler(shift=7.0),
                                text_encoder_2=tiny_clip_text_encoder(8, seed=seed), tokenizer_2=tiny_tokenizer(77))


def tiny_qwenimage_pipeline(seed: int = 0):
    """A tiny ``QwenImagePipeline`` (Qwen2.5-VL text encoder): 40 x 56 pixels give 5 x 7 tokens.

    The chat template is replaced by ``"{}"`` (its 34 dropped tokens assume the real tokenizer).
    """
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1000000.0),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=64, vision_start_token_id=60, vision_end_token_id=61, vision_token_id=62,
        image_token_id=63, video_token_id=59)
    encoder = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4).eval()
    pipe = QwenImagePipeline(transformer=tiny_qwenimage_transformer(seed=seed), vae=vae, scheduler=_flow_scheduler(),
                             text_encoder=encoder, tokenizer=tiny_tokenizer())
    pipe.prompt_template_encode = "{}"
    pipe.prompt_template_encode_start_idx = 0
    return pipe


def tiny_cogvideox_pipeline(seed: int = 0):
    """A tiny ``CogVideoXPipeline`` (T5, 2b-style transformer): 1 frame of 80 x 112 gives 5 x 7 tokens.

    Call it with ``max_sequence_length=8`` (the transformer's ``max_text_seq_length``).
    """
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4).eval()
    return CogVideoXPipeline(tokenizer=tiny_tokenizer(), text_encoder=tiny_t5_encoder(seed=seed), vae=vae,
                             transformer=tiny_cogvideox_transformer(seed=seed), scheduler=CogVideoXDDIMScheduler())


def tiny_ltx_pipeline(seed: int = 0):
    """A tiny ``LTXPipeline`` (T5, 32x spatial / 8x temporal VAE): 1 frame of 160 x 224 gives 5 x 7 tokens."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=4,
        patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    return LTXPipeline(scheduler=_flow_scheduler(), vae=vae, text_encoder=tiny_t5_encoder(seed=seed),
                       tokenizer=tiny_tokenizer(), transformer=tiny_ltx_transformer(seed=seed))


def tiny_mochi_pipeline(seed: int = 0):
    """A tiny ``MochiPipeline`` (T5, 8x spatial / 6x temporal VAE): 1 frame of 80 x 112 gives 5 x 7 tokens."""
    from diffusers import AutoencoderKLMochi, MochiPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLMochi(latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
                             decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1)).eval()
    return MochiPipeline(scheduler=_flow_scheduler(), vae=vae, text_encoder=tiny_t5_encoder(seed=seed),
                         tokenizer=tiny_tokenizer(), transformer=tiny_mochi_transformer(seed=seed))
