"""`--model gpt`: a small decoder-only transformer (GPT-2's shape, as in nanoGPT), for language modelling.

Token and position embeddings, `layers` blocks of pre-norm causal self-attention
(`scaled_dot_product_attention`) and a 4x MLP, a final LayerNorm and a linear head to the
vocabulary. Input: token ids (batch, time) with time <= `block_size`; output: logits (batch, time,
vocab), which the `cross_entropy` loss averages over each sample's positions. No dropout and no
batch-dependent layer, so a run's maths do not depend on the world size. The head is not tied to
the embedding (simpler to shard; costs `vocab x embed` parameters). Each block is one unit of
`--sharding fsdp`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional

DEFAULT_SIZES = {"vocab_size": 256, "block_size": 64, "layers": 2, "heads": 2, "embed": 64}


class CausalSelfAttention(nn.Module):
    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embed, 3 * embed)
        self.proj = nn.Linear(embed, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, embed = x.shape
        q, k, v = (part.view(batch, time, self.heads, embed // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(embed, dim=2))
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, time, embed))


class Block(nn.Module):
    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(embed), CausalSelfAttention(embed, heads)
        self.norm2 = nn.LayerNorm(embed)
        self.mlp = nn.Sequential(nn.Linear(embed, 4 * embed), nn.GELU(), nn.Linear(4 * embed, embed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, block_size: int = 64, layers: int = 2, heads: int = 2,
                 embed: int = 64):
        if embed % heads:
            raise ValueError(f"--gpt_embed: got {embed}; expected a multiple of --gpt_heads ({heads})")
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, embed)
        self.position_embedding = nn.Embedding(block_size, embed)
        self.blocks = nn.ModuleList(Block(embed, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(embed)
        self.head = nn.Linear(embed, vocab_size, bias=False)
        self.apply(_init_weights)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attention.proj.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.block_size:
            raise ValueError(f"--block_size: got a sequence of {time} tokens for a model of context {self.block_size}")
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def sharding_blocks(self) -> list[nn.Module]:
        """The units `--sharding fsdp` shards: the embeddings, each block, the final norm with the head."""
        return [self.token_embedding, self.position_embedding, *self.blocks, self.norm, self.head]


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
