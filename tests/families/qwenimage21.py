"""QwenImage 2.1: QwenImage21Transformer2DModel (single stream, block-causal: [text and condition images;
target image], the target split, the prefix whole; text key mask).

The target must be a multiple of 4 tokens (each vision-language slot stands for 2 x 2 latent tokens), so
the split length is even over 2 ranks: 4 x 7 = 28 tokens in the forwards, 4 x 10 = 40 in the pipeline
(uneven over 3 ranks).
"""

import torch

import families
from families import Forward, Modular, Pipe, gen

#: 3 heads of 16, two blocks, text features of 16 channels, 4 latent channels (patch 1).
TRANSFORMER = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                   num_attention_heads=3, context_in_dim=16, axes_dims_rope=(4, 6, 6))


def tiny_qwenimage21_transformer(seed: int = 0, **overrides):
    """A ``QwenImage21Transformer2DModel`` of :data:`TRANSFORMER` (its zero-centred norms drawn around 0)."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**{**TRANSFORMER, **overrides}).eval()
    with torch.no_grad():
        model.txt_in.text_norm.weight.normal_(0.0, 0.5)  # stored as scale - 1 (zeros at init)
    return families.randomize_norms(model)


def _forward(condition: bool, **overrides):
    """Two ragged prompts (9 and 6 valid text positions) and a 4 x 7 target (7 slots). With ``condition``,
    a 2 x 4 condition image (2 slots) sits between the text's first 3 and last 4 positions, as the
    vision-language encoder lays it out: ``[3 text; 8 image; 4 text; 28 target]``."""
    def build():
        g = gen()
        text = [True] * 9 if not condition else [True] * 3 + [False] * 2 + [True] * 4
        slots = torch.tensor([not t for t in text] + [True] * 7)
        valid = [9, 6] if not condition else [7, 5]  # text positions of each sample that are not padding
        mask = torch.zeros(2, len(text), dtype=torch.bool)
        for b, n in enumerate(valid):
            mask[b, [i for i, t in enumerate(text) if t][:n]] = True
        mask[:, [i for i, t in enumerate(text) if not t]] = True  # the image slots are valid
        shapes = [(1, 2, 4), (1, 4, 7)] if condition else [(1, 4, 7)]
        latents = sum(h * w for _, h, w in shapes)
        return tiny_qwenimage21_transformer(**overrides), dict(
            hidden_states=torch.randn(2, latents, 4, generator=g),
            encoder_hidden_states=torch.randn(2, len(text), 16, generator=g), timestep=torch.tensor([0.5, 0.25]),
            img_shapes=[shapes] * 2, img_mask=slots[None].expand(2, -1), encoder_hidden_states_mask=mask)
    return build


FORWARDS = {
    "": Forward(_forward(False), tokens=28),
    "condition": Forward(_forward(True), tokens=28),
    # Every token modulated from the sampled timestep (no t = 0 rows, no per-token modulation mask).
    "no_causal_condition": Forward(_forward(True, causal_condition=False), tokens=28),
}


# ------------------------------------------------------------------ tiny pipeline
# The pipeline's VAE factor is 16 and sizes are rounded to multiples of 32: 64 x 160 pixels give a
# 4 x 10 latent, 40 target tokens.

H, W = 64, 160


def _vl_tokenizer():
    """A word-level tokenizer with Qwen3-VL's chat and vision tokens (``<|im_start|>`` 58 ...
    ``<|video_pad|>`` 63), the words at the ids of ``tm.tiny_tokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from diffusers_sp import tiny_models as tm

    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    vocab = dict(tm.tiny_tokenizer().get_vocab())
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), 58)})
    vocab.update({t: 58 + i for i, t in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    out.add_special_tokens({"additional_special_tokens": specials})  # kept whole by the pre-tokenizer
    return out


def _vl_processor():
    """A ``Qwen3VLProcessor`` over :func:`_vl_tokenizer` with a chat template of the real one's shape
    (the pipeline drops the system message's tokens, counted with it)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class TinyQwen3VLProcessor(Qwen3VLProcessor):
        """Without a video processor: Transformers checks the class of every sub-processor, and the base
        class of video processors needs torchvision, which is not installed; the pipeline passes text."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{{ c['text'] }}"
                "{% endfor %}<|im_end|>\n{% endfor %}")
    return TinyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2),
                                tokenizer=_vl_tokenizer(), chat_template=template)


def _vl_encoder(seed: int = 0):
    """A ``Qwen3VLForConditionalGeneration``: 2 text layers of 16 channels, a 1-layer vision tower."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=62, video_token_id=63, vision_start_token_id=60, vision_end_token_id=61)
    return Qwen3VLForConditionalGeneration(cfg).eval()


def _vae(seed: int = 0):
    """An ``AutoencoderKLQwenImage21`` with 16x spatial compression and 4 latent channels."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1],
                                    num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                    latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()


def tiny_qwenimage21_pipeline(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(seed),
                               text_encoder=_vl_encoder(seed), processor=_vl_processor(),
                               transformer=tiny_qwenimage21_transformer(seed))


PIPELINES = {
    # True CFG (two transformer calls per step) and the pipeline's K/V cache: step 0 runs the whole
    # sequence and stores the prefix K/V, step 1 the target alone over the cached prefix.
    "QwenImage21Pipeline": Pipe(tiny_qwenimage21_pipeline, lambda: dict(
        height=H, width=W, negative_prompt=["", "a"], true_cfg_scale=4.0), tokens=40),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "QwenImage21ModularPipeline": Modular("QwenImage21Pipeline"),
    "QwenImage21TurboModularPipeline": Modular("QwenImage21Pipeline"),
}
