"""Attention Residuals: softmax attention over depth in place of the residual sum (docs/design.md §4).

A sublayer's input is a convex combination of *sources* (the token embedding, the summaries of completed
blocks, and the running partial sum of the current block):

    h = Σ_s softmax_s( w · RMSNorm_γ(V_s) ) · V_s          (per token, softmax over s in fp32)

with a learned pseudo-query `w` (zero-initialised: training starts from the uniform average) and a key-norm
gain `γ`. Values are mixed un-normalised. The stream of sources is held as a `ResidualState`, which also
covers the standard residual (`x + f(norm(x))`) so the decoder layer has one code path for every mode.
"""

from dataclasses import dataclass

import torch
from torch import nn


class DepthAttention(nn.Module):
    """One pseudo-query attending over depth. `sources: [S, B, T, D]` -> `[B, T, D]`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.query = nn.Parameter(torch.empty(hidden_size))  # zero-initialised in `_init_weights`
        self.key_norm_weight = nn.Parameter(torch.empty(hidden_size))  # ones in `_init_weights`
        self.eps = eps

    def depth_weights(self, sources: torch.Tensor) -> torch.Tensor:
        """The softmax weights over sources, `[S, B, T]` in fp32 (also used for analysis and plots)."""
        values = sources.float()
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps) * self.key_norm_weight.float()
        return (keys @ self.query.float()).softmax(dim=0)

    def forward(self, sources: torch.Tensor) -> torch.Tensor:
        weights = self.depth_weights(sources)
        return torch.einsum("sbt,sbtd->btd", weights, sources.float()).to(sources.dtype)


@dataclass
class ResidualState:
    """The residual stream between sublayers.

    `completed`: `[S, B, T, D]` sources of closed blocks (the embedding first), or None in `standard` mode.
    `partial`: `[B, T, D]` running sum of the current block (None when the block is empty); in `standard` mode
    it is the residual stream `x` itself.
    """

    completed: torch.Tensor | None
    partial: torch.Tensor | None

    @classmethod
    def start(cls, embeddings: torch.Tensor, mode: str) -> "ResidualState":
        if mode == "standard":
            return cls(completed=None, partial=embeddings)
        return cls(completed=embeddings.unsqueeze(0), partial=None)

    def sources(self) -> torch.Tensor:
        if self.partial is None:
            return self.completed
        return torch.cat([self.completed, self.partial.unsqueeze(0)], dim=0)

    def read(self, depth_attention: DepthAttention | None) -> torch.Tensor:
        """The input of the next sublayer: the residual stream, or depth attention over the sources."""
        if depth_attention is None:
            return self.partial
        return depth_attention(self.sources())

    def add(self, output: torch.Tensor, close_block: bool) -> "ResidualState":
        """Add a sublayer's output to the partial sum; closing the block turns the sum into a source."""
        partial = output if self.partial is None else self.partial + output
        if close_block:
            return ResidualState(torch.cat([self.completed, partial.unsqueeze(0)], dim=0), None)
        return ResidualState(self.completed, partial)


__all__ = ["DepthAttention", "ResidualState"]
