"""LTX-2: LTX2VideoTransformer3DModel (video and audio; text in cross-attention, text mask).

Tiny components from their real config classes: a Gemma 3 text encoder, the text connectors, the
LTX-2 video VAE (patch 8 and two 2x stages: 32x spatial, 4x temporal compression), the audio VAE and
vocoder. 35 video tokens per forward: 5 x 7 in the forwards; 5 latent frames of 1 x 7 (32 x 224
pixels) in the pipelines, appended conditions, references and keyframe slots included. The audio
tokens stay whole on every rank.
"""

import torch

from diffusers_sp import tiny_models as tm
from families import Modular, Pipe, Refusal, gen, image, ragged_mask

#: The tiny transformer: 4 video heads of 8 (uneven over 3 ranks under Ulysses), 2 audio heads of 8.
TRANSFORMER = dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=4,
                   attention_head_dim=8, cross_attention_dim=32, audio_in_channels=4, audio_out_channels=4,
                   audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                   num_layers=2, caption_channels=16, rope_double_precision=False, vae_scale_factors=(4, 32, 32))


def tiny_ltx2_transformer(seed: int = 0, **overrides):
    """An ``LTX2VideoTransformer3DModel`` of :data:`TRANSFORMER` (``overrides`` on top)."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(**{**TRANSFORMER, **overrides}).eval()
    if model.config.use_keyframes_abs_pos_embedding:  # zero at init: give the keyframe marker an effect
        torch.nn.init.normal_(model.keyframes_abs_pos_embedding, std=0.1)
    return model


def _gemma3(seed: int):
    """A 2-layer ``Gemma3ForConditionalGeneration`` (hidden size 16, a 1-layer vision tower it never runs)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Gemma3Config(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         sliding_window=8),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(cfg).eval()


def ltx2_components(seed: int = 0, **transformer_overrides) -> dict:
    """The components every LTX-2 pipeline takes (text encoder, tokenizer, connectors, video and audio
    VAE, vocoder, scheduler, transformer)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split").eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 2, decoder_block_out_channels=(8, 8), layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False,) * 3,
        downsample_type=("spatiotemporal", "spatiotemporal"), upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False), upsample_factor=(1, 1), timestep_conditioning=False, patch_size=8,
        patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).eval()
    torch.manual_seed(seed)
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4],
                          upsample_factors=[2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000).eval()
    return dict(scheduler=tm._flow_scheduler(), vae=vae, audio_vae=audio_vae, text_encoder=_gemma3(seed),
                tokenizer=tm.tiny_tokenizer(), connectors=connectors, vocoder=vocoder,
                transformer=tiny_ltx2_transformer(seed, **transformer_overrides))


def _pipeline(name: str, **transformer_overrides):
    def build():
        import diffusers

        return getattr(diffusers, name)(**ltx2_components(**transformer_overrides))

    return build


def _forward():
    """LTX-2.0 layout (interleaved RoPE, computed inside from the grid): per-token video timesteps (the first
    frame's 7 tokens at 0, as image-to-video makes them) with ``use_cross_timestep=False``, so the per-token
    timestep also drives the audio-video cross-attention modulation; 9 audio tokens."""
    g = gen()
    timestep = torch.tensor([500.0, 250.0])[:, None].expand(2, 35).clone()
    timestep[:, :7] = 0.0
    return tiny_ltx2_transformer(rope_type="interleaved"), dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), audio_hidden_states=torch.randn(2, 9, 4, generator=g),
        encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        audio_encoder_hidden_states=torch.randn(2, 7, 16, generator=g), timestep=timestep,
        audio_timestep=torch.tensor([500.0, 250.0]), encoder_attention_mask=ragged_mask([7, 4], 7),
        audio_encoder_attention_mask=ragged_mask([7, 4], 7), num_frames=1, height=5, width=7, audio_num_frames=9,
        use_cross_timestep=False)


def _forward_ltx23():
    """LTX-2.3/2.5 layout: split RoPE ([B, H, S, D / 2] tables) from coordinates passed in (5 latent frames of
    1 x 7), gated attention, prompt modulation, perturbed attention with STG on block 1 for the first sample,
    and the keyframe marker on the last frame's tokens."""
    g = gen(2)
    model = tiny_ltx2_transformer(rope_type="split", gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                                  audio_cross_attn_mod=True, perturbed_attn=True, use_keyframes_abs_pos_embedding=True)
    coords = model.rope.prepare_video_coords(2, 5, 1, 7, torch.device("cpu"), fps=24.0)
    keyframes = torch.zeros(2, 35, 1)
    keyframes[:, 28:] = 1.0
    sigma = torch.tensor([700.0, 300.0])
    return model, dict(
        hidden_states=torch.randn(2, 35, 4, generator=g), audio_hidden_states=torch.randn(2, 10, 4, generator=g),
        encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
        audio_encoder_hidden_states=torch.randn(2, 6, 16, generator=g), timestep=sigma, sigma=sigma,
        encoder_attention_mask=ragged_mask([6, 3], 6), audio_encoder_attention_mask=ragged_mask([6, 3], 6),
        video_coords=coords, audio_num_frames=10, spatio_temporal_guidance_blocks=[1],
        perturbation_mask=torch.tensor([0.0, 1.0]), video_keyframes_mask=keyframes, use_cross_timestep=True)


FORWARDS = {"ragged_prompts": _forward, "ltx23_split_rope": _forward_ltx23}


def _conditions(*specs):
    """``LTX2VideoCondition``s of random images (``(index, strength, seed)`` each), without the H.264
    re-compression (PyAV is not needed)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    return [LTX2VideoCondition(frames=image(224, 32, seed), index=index, strength=strength, crf=0)
            for index, strength, seed in specs]


def _reference(cls_name: str):
    from diffusers.pipelines.ltx2 import pipeline_ltx2_hdr_lora, pipeline_ltx2_ic_lora

    cls = {"LTX2ReferenceCondition": pipeline_ltx2_ic_lora.LTX2ReferenceCondition,
           "LTX2HDRReferenceCondition": pipeline_ltx2_hdr_lora.LTX2HDRReferenceCondition}[cls_name]
    return [cls(frames=image(224, 32, 2))]


def _dfr_temporal_refine():
    """``LTX2DFRTemporalRefinePipeline``: its ancestral scheduler and a temporal latent upsampler."""
    import diffusers
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    components = ltx2_components(use_keyframes_abs_pos_embedding=True)
    torch.manual_seed(0)
    components["temporal_latent_upsampler"] = LTX2LatentUpsamplerModel(
        in_channels=4, mid_channels=32, num_blocks_per_stage=1, dims=3, spatial_upsample=False,
        temporal_upsample=True).eval()
    components["scheduler"] = diffusers.LTXEulerAncestralRFScheduler(eta=0.5)
    return diffusers.LTX2DFRTemporalRefinePipeline(**components)


def _previous_dfr_pass():
    """What a 5-frame DFR pass hands a refine round (random latents of its shapes): 2 latent frames of
    1 x 7, one keyframe slot at pixel frame 4, 6 audio latents. The round makes one tile of 3 latent
    frames, an anchor and a slot: 35 tokens."""
    g = gen(5)
    return dict(latents=torch.randn(2, 4, 2, 1, 7, generator=g),
                keyframes_latents=torch.randn(2, 4, 1, 1, 7, generator=g), keyframe_positions=[4],
                audio_latents=torch.randn(2, 2, 6, 2, generator=g))


#: 32 x 224 pixels are 1 x 7 latent tokens a frame; 17 frames are 5 latent frames, 13 frames 4.
_GRID = dict(height=32, width=224, frame_rate=24.0, max_sequence_length=8)
#: Guidance by CFG (folded into the batch) only: the STG and modality-isolation passes run in LTX2Pipeline's
#: case; the audio scales fall back to the video ones when 0 (``audio_stg_scale or stg_scale``).
_CFG_ONLY = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)

PIPELINES = {
    # CFG folded into the batch, STG (on a block the tiny model lacks) and modality-isolation passes.
    "LTX2Pipeline": Pipe(_pipeline("LTX2Pipeline"), lambda: dict(num_frames=17, **_GRID)),
    # The first frame's 7 tokens at timestep 0 (per-token timesteps, split with the tokens).
    "LTX2ImageToVideoPipeline": Pipe(_pipeline("LTX2ImageToVideoPipeline"), lambda: dict(
        image=image(224, 32), image_crf=0, num_frames=17, **_CFG_ONLY, **_GRID)),
    # 4 latent frames (the first one conditioned) and a keyframe at latent frame 2 appended: 35 tokens.
    "LTX2ConditionPipeline": Pipe(_pipeline("LTX2ConditionPipeline"), lambda: dict(
        conditions=_conditions((0, 1.0, 0), (2, 0.5, 1)), num_frames=13, **_CFG_ONLY, **_GRID)),
    # 4 latent frames and a 1-frame reference video appended (timestep 0): 35 tokens.
    "LTX2InContextPipeline": Pipe(_pipeline("LTX2InContextPipeline"), lambda: dict(
        reference_conditions=_reference("LTX2ReferenceCondition"), num_frames=13, **_CFG_ONLY, **_GRID)),
    # Video only, no CFG by default; a 1-frame reference appended: 35 tokens.
    "LTX2HDRPipeline": Pipe(_pipeline("LTX2HDRPipeline"), lambda: dict(
        reference_conditions=_reference("LTX2HDRReferenceCondition"), num_frames=13, **_GRID)),
    # 4 latent frames and one generated keyframe slot (video_keyframes_mask): 35 tokens; 2 distilled steps.
    "LTX2DFRPipeline": Pipe(_pipeline("LTX2DFRPipeline", use_keyframes_abs_pos_embedding=True),
                            lambda: dict(num_frames=13, sigmas=[1.0, 0.5], **_GRID)),
    # One refine round over a previous pass (x2 in time, ancestral steps seeded per tile): one tile of 35 tokens.
    "LTX2DFRTemporalRefinePipeline": Pipe(_dfr_temporal_refine, lambda: dict(
        num_frames=5, sigmas=[0.975, 0.5], **_previous_dfr_pass(), **_GRID)),
}

REFUSALS = {
    # A reference at attention strength below 1 makes a [B, S, S] video self-attention mask: refused at the call.
    "LTX2InContextPipeline": Refusal(_pipeline("LTX2InContextPipeline"), lambda: dict(
        reference_conditions=_reference("LTX2ReferenceCondition"), conditioning_attention_strength=0.5,
        num_frames=13, **_CFG_ONLY, **_GRID), match="video_self_attention_mask"),
}


# Modular pipelines (diffusers.modular_pipelines) run with the components and call of a classic case.
MODULAR = {
    "LTX2ModularPipeline": Modular("LTX2Pipeline"),
    "LTX25ModularPipeline": Modular("LTX2Pipeline"),
}
