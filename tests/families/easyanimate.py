"""EasyAnimate: EasyAnimateTransformer3DModel (joint attention, text first, no text mask; 3-D RoPE made by the
model; inpaint and control latents joined along the channels)."""

import torch

from families import Forward, Pipe, gen


def _transformer(in_channels: int = 4, seed: int = 0):
    """An ``EasyAnimateTransformer3DModel``: 3 heads of 16 (uneven over 2 ranks), two blocks, patch 2, 4 latent
    channels out (``in_channels`` in), text width 32 (the tiny BERT's)."""
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(seed)
    return EasyAnimateTransformer3DModel(num_attention_heads=3, attention_head_dim=16, in_channels=in_channels,
                                         out_channels=4, patch_size=2, num_layers=2, mmdit_layers=2, time_embed_dim=16,
                                         text_embed_dim=32).eval()


def _forward(in_channels: int = 4):
    """One latent frame of 10 x 14 at patch 2 (5 x 7 tokens), or 2 frames of 5 x 7 with 9 channels (the inpaint
    model's 4 + 5 joined in the forward); two prompts of 7 text tokens."""
    g = gen()
    frames = 1 if in_channels == 4 else 2
    kwargs = dict(hidden_states=torch.randn(2, 4, frames, 10, 14, generator=g), timestep=torch.tensor([500, 250]),
                  encoder_hidden_states=torch.randn(2, 7, 32, generator=g))
    if in_channels != 4:
        kwargs["inpaint_latents"] = torch.randn(2, in_channels - 4, frames, 10, 14, generator=g)
    return _transformer(in_channels), kwargs


FORWARDS = {"": _forward, "inpaint_latents": Forward(lambda: _forward(9), tokens=70)}


def _vae():
    """An ``AutoencoderKLMagvit`` of four blocks (8 x spatial, 4 x temporal down) and 4 latent channels."""
    from diffusers import AutoencoderKLMagvit

    torch.manual_seed(0)
    vae = AutoencoderKLMagvit(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                              norm_num_groups=2).eval()
    # The inpaint pipeline reads `cache_mag_vae`, a key of the released checkpoints' VAE config that the
    # class does not register (an AttributeError in one process too).
    vae.register_to_config(cache_mag_vae=True)
    return vae


def _build(cls_name: str, in_channels: int = 4):
    """``() -> pipeline``: a two-layer BERT (the pipelines read its second-to-last hidden states) over the tiny
    word tokenizer with a chat template that joins the texts, :func:`_vae`, and a transformer of
    ``in_channels``."""
    def build():
        import diffusers
        from transformers import BertConfig, BertModel

        from diffusers_sp import tiny_models as tm

        torch.manual_seed(0)
        bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    vocab_size=64), add_pooling_layer=False).eval()
        tokenizer = tm.tiny_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}"
        return getattr(diffusers, cls_name)(transformer=_transformer(in_channels), vae=_vae(), text_encoder=bert,
                                            tokenizer=tokenizer, scheduler=tm._flow_scheduler())
    return build


def _control_pipeline():
    """The control pipeline, its ``encode_prompt`` taking the ``text_encoder_index`` that Diffusers 0.42.1's
    ``EasyAnimateControlPipeline.__call__`` passes it (a TypeError in one process otherwise; the index is
    meaningless for its one text encoder)."""
    pipe = _build("EasyAnimateControlPipeline", in_channels=12)()
    encode = pipe.encode_prompt
    pipe.encode_prompt = lambda *args, text_encoder_index=0, **kwargs: encode(*args, **kwargs)
    return pipe


def _call(**extra):
    """One frame of 80 x 112 pixels: 10 x 14 latents, 5 x 7 tokens at patch 2; CFG folded into the batch."""
    return {"height": 80, "width": 112, "num_frames": 1, "guidance_scale": 4.0,
            "negative_prompt": ["rain", "snow at night over the city"], **extra}


def _video(seed: int = 0):
    """A ``[1, 3, 1, 80, 112]`` video in [0, 1]."""
    return torch.rand(1, 3, 1, 80, 112, generator=gen(seed))


#: One prompt for the pipelines of one input video (their latents are not repeated per prompt).
_ONE = dict(prompt="a cat runs on the grass under the blue sky", negative_prompt="rain")

PIPELINES = {
    "EasyAnimatePipeline": Pipe(_build("EasyAnimatePipeline"), _call),
    # Image to video: the first frame kept (mask 0), inpaint latents (1 mask + 4 video channels) joined.
    "EasyAnimateInpaintPipeline": Pipe(_build("EasyAnimateInpaintPipeline", in_channels=9), lambda: _call(
        video=_video(), mask_video=torch.zeros(1, 1, 1, 80, 112), **_ONE)),
    "EasyAnimateControlPipeline": Pipe(_control_pipeline, lambda: _call(
        control_video=_video(1), **_ONE)),
}
