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


def tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over a small English vocabulary (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)


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
    return WanTransformer3DModel(**cfg).eval()


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
    """Builds :func:`tiny_wan_pipeline` and saves it with safetensors to ``path`` (a folder).

    Writes to a temporary sibling folder and renames it, so concurrent callers never see a half-written
    pipeline. Returns ``path``.
    """
    path = Path(path)
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tiny_wan_pipeline(kind).save_pretrained(tmp, safe_serialization=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
