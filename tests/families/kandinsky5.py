"""Kandinsky 5: Kandinsky5Transformer3DModel (video self-attention between text blocks and the output layer;
text in cross-attention, no text mask)."""

import torch

import families
from families import Forward, Pipe, gen


def _transformer(seed: int = 0, visual_cond: bool = False):
    """3 heads of 16 (RoPE axes 4 + 6 + 6), one text block and two visual blocks, model width 48; text widths
    of the tiny encoders below (Qwen2.5-VL 16, CLIP 8). Diffusers zero-initialises the modulations (a
    fresh model adds nothing in its blocks); here they get random weights, as a trained model has."""
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(seed)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=48, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
        visual_cond=visual_cond).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modulation" in name:
                param.normal_(0.0, 0.2)
            elif "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model


def _forward(frames: int, height: int, width: int, visual_cond: bool = False):
    """Two samples (text of 6 tokens), latents ``[B, T, H, W, C]`` of ``frames x height x width`` patches."""
    def build():
        g = gen()
        channels = 9 if visual_cond else 4
        return _transformer(visual_cond=visual_cond), dict(
            hidden_states=torch.randn(2, frames, 2 * height, 2 * width, channels, generator=g),
            encoder_hidden_states=torch.randn(2, 6, 16, generator=g), timestep=torch.tensor([900.0, 300.0]),
            pooled_projections=torch.randn(2, 8, generator=g),
            visual_rope_pos=[torch.arange(frames), torch.arange(height), torch.arange(width)],
            text_rope_pos=torch.arange(6), scale_factor=(1.0, 2.0, 2.0))
    return build


FORWARDS = {"t2v": Forward(_forward(5, 1, 7), modes=("ulysses", "kv_gather", "vsa")),
            "i2v_visual_cond": _forward(1, 5, 7, visual_cond=True)}


# ------------------------------------------------------------------ tiny pipelines
# Video pipelines: the tiny HunyuanVideo VAE compresses 16x in space (160 x 224 pixels, one frame: 5 x 7
# patches); image pipelines: a fixed 8x (an AutoencoderKL of 4 blocks; 80 x 112 pixels). 35 tokens each.


def _text_parts(seed: int = 0) -> dict:
    """A tiny Qwen2.5-VL (its last hidden states, 16 wide) with the word tokenizer, and a CLIP of width 8."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    qwen = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1000000.0),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=64, vision_start_token_id=60, vision_end_token_id=61, vision_token_id=62,
        image_token_id=63, video_token_id=59)).eval()
    return dict(text_encoder=qwen, tokenizer=tm.tiny_tokenizer(), text_encoder_2=tm.tiny_clip_text_encoder(8, seed=seed),
                tokenizer_2=tm.tiny_tokenizer(77))


def _image_vae(seed: int = 0):
    """An ``AutoencoderKL`` of 4 blocks (8x, as the image pipelines assume), 4 latent channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(4, 4, 4, 4), layers_per_block=1,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         latent_channels=4, norm_num_groups=1).eval()


def _build(name: str, video: bool, visual_cond: bool = False):
    def build():
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        from diffusers_sp import tiny_models as tm

        vae = tm.tiny_hunyuan_video_pipeline().vae if video else _image_vae()
        pipe = getattr(diffusers, name)(transformer=_transformer(visual_cond=visual_cond), vae=vae,
                                        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), **_text_parts())
        pipe.prompt_template, pipe.prompt_template_encode_start_idx = "{}", 0  # the real template fits Qwen's tokenizer
        if not video:
            pipe.resolutions = [(112, 80)]  # (width, height): the image pipelines resize to one of these
        return pipe
    return build


def _call(**extra):
    return dict(max_sequence_length=12, guidance_scale=3.0, negative_prompt=["bad", "blurry video"], **extra)


PIPELINES = {
    "Kandinsky5T2VPipeline": Pipe(_build("Kandinsky5T2VPipeline", video=True), lambda: _call(
        height=160, width=224, num_frames=1)),
    # 17 frames, 5 latent frames of 1 x 7 (with one latent frame the pipeline returns a (latents, message) pair).
    "Kandinsky5I2VPipeline": Pipe(_build("Kandinsky5I2VPipeline", video=True, visual_cond=True), lambda: _call(
        image=families.image(224, 32), height=32, width=224, num_frames=17)),
    "Kandinsky5T2IPipeline": Pipe(_build("Kandinsky5T2IPipeline", video=False), lambda: _call(height=80, width=112)),
    "Kandinsky5I2IPipeline": Pipe(_build("Kandinsky5I2IPipeline", video=False, visual_cond=True), lambda: _call(
        image=[families.image(112, 80), families.image(112, 80, seed=1)], height=80, width=112)),  # one per prompt
}
