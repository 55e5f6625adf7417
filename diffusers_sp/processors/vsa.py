"""Video sparse attention (VSA) under sequence parallelism: Ulysses or K/V-gather underneath.

VSA ("VSA: Faster Video Diffusion with Trainable Sparse Attention", arXiv 2505.13389, and the
FastVideo implementation it describes) cuts the patchified latent grid into 3-D tiles, attends at
tile level to pick the top-k key tiles of each query tile, and attends token by token only inside
the picked tiles; the math is in :mod:`diffusers_sp.kernels.vsa`.

Sequence parallelism (see DESIGN.md): while VSA is on, the transformer's tokens travel in *tile
order* (a :class:`~diffusers_sp.shards.TokenOrder` set per forward from the latent grid) and are
sharded on tile boundaries, balanced to within one tile. Everything outside attention is per token,
so the reordering is exact, and it is undone when the output is gathered.

* Under K/V-gather each rank tiles its own queries and gate without communication, all-gathers K
  and V (one collective), and runs VSA for its query tiles against all key tiles; top-k uses the
  global tile count. A query tile needs only its own q, gate and the full K/V, so this is exact.
* Under Ulysses Q, K, V and the gate travel in one all-to-all to head shards over the full
  sequence, each rank runs VSA for its heads over all tiles, and one all-to-all brings the output
  back.
* Under hybrid (USP, arXiv 2405.07719; :mod:`diffusers_sp.processors.hybrid`) the two combine: Q, K,
  V and the gate travel in one all-to-all inside the Ulysses group to its token chunk (whole tiles:
  the concatenation of its ranks' tile ranges) of this rank's heads, K and V of those heads are
  all-gathered across the K/V-gather group, and each rank runs VSA for the chunk's query tiles
  against all key tiles; one all-to-all inside the Ulysses group brings the output back.

sglang's diffusion runtime refuses K/V-gather with VSA; Diffusers has no sparse attention under
context parallelism.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers.hooks import ModelHook

from ..kernels.tiles import packed_offsets
from ..kernels.vsa import make_tile_layout, video_sparse_attention_packed
from ..shards import TokenOrder, balanced_sizes
from ..errors import SequenceParallelConfigError
from .base import SequenceParallelAttnProcessor
from .kv_gather import gather_kv
from .ulysses import gather_heads, scatter_heads

#: Defaults of the ``vsa_*`` options of :func:`diffusers_sp.enable_sequence_parallel`.
VSA_DEFAULTS = {"vsa_sparsity": 0.9, "vsa_tile_size": (4, 4, 4), "vsa_sp_mode": "auto", "vsa_gate_weights": None}


@dataclass(frozen=True, eq=False)
class TilePlan:
    """How one latent grid's tiles and tokens are shared out over the ranks (device tensors).

    Attributes:
        layout: The :class:`~diffusers_sp.kernels.vsa.TileLayout` (CPU tensors).
        ranges: Per rank, the ``(start, end)`` of its contiguous range of whole tiles (balanced, the
            first ``N mod P`` ranks one tile more).
        order: The :class:`~diffusers_sp.shards.TokenOrder`: tile order, tokens per rank.
        block_sizes: ``LongTensor [N]`` valid tokens per tile, on the device.
        chunk_ranges: Per Ulysses group of a hybrid mesh (``ulysses_degree`` consecutive ranks), the
            ``(start, end)`` of its tiles: its ranks' ranges joined.
        packed: Per tile range an attention call runs on (every rank's range, every chunk and all tiles),
            ``(start, end) -> (sizes, offsets)``: int32 ``[end - start]`` on the device, the range's valid tokens
            per tile and where each starts in it. Made once, so no call converts sizes or sums them again.

    The tokens of a rank (and of a chunk) are its tiles' valid tokens, tile after tile: the packed layout of
    :func:`~diffusers_sp.kernels.vsa.video_sparse_attention_packed`, which attention reads as it is.
    """

    layout: object
    ranges: tuple
    order: TokenOrder
    block_sizes: torch.Tensor
    chunk_ranges: tuple = ()
    packed: dict = field(default_factory=dict)

    def packed_tiles(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int32 ``(sizes, offsets)`` of tiles ``[start, end)`` on the device (see ``packed``)."""
        if (start, end) not in self.packed:
            sizes = self.block_sizes[start:end].to(torch.int32)
            return sizes, packed_offsets(sizes)
        return self.packed[(start, end)]


# A constant while torch.compile traces (the plan's index tensors enter the graph as constants): the
# building uses boolean indexing, data-dependent shapes that would break the graph.
@torch.compiler.assume_constant_result
def tile_plan(grid: tuple[int, int, int], tile: tuple[int, int, int], world_size: int,
              device: torch.device = torch.device("cpu"), ulysses_degree: int = 1) -> TilePlan:
    """The :class:`TilePlan` of ``grid`` cut into ``tile`` over ``world_size`` ranks, its index tensors
    on ``device`` (with the chunks of Ulysses groups of ``ulysses_degree`` ranks, a divisor of
    ``world_size``). Cached: built (and copied to the device) once per grid, not once per layer.
    Built outside inference mode, so that a plan first made under ``torch.inference_mode()`` also
    serves later calls with grad on (an inference tensor cannot be saved for backward).

    Raises:
        SequenceParallelConfigError: fewer tiles than ranks.
    """
    return _cached_tile_plan(grid, tile, world_size, device, ulysses_degree)


@functools.lru_cache(maxsize=16)
def _cached_tile_plan(grid, tile, world_size, device, ulysses_degree) -> TilePlan:
    with torch.inference_mode(False):
        return _build_tile_plan(grid, tile, world_size, device, ulysses_degree)


def _build_tile_plan(grid, tile, world_size, device, ulysses_degree=1) -> TilePlan:
    layout = make_tile_layout(grid, tile)
    if layout.num_tiles < world_size:
        raise SequenceParallelConfigError(
            f"VSA: the latent grid {grid} (frames, height, width in patches) has {layout.num_tiles} tiles of "
            f"{tile} for {world_size} ranks; every rank needs at least one tile. Use a smaller vsa_tile_size, "
            f"a larger video, fewer ranks, or mode='kv_gather' / 'ulysses' (dense).")
    counts = balanced_sizes(layout.num_tiles, world_size)
    starts = [sum(counts[:i]) for i in range(world_size)]
    ranges = tuple((s, s + c) for s, c in zip(starts, counts))
    perm = layout.tiled_index[layout.tiled_index >= 0]
    sizes = tuple(int(layout.block_sizes[s:e].sum()) for s, e in ranges)
    order = TokenOrder(perm=perm.to(device), inverse=torch.argsort(perm).to(device), sizes=sizes)
    U = ulysses_degree
    chunks = tuple((ranges[o * U][0], ranges[o * U + U - 1][1]) for o in range(world_size // U))
    sizes32 = layout.block_sizes.to(device, torch.int32)
    packed = {(s, e): (sizes32[s:e], packed_offsets(sizes32[s:e]))
              for s, e in set(ranges) | set(chunks) | {(0, layout.num_tiles)}}
    return TilePlan(layout=layout, ranges=ranges, order=order, block_sizes=layout.block_sizes.to(device),
                    chunk_ranges=chunks, packed=packed)


def load_gate_weights(path: str | os.PathLike, num_layers: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Loads the VSA gate projections ``blocks.{i}.to_gate_compress.{weight,bias}`` with safetensors.

    Args:
        path: A ``.safetensors`` file, or a folder of ``*.safetensors`` shards (the layout of
            checkpoints trained for VSA).
        num_layers: Transformer blocks; every ``i`` in ``range(num_layers)`` must be present.
        dim: Model width (``heads * head_dim``): weights ``[dim, dim]``, biases ``[dim]``.

    Returns:
        ``[(weight, bias)]`` per block (CPU tensors in the file's dtype).

    Raises:
        SequenceParallelConfigError: the path does not exist or holds no safetensors file, or a key
            is missing or misshapen (the message names the key).
    """
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise SequenceParallelConfigError(f"vsa_gate_weights={str(path)!r}: no .safetensors file found there.")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                if ".to_gate_compress." in key:
                    tensors[key] = handle.get_tensor(key)
    out = []
    for i in range(num_layers):
        pair = []
        for name, shape in (("weight", (dim, dim)), ("bias", (dim,))):
            key = f"blocks.{i}.to_gate_compress.{name}"
            if key not in tensors:
                raise SequenceParallelConfigError(f"vsa_gate_weights={str(path)!r}: key {key!r} is missing.")
            if tuple(tensors[key].shape) != shape:
                raise SequenceParallelConfigError(
                    f"vsa_gate_weights={str(path)!r}: key {key!r} has shape {tuple(tensors[key].shape)}, "
                    f"expected {shape} for a model of width {dim}.")
            pair.append(tensors[key])
        out.append(tuple(pair))
    return out


class VideoSparseAttnProcessor(SequenceParallelAttnProcessor):
    """Attention processor running the model's own processor with video sparse attention (VSA).

    Args:
        inner: The model's self-attention processor (Wan: ``WanAttnProcessor`` of ``blocks.i.attn1``).
        state: The model's :class:`~diffusers_sp.plan_entries.SequenceState`; ``state.extra["vsa"]``
            holds the :class:`TilePlan` of the current forward, set by :class:`TileOrderHook`.
        sparsity: Fraction of key tiles each query tile skips, in ``[0, 1)``.
        sp_mode: Communication underneath: ``"ulysses"``, ``"kv_gather"`` or ``"hybrid"`` (over
            ``state.mesh``).
        gate: ``None`` (zero gate: pure block-sparse attention) or ``(weight [dim, dim], bias [dim])``
            of the gate projection ``to_gate_compress`` applied to the attention input.
        backend: VSA backend of :func:`~diffusers_sp.kernels.vsa.video_sparse_attention`
            (``"auto"``: the Triton kernel on CUDA in bf16/fp16, else flex_attention on CUDA, else the
            reference implementation).
        kernel: Unused by VSA (kept for the common processor signature).
        dispatch, kv_first: See :class:`~diffusers_sp.processors.base.SequenceParallelAttnProcessor`; with
            ``kv_first`` (Wan) the family's own self-attention runs, K and V held until the queries come.

    Tensors in the taken-over attention call are ``[B, H, S_r, D]``: this rank's tokens in tile order.
    """

    strategy = "vsa"

    def __init__(self, inner, state, *, sparsity: float, sp_mode: str, gate=None, backend: str = "auto",
                 kernel: str = "auto", dispatch: bool = False, kv_first=None):
        super().__init__(inner, state, kernel=kernel, dispatch=dispatch, kv_first=kv_first)
        self.backend = backend
        self.sparsity = sparsity
        self.sp_mode = sp_mode
        self.gate_weight, self.gate_bias = gate if gate is not None else (None, None)
        self._gate = None

    def _run(self, attn, *args, **kwargs):
        if self.gate_weight is not None:
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.gate_weight.device != hidden.device or self.gate_weight.dtype != hidden.dtype:
                self.gate_weight = self.gate_weight.to(hidden.device, hidden.dtype)
                self.gate_bias = self.gate_bias.to(hidden.device, hidden.dtype)
            gate = torch.nn.functional.linear(hidden, self.gate_weight, self.gate_bias)  # [B, S_r, H*D]
            heads = getattr(attn, "heads", None) or attn.num_heads  # num_heads: Kandinsky5Attention
            self._gate = gate.unflatten(2, (heads, -1)).transpose(1, 2)  # [B, H, S_r, D]
        try:
            return super()._run(attn, *args, **kwargs)
        finally:
            self._gate = None

    def parallel_attention(self, query, key, value, sizes, *, scale, text_len=0, text_layout=None, key_mask=None):
        if text_len or key_mask is not None:
            what = "text tokens in its self-attention" if text_len else "an attention mask"
            raise SequenceParallelConfigError(
                f"{type(self.inner).__name__}: VSA supports video self-attention without text tokens or masks, and "
                f"this call has {what}, which VSA's tile selection cannot follow. Modes that would work: "
                f"'ulysses', 'kv_gather', 'auto' (dense attention).")
        plan: TilePlan = self.state.extra["vsa"]
        group = self.state.group
        if self.sp_mode == "kv_gather" or group.world_size == 1:
            start, end = plan.ranges[group.rank]
            k, v = gather_kv(key, value, sizes, group)
            return self._vsa(query, k, v, self._gate, plan, (start, end), scale)
        tensors = [query, key, value] + ([] if self._gate is None else [self._gate])
        if self.sp_mode == "hybrid":
            return self._hybrid(tensors, sizes, plan, scale)
        full = scatter_heads(tensors, sizes, group)  # [B, h_r, S, D] each, tile order
        out = self._vsa(*full[:3], full[3] if len(full) > 3 else None, plan, (0, plan.layout.num_tiles), scale)
        joined = gather_heads(out, sizes, group, num_heads=query.shape[1])  # [S_r, B, H, D]
        return joined.permute(1, 2, 0, 3)

    def _vsa(self, query, key, value, gate, plan: TilePlan, q_range, scale):
        """VSA of packed tile-ordered queries (the tiles ``q_range = (start, end)``) over every key tile."""
        q_sizes, q_offsets = plan.packed_tiles(*q_range)
        kv_sizes, kv_offsets = plan.packed_tiles(0, plan.layout.num_tiles)
        return video_sparse_attention_packed(
            query, key, value, tile_volume=plan.layout.tile_volume, q_block_sizes=q_sizes, kv_block_sizes=kv_sizes,
            sparsity=self.sparsity, gate=gate, scale=scale, backend=self.backend, q_block_offsets=q_offsets,
            kv_block_offsets=kv_offsets)

    def _hybrid(self, tensors, sizes, plan: TilePlan, scale):
        """VSA over a :class:`~diffusers_sp.groups.HybridMesh` (module docstring): ``tensors`` are Q, K, V
        (and the gate), ``[B, H, S_r, D]`` in tile order; returns ``[B, H, S_r, D]``."""
        mesh = self.state.mesh
        inner_sizes, outer_sizes = mesh.split_sizes(sizes)
        chunk = scatter_heads(tensors, inner_sizes, mesh.ulysses)  # [B, h_u, S_o, D]: the inner group's tiles
        k, v = gather_kv(chunk[1], chunk[2], outer_sizes, mesh.kv_gather)  # [B, h_u, S, D]: every tile
        start, end = plan.chunk_ranges[mesh.kv_gather.rank]
        out = self._vsa(chunk[0], k, v, chunk[3] if len(chunk) > 3 else None, plan, (start, end), scale)
        joined = gather_heads(out, inner_sizes, mesh.ulysses, num_heads=tensors[0].shape[1])
        return joined.permute(1, 2, 0, 3)


class TileOrderHook(ModelHook):
    """Model pre-forward hook that puts the tokens in VSA tile order for the forward.

    Reads the latent grid ``(T, H, W)`` (in patches) from the model's input through the family's
    ``latent_grid(model, args, kwargs)`` and sets ``state.order`` (tile order, tile-aligned shards)
    and ``state.extra["vsa"]``. Registered after the sharding hooks, so it runs before them.

    Raises (during the forward, identically on every rank):
        SequenceParallelConfigError: fewer tiles than ranks.
    """

    def __init__(self, state, latent_grid, tile):
        super().__init__()
        self.state, self.latent_grid, self.tile = state, latent_grid, tuple(tile)

    def pre_forward(self, module, *args, **kwargs):
        grid = tuple(int(g) for g in self.latent_grid(module, args, kwargs))
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        mesh = self.state.mesh
        plan = tile_plan(grid, self.tile, self.state.group.world_size, hidden.device,
                         1 if mesh is None else mesh.ulysses_degree)
        self.state.order = plan.order
        self.state.extra["vsa"] = plan
        return args, kwargs
