"""Plan entries for models that mix neighbouring tokens of a 2-D token grid outside attention
(Sana's convolutional feed-forward): :class:`GridSide` hands a block its shard as one column of
tokens, :class:`GridWindow` runs the convolution on whole rows of the real grid around the shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks import ModelHook

from .comm import all_gather_along
from .errors import SequenceParallelConfigError
from .plan_entries import SequenceState


@dataclass(frozen=True)
class GridSide:
    """A plan entry for an int argument that gives the ``"height"`` or ``"width"`` (``side``) of the 2-D
    token grid a module reshapes its tokens into (``tokens.unflatten(1, (height, width))``), as Sana's
    blocks do before their convolutional feed-forward. The full grid is kept for the forward
    (``SequenceState.extra["grid"]``) and the module receives ``height = S_r``, ``width = 1``: its
    shard as one column of tokens, in order, so that the reshape runs on the shard. What it then runs
    over that "image" must be wrapped by a :class:`GridWindow` entry, which hands it the neighbouring
    tokens of the real grid."""

    side: str

    #: A side length, not tokens: passing it does not mark the forward's tokens as split.
    splits_tokens = False

    def split_value(self, state: SequenceState, side_len, what: str):
        """``S_r`` for the grid's height, 1 for its width; the full side is kept in ``state.extra``."""
        if not isinstance(side_len, int) or isinstance(side_len, bool):
            return side_len
        if state.seq_len is None:
            raise SequenceParallelConfigError(
                f"{what} is a side of the token grid, but no tensor was split before it in this forward (the "
                f"sharding plan must split the sequence first).")
        state.extra.setdefault("grid", {})[self.side] = side_len
        return state.shard_sizes()[state.group.rank] if self.side == "height" else 1


@dataclass(frozen=True)
class GridWindow:
    """A plan entry for a module that takes the tokens as an image ``[B, C, height, width]`` (the column
    :class:`GridSide` makes of the shard, ``[B, C, S_r, 1]``) and mixes each token with its neighbours
    up to ``halo`` rows and columns away on the full grid, zero-padded at its border: a (2·halo + 1)²
    convolution between per-token layers, as Sana's ``GLUMBConv`` feed-forward (1 x 1, 3 x 3 depthwise,
    1 x 1 convolutions).

    The module runs on whole rows of the real grid: this rank's rows and ``halo`` rows above and below
    (fewer at the border), the rank's tokens completed with its neighbours' tokens of those rows (one
    all-gather of at most ``(halo + 1) · width`` tokens from each end of each shard), and its output is
    cut back to the rank's tokens. Outputs on the window's first and last rows, where the window's
    zero padding stands in for rows it lacks, belong to other ranks and are dropped; every kept token
    sees exactly its neighbours of one process. Costs over one process's share: those halo rows' work.
    """

    halo: int = 1

    def module_hook(self, state: SequenceState) -> GridWindowHook:
        """The hook that runs the module this entry names on whole rows of the grid."""
        return GridWindowHook(self, state)


class GridWindowHook(ModelHook):
    """Runs a module on whole rows of the token grid around this rank's tokens (see :class:`GridWindow`)."""

    def __init__(self, entry: GridWindow, state: SequenceState):
        super().__init__()
        self.halo = int(entry.halo)
        self.state = state
        self._cut: tuple[int, int] = (0, 0)
        self._index: dict = {}  # (height, width, sizes, device) -> (lo, hi, before, after, k): one per shape

    def _window_plan(self, height: int, width: int, sizes: tuple, device):
        key = (height, width, sizes, device)
        if key not in self._index:
            rank = self.state.group.rank
            starts = [sum(sizes[:q]) for q in range(len(sizes))]
            start, end = starts[rank], starts[rank] + sizes[rank]
            lo = max(0, start // width - self.halo) * width
            hi = min(height, (end - 1) // width + self.halo + 1) * width
            # Each rank sends its first and its last k tokens (all of them if it has fewer, zero-padded to
            # k): a rank needs fewer than k tokens from either side (< halo rows plus a partial row), and
            # of each rank it draws from, only an end within k of its own tokens.
            k = min((self.halo + 1) * width, max(sizes))
            ends = torch.tensor([s + n for s, n in zip(starts, sizes)])

            def index(positions: torch.Tensor, last: bool) -> torch.Tensor:
                q = torch.searchsorted(ends, positions, right=True)
                i = positions - torch.tensor(starts)[q]
                if last:
                    held = torch.tensor(sizes)[q].clamp(max=k)
                    i = k + i - (torch.tensor(sizes)[q] - held)
                return (q * 2 * k + i).to(device)

            self._index[key] = (lo, hi, index(torch.arange(lo, start), True), index(torch.arange(end, hi), False), k)
        return self._index[key]

    def pre_forward(self, module, x, *args, **kwargs):
        state = self.state
        grid = state.extra.get("grid", {})
        name = type(module).__name__
        height, width = grid.get("height"), grid.get("width")
        sizes = state.shard_sizes()
        rank = state.group.rank
        if (height is None or width is None or height * width != state.seq_len or state.order is not None
                or not torch.is_tensor(x) or x.ndim != 4 or tuple(x.shape[2:]) != (sizes[rank], 1)):
            # The same shapes on every rank, so every rank raises here alike.
            raise SequenceParallelConfigError(
                f"{name} mixes neighbouring tokens of the {height} x {width} token grid, but got "
                f"{list(x.shape) if torch.is_tensor(x) else type(x).__name__} for a sequence of {state.seq_len} tokens "
                f"split {sizes}{' and reordered' if state.order is not None else ''}; its sharding plan does not "
                f"match the model's forward.")
        lo, hi, before, after, k = self._window_plan(height, width, tuple(sizes), x.device)
        tokens = x.flatten(2)  # [B, C, S_r]
        if state.group.world_size > 1:
            held = min(k, sizes[rank])
            pad = tokens.new_zeros(tokens.shape[:2] + (k - held,))
            edges = torch.cat([tokens[..., :held], pad, tokens[..., sizes[rank] - held:], pad], dim=2)
            gathered = all_gather_along(edges, 2, [2 * k] * state.group.world_size, state.group)
            tokens = torch.cat([gathered.index_select(2, before), tokens, gathered.index_select(2, after)], dim=2)
        self._cut = (sum(sizes[:rank]) - lo, sizes[rank])
        return (tokens.unflatten(2, ((hi - lo) // width, width)), *args), kwargs

    def post_forward(self, module, output):
        offset, count = self._cut
        return output.flatten(2).narrow(2, offset, count).unsqueeze(-1)
