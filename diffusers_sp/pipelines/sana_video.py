"""Sana-Video (text-to-video, image-to-video) for sequence parallelism.

``SanaVideoTransformer3DModel`` is Sana's video model (``transformer_sana_video.py``); like Sana
(:mod:`diffusers_sp.pipelines.sana`), two of its parts are not dense softmax attention plus per-token work:

* Self-attention (``attn1``, ``SanaLinearAttnProcessor3_0``) is *linear* attention, with RoPE on the
  features: with ReLU feature maps ``phi``, token ``i``'s output is
  ``(sum_j v_j rope(phi(k_j))^T) rope(phi(q_i)) / (sum_j phi(k_j))^T phi(q_i)``. The keys and values
  enter only through two sums over the tokens, ``V K_rot^T`` (``[B, H, D, D]``) and ``sum(K)``
  (``[B, H, D, 1]``): each rank sums over its own tokens, one all-reduce adds the ranks' sums (exact up
  to the order of the additions) and each rank applies them to its own queries, in both dense modes.
  Sana's :class:`~diffusers_sp.processors.linear.LinearAttnProcessor` all-reduces the first matrix
  product over the tokens, which is the whole state for Sana's processor (its normaliser is a row of
  the same product) but not for this one, whose ``sum(K)`` is a reduction of its own: so
  :class:`SanaVideoLinearAttnProcessor` runs :func:`sana_video_linear_attention`, the processor's
  computation with both sums handed to one all-reduce (bit-identical to the processor at one rank).
* The feed-forward (``ff``, ``GLUMBTempConv``) is a convolution over the latent grid: the block
  unflattens its tokens into ``[B, F, H, W, C]`` with its ``frames``, ``height`` and ``width``
  arguments, and the output at a token depends on the 3 x 3 tokens around it in its frame (a
  depthwise convolution) and on the frames before and after it (a temporal convolution of 3). The
  blocks get ``(1, S_r, 1)`` for them (:class:`~diffusers_sp.grid_window.GridSide`), so that their
  local tokens unflatten; :class:`SanaFeedForwardHook` runs the module on whole frames: the rank's
  frames and one on either side, completed with the neighbouring ranks' tokens by Sana's grid window
  (:class:`~diffusers_sp.grid_window.GridWindowHook` over a grid whose rows are frames: one all-gather of
  at most two frames from each end of every shard), and returns the rank's tokens.

Sharding plan (explicit; Diffusers 0.42 ships no ``_cp_plan`` for this model): split the RoPE tables
``rope`` returns (``[1, S, 1, D]`` cos and sin, dim 1), the patchified hidden states at the first block
(``[B, S, C]``, dim 1), at every block its grid sides and its modulation, and the modulation at
``norm_out`` (``[B, S, 6C]`` and ``[B, S, C]`` when the timestep is per token, as the image-to-video
pipeline passes it with a zero timestep for the first frame; one row per sample, ``[B, 1, .]``,
passes whole: :class:`~diffusers_sp.plan_entries.SplitUnlessBroadcast`), ControlNet residuals at the model
input; gather ``proj_out``. Cross-attention (``attn2``, video queries over the text) needs no
communication.

VSA is refused: it takes over softmax attention calls, and this self-attention is linear.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ..comm import all_reduce_sum
from ..processors.base import SequenceParallelAttnProcessor
from ..grid_window import GridSide, GridWindow, GridWindowHook
from ..plan_entries import SplitUnlessBroadcast
from ..errors import SequenceParallelConfigError
from ..kernels.rope import rope_adjacent_pairs
from .spec import CONTROLNET_RESIDUALS, FamilySpec

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_ROPE = ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)
_MODULATION = SplitUnlessBroadcast(_TOKENS)


def sana_video_linear_attention(inner, attn, args: tuple, kwargs: dict, sum_over_ranks):
    """Sana-Video's linear self-attention on this rank's tokens, its sums over the tokens added over the ranks.

    The operations of Diffusers' ``SanaLinearAttnProcessor3_0`` (0.42), in its order (the RoPE by
    :func:`~diffusers_sp.kernels.rope.rope_adjacent_pairs`, bit-identical to its local function), except that
    ``V K_rot^T`` and ``sum(K)`` over this rank's tokens go through ``sum_over_ranks`` (one call: they are
    joined along the last dim) before they meet the queries.

    Args:
        inner: The model's processor (declined unless a plain ``SanaLinearAttnProcessor3_0``).
        attn: The ``Attention`` module (``attn1``).
        args, kwargs: The processor call's arguments: ``hidden_states`` ``[B, S_r, C]``, ``rotary_emb``
            (cos, sin) ``[1, S_r, 1, D]``.
        sum_over_ranks: ``x -> the sum over the ranks of x``.

    Returns:
        ``[B, S_r, C]``, the block's attention output for this rank's tokens.

    Raises:
        SequenceParallelConfigError: another processor, encoder states (cross-attention) or no RoPE.
    """
    from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0

    names = ("hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb")
    call = {**dict(zip(names, args)), **kwargs}
    if type(inner) is not SanaLinearAttnProcessor3_0 or call.get("encoder_hidden_states") is not None \
            or call.get("rotary_emb") is None:
        raise SequenceParallelConfigError(
            f"{type(inner).__name__}: Sana-Video's sequence-parallel self-attention runs the linear attention of "
            f"SanaLinearAttnProcessor3_0 over the video tokens with RoPE; this call is another one.")
    hidden_states, rotary_emb = call["hidden_states"], call["rotary_emb"]
    original_dtype = hidden_states.dtype
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    query = torch.relu(query.unflatten(2, (attn.heads, -1)))
    key = torch.relu(key.unflatten(2, (attn.heads, -1)))
    value = value.unflatten(2, (attn.heads, -1))
    query_rotate, key_rotate = rope_adjacent_pairs(query, *rotary_emb), rope_adjacent_pairs(key, *rotary_emb)
    query, key = query.permute(0, 2, 3, 1), key.permute(0, 2, 3, 1)  # [B, H, D, S_r]
    query_rotate, key_rotate = query_rotate.permute(0, 2, 3, 1).float(), key_rotate.permute(0, 2, 3, 1).float()
    value = value.permute(0, 2, 3, 1).float()
    key_sum = key.sum(dim=-1, keepdim=True)  # [B, H, D, 1]
    scores = torch.matmul(value, key_rotate.transpose(-1, -2))  # [B, H, D, D]
    summed = sum_over_ranks(torch.cat([scores, key_sum.float()], dim=-1))
    # Contiguous, as the processor's: a strided operand may take another matmul kernel (other rounding).
    scores, key_sum = summed[..., :-1].contiguous(), summed[..., -1:].to(key_sum.dtype).contiguous()
    z = 1 / (key_sum.transpose(-2, -1) @ query + 1e-15)
    hidden_states = torch.matmul(scores, query_rotate) * z
    hidden_states = hidden_states.flatten(1, 2).transpose(1, 2).to(original_dtype)
    return attn.to_out[1](attn.to_out[0](hidden_states))


class SanaVideoLinearAttnProcessor(SequenceParallelAttnProcessor):
    """Runs Sana-Video's self-attention (:func:`sana_video_linear_attention`) on this rank's tokens, its
    sums over the tokens all-reduced (one ``[B, H, D, D + 1]`` all-reduce per call, in both dense modes).
    See :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor` for the arguments; the
    kernel, transport and K/V-first options do not apply."""

    strategy = "linear_sum"

    def _run_parallel(self, attn, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        sizes = self.state.shard_sizes()
        if not torch.is_tensor(hidden) or hidden.ndim != 3 or hidden.shape[1] != sizes[self.state.group.rank]:
            raise SequenceParallelConfigError(
                f"{type(self.inner).__name__}: expected this rank's shard of the {self.state.seq_len} video tokens "
                f"({sizes} over the ranks) in self-attention; the sharding plan does not match the model's forward.")
        self.state.group.check_device(hidden.device)
        return sana_video_linear_attention(self.inner, attn, args, kwargs,
                                           lambda partial: all_reduce_sum(partial, self.state.group))


class SanaFeedForwardHook(ModelHook):
    """Runs a block's ``GLUMBTempConv`` on this rank's tokens (see the module docstring).

    The block hands it ``[B, 1, S_r, 1, C]`` (its local tokens, unflattened with the grid sides
    :class:`~diffusers_sp.grid_window.GridSide` gave it); the hook lays them out as the column
    ``[B, C, S_r, 1]`` that :class:`~diffusers_sp.grid_window.GridWindowHook` takes, over a grid whose rows
    are whole frames (``F`` rows of ``H * W`` tokens, halo one row: the temporal convolution's reach,
    and the spatial one stays inside a row), hands the module the window it returns (whole frames,
    ``[B, frames, H, W, C]``), and hands the block back the rank's ``[B, 1, S_r, 1, C]``.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.window = GridWindowHook(GridWindow(halo=1), state)
        self._frame: tuple[int, int] = (0, 0)

    def pre_forward(self, module, hidden_states: torch.Tensor, *args, **kwargs):
        state = self.state
        grid = state.extra["grid"]
        frames, height, width = grid["frames"], grid["height"], grid["width"]
        self._frame = (height, width)
        column = hidden_states.flatten(1, 3).transpose(1, 2).unsqueeze(-1)  # [B, C, S_r, 1]
        state.extra["grid"] = {"height": frames, "width": height * width}  # the window's grid: rows are frames
        try:
            (window, *args), kwargs = self.window.pre_forward(module, column, *args, **kwargs)  # [B, C, rows, H * W]
        finally:
            state.extra["grid"] = grid
        video = window.flatten(2).transpose(1, 2).unflatten(1, (-1, height, width)).contiguous()  # the module views it
        return (video, *args), kwargs  # [B, rows, H, W, C]

    def post_forward(self, module, output: torch.Tensor):
        height, width = self._frame
        rows = output.flatten(1, 3).transpose(1, 2).unflatten(2, (-1, height * width))  # [B, C, rows, H * W]
        mine = self.window.post_forward(module, rows)  # [B, C, S_r, 1]
        return mine.squeeze(-1).transpose(1, 2).unflatten(1, (1, -1, 1))  # [B, 1, S_r, 1, C]


def sana_video_patch_size(model) -> tuple[int, ...]:
    """Patch size of a ``SanaVideoTransformer3DModel`` from its config, frames first.

    Raises:
        SequenceParallelConfigError: a feed-forward with a norm (``GLUMBTempConv(norm_type=...)``: its
            RMS norm runs over the frames, which the window of :class:`SanaFeedForwardHook` cuts).
    """
    if any(block.ff.norm_type is not None for block in model.transformer_blocks):
        raise SequenceParallelConfigError(
            f"{type(model).__name__}: a feed-forward with norm_type set normalizes over the frames, which sequence "
            f"parallelism splits; Sana-Video's blocks build theirs without one.")
    return tuple(int(p) for p in model.config.patch_size)


def sana_video_sharding_plan(model) -> dict:
    """The explicit plan of the module docstring."""
    return {
        "": {"controlnet_block_samples": CONTROLNET_RESIDUALS},
        "rope": {0: _ROPE, 1: _ROPE},
        "transformer_blocks.0": {"hidden_states": _TOKENS},
        # The block unflattens its tokens with (frames, height, width): (1, S_r, 1) on this rank.
        "transformer_blocks.*": {"timestep": _MODULATION, "frames": GridSide("frames"), "height": GridSide("height"),
                                 "width": GridSide("width")},
        "norm_out": {"temb": _MODULATION},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def sana_video_forward_hooks(model, state) -> dict:
    """:class:`SanaFeedForwardHook` on every block's ``ff``."""
    return {f"transformer_blocks.{i}.ff": (lambda: SanaFeedForwardHook(state)) for i in range(len(model.transformer_blocks))}


SANA_VIDEO = FamilySpec(
    name="sana_video", model_classes=("SanaVideoTransformer3DModel",), is_video=True,
    patch_size=sana_video_patch_size, sharding_plan=sana_video_sharding_plan,
    attention_modules=("transformer_blocks.*.attn1",), forward_hooks=sana_video_forward_hooks,
    attention_processor=SanaVideoLinearAttnProcessor,
    vsa_refusal="Sana-Video's self-attention is linear attention (ReLU features, no softmax), and VSA takes over "
                "softmax attention calls",
    cfg_strategy="batch",
    note="linear self-attention: its sums over tokens all-reduced; the feed-forward convolution on a window of frames")
