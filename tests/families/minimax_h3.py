"""MiniMax-H3: MiniMaxH3Transformer3DModel (text, audio and video rows packed into one sequence, split
whole). No family module: it runs through its Diffusers ``_cp_plan`` (diffusers_sp.pipelines.cp_plan),
whose split starts at the first block, after the text refiner. Diffusers has only a ModularPipeline
for it (no pipeline class), so its forward is what is compared."""

import torch

from families import gen, randomize_norms


def tiny_transformer(seed: int = 0, **overrides):
    """A ``MiniMaxH3Transformer3DModel``: 3 heads of 16, two blocks and one refiner block, patch (1, 2, 2)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    cfg = dict(num_attention_heads=3, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1,
               ffn_dim=32, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=16, freq_dim=32,
               time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
    cfg.update(overrides)
    return randomize_norms(MiniMaxH3Transformer3DModel(**cfg).eval())


def _forward():
    """The packed layout of Diffusers' MiniMax-H3 blocks: [text (6); a conditioning frame (5); audio
    (3 latents x 3 channels); video (3 frames of 1 x 5)] = 35 rows, a batch of one request. The
    conditioning rows take the second timestep (0)."""
    g = gen()
    text, cond, audio, video = 6, 5, 9, 15
    length = text + cond + audio + video
    video_indices = torch.cat([torch.arange(text, text + cond), torch.arange(text + cond + audio, length)])
    audio_indices = torch.arange(text + cond, text + cond + audio)
    token_tags = torch.zeros(length, dtype=torch.long)
    token_tags[:text], token_tags[audio_indices] = 1, 2
    timestep_indices = torch.zeros(length, dtype=torch.long)
    timestep_indices[text:text + cond] = 1
    position_ids = torch.randint(0, 12, (length, 3), generator=g).double()
    return tiny_transformer(), dict(
        hidden_states=torch.randn(1, cond + video, 16, generator=g), audio_hidden_states=torch.randn(1, audio, 4, generator=g),
        encoder_hidden_states=torch.randn(1, text, 16, generator=g), timestep=torch.tensor([0.7, 0.0]),
        timestep_indices=timestep_indices, token_tags=token_tags, position_ids=position_ids,
        video_indices=video_indices, audio_indices=audio_indices, text_indices=torch.arange(text))


FORWARDS = {"packed": _forward}
