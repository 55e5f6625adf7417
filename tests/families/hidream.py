"""HiDream: HiDreamImageTransformer2DModel (double- and single-stream blocks, MoE feed-forward; text last,
no text mask).

A square latent is patchified into its own tokens (5 x 5 = 25); any other shape into ``max_seq`` tokens
(the config's ``max_resolution`` over the patch area: 7 x 7 = 49), the padding marked in
``hidden_states_masks``. 5 x 7 image tokens therefore split 49 tokens, 14 of them padding.
"""

import torch

from families import Forward, Pipe, gen

#: 3 heads of 16 (uneven over 2 ranks under Ulysses), one block of each kind, 3 experts (2 active).
TRANSFORMER = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
                   attention_head_dim=16, num_attention_heads=3, caption_channels=[32, 16], text_emb_dim=64,
                   num_routed_experts=3, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(14, 14),
                   llama_layers=[0, 1])
#: Tokens a non-square latent is padded to: (14 / 2) x (14 / 2).
MAX_SEQ = 49


def tiny_hidream_transformer(seed: int = 0):
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(seed)
    return HiDreamImageTransformer2DModel(**TRANSFORMER).eval()


def _forward(height: int, width: int):
    def build():
        g = gen()
        return tiny_hidream_transformer(), dict(
            hidden_states=torch.randn(2, 4, height, width, generator=g), timesteps=torch.tensor([500, 250]),
            encoder_hidden_states_t5=torch.randn(2, 6, 32, generator=g),
            # Every Llama layer's hidden states, [layers, B, T, C]; the blocks read llama_layers [0, 1].
            encoder_hidden_states_llama3=torch.randn(3, 2, 5, 16, generator=g),
            pooled_embeds=torch.randn(2, 64, generator=g))
    return build


FORWARDS = {
    "square": Forward(_forward(10, 10), tokens=25),  # 5 x 5 tokens, no padding mask
    "padded": Forward(_forward(10, 14), tokens=MAX_SEQ),  # 5 x 7 tokens padded to 49
}


def tiny_hidream_pipeline(seed: int = 0):
    """A tiny ``HiDreamImagePipeline``: two CLIPs with projection (pooled 32 + 32), T5, a 3-layer Llama,
    a VAE without downsampling (10 x 14 pixels: 5 x 7 tokens, padded to 49)."""
    from diffusers import HiDreamImagePipeline
    from transformers import LlamaConfig, LlamaForCausalLM

    from diffusers_sp import tiny_models as tm

    torch.manual_seed(seed)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    pipe = HiDreamImagePipeline(
        scheduler=tm._flow_scheduler(), vae=tm._tiny_kl_vae(4, seed),
        text_encoder=tm.tiny_clip_text_encoder(16, projection_dim=32, seed=seed), tokenizer=tm.tiny_tokenizer(16),
        text_encoder_2=tm.tiny_clip_text_encoder(16, projection_dim=32, seed=seed + 1),
        tokenizer_2=tm.tiny_tokenizer(16), text_encoder_3=tm.tiny_t5_encoder(seed=seed),
        tokenizer_3=tm.tiny_tokenizer(), text_encoder_4=llama, tokenizer_4=tm.tiny_tokenizer(),
        transformer=tiny_hidream_transformer(seed))
    # The pipeline rescales every requested size to the area of default_sample_size**2 latent pixels
    # (128: 1024 x 1024 images); 12**2 = 144 keeps 10 x 14 (scale 1.01, rounded down to even sizes).
    pipe.default_sample_size = 12
    return pipe


PIPELINES = {
    "HiDreamImagePipeline": Pipe(tiny_hidream_pipeline, lambda: dict(height=10, width=14, max_sequence_length=8,
                                                                     guidance_scale=5.0), tokens=MAX_SEQ),
}
