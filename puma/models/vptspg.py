"""VPTSP-G (Ren et al., "Learning Semantic Proxies from Visual Prompts", ICLR 2024): the model pieces.

Two paths through the same frozen ViT (paper Fig. 2):

    image path  [CLS, T^k (N), patches]           -> CLS -> head        -> embedding x  (B, E)
    proxy path  [CLS, T^k (N), t^c_k (m), patches] -> CLS -> proxy head -> semantic proxy p^c (B, E)

T^k are the per-layer visual prompts (VPT-deep, Eq. 1: fresh tokens before each of the first L
blocks, their outputs flowing on after that); t^c are the class-based prompts of the sample's class
c, fresh before each of the first CLS-L blocks. The proxy head is a Linear of its own ("the
parameters of the linear head are independent between the tower of the sample encoder and the
semantic proxy"). Embedding and evaluation use the image path only: ``forward(images)``.

Semantic proxies are fused into the proxy memory P^c by :class:`SemanticProxyGRU` (Eq. 4-7, ReLU
candidate "since we want to retain the updating of the vector scale") or by EMA (Eq. 3); the memory,
the proxy bias O (Eq. 8) and the Proxy-Anchor loss live in puma/losses/semantic_proxy.py, and the
class prompts themselves in the class-prompt bank (puma/losses/memory_bank.py), outside the model
and outside DDP, because only the batch's classes are on the device at a time. How they are put
together, what trains and the training step: the method's record, puma/methods/vptsp_g.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from puma.config import ConfigError
from puma.models.head import EmbeddingHead
from puma.models.puma_model import PumaModel
from puma.models.vpt import VisualPrompts


class ProxyHead(EmbeddingHead):
    """The proxy tower's own Linear(D -> E) + L2 normalisation: (B, D) -> semantic proxies (B, E)."""


class SemanticProxyGRU(nn.Module):
    """Eq. 4-7: P_i = normal((1 - z) * P_{i-1} + z * N), N = act(W_h p + r * U_h P_{i-1} + b_h).

    z = sigmoid(W_z p + U_z P + b_z), r = sigmoid(W_r p + U_r P + b_r); W, U are E x E, b in R^E
    (3 (2 E^2 + E) parameters). ``activation`` relu is the paper's; tanh is a plain GRU (Table 7).
    """

    def __init__(self, dim: int, activation: str = "relu") -> None:
        super().__init__()
        self.w = nn.Linear(dim, 3 * dim)  # [W_z; W_r; W_h] and [b_z; b_r; b_h]
        self.u = nn.Linear(dim, 3 * dim, bias=False)  # [U_z; U_r; U_h]
        self.activation = activation

    def forward(self, proxy: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """proxy p^c_i (K, E), memory P^c_{i-1} (K, E) -> P^c_i (K, E), unit length."""
        wz, wr, wh = self.w(proxy).chunk(3, dim=-1)  # each (K, E)
        uz, ur, uh = self.u(memory).chunk(3, dim=-1)
        z = torch.sigmoid(wz + uz)  # update gate, Eq. 4
        r = torch.sigmoid(wr + ur)  # reset gate, Eq. 5
        act = torch.relu if self.activation == "relu" else torch.tanh
        candidate = act(wh + r * uh)  # Eq. 6
        return F.normalize((1 - z) * memory + z * candidate, dim=-1)  # Eq. 7

    def extra_repr(self) -> str:
        return f"dim={self.u.in_features}, activation={self.activation}"


def ema_fuse(proxy: torch.Tensor, memory: torch.Tensor, ema_lambda: float) -> torch.Tensor:
    """Eq. 3: P^c_i = normal(P^c_{i-1} + (1 - lambda) p^c_i); (K, E), (K, E) -> (K, E)."""
    return F.normalize(memory + (1.0 - ema_lambda) * proxy, dim=-1)


class VptspgModel(PumaModel):
    """Frozen ViT + per-layer visual prompts + head; class prompts arrive as an input of the proxy path."""

    def __init__(self, backbone: VisionTransformer, head: EmbeddingHead, visual_prompts: VisualPrompts,
                 proxy_head: ProxyHead, fusion: SemanticProxyGRU | None, class_prompt_layers: int,
                 class_prompt_length: int, ema_lambda: float = 0.1, bitfit: bool = False) -> None:
        super().__init__(backbone, head)
        depth = len(backbone.blocks)
        for key, layers in (("prompt_layers", visual_prompts.prompts.shape[0]),
                            ("class_prompt_layers", class_prompt_layers)):
            if not 1 <= layers <= depth:
                raise ConfigError(f"model.vptsp_g.{key}={layers} must be between 1 and the backbone "
                                  f"depth {depth}")
        self.visual_prompts = visual_prompts
        self.proxy_head = proxy_head
        self.fusion = fusion  # None: EMA fusion (VPTSP-M)
        self.class_prompt_shape = (class_prompt_layers, class_prompt_length, backbone.embed_dim)
        self.ema_lambda = ema_lambda
        self.bitfit = bitfit  # the record's option_parts add the backbone biases when set

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Image path: final-norm CLS token (B, D) with the visual prompts only."""
        return self.encode(images)

    def semantic_proxies(self, images: torch.Tensor, class_prompts: torch.Tensor) -> torch.Tensor:
        """Proxy path: images (B, 3, H, W), their classes' prompts (B, CLS-L, m, D) -> p^c (B, E)."""
        return self.proxy_head(self.encode(images, class_prompts))

    def fuse(self, proxy: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """One recurrent fusion step into the proxy memory: (K, E), (K, E) -> (K, E)."""
        if self.fusion is None:
            return ema_fuse(proxy, memory, self.ema_lambda)
        return self.fusion(proxy, memory)

    def encode(self, images: torch.Tensor, class_prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm CLS (B, D); tokens [CLS, T^k (N), (t^c_k (m)), (reg), patches] in block k."""
        vit, prompts = self.backbone, self.visual_prompts.prompts  # (L, N, D)
        x = vit.patch_drop(vit._pos_embed(vit.patch_embed(images)))  # (B, prefix + P, D)
        first = prompts[0].expand(x.shape[0], -1, -1)  # (B, N, D)
        if class_prompts is not None:
            first = torch.cat([first, class_prompts[:, 0].to(first.dtype)], dim=1)  # (B, N + m, D)
        x = vit.norm_pre(self._insert_prompts(x, first))
        for k, block in enumerate(vit.blocks):
            if k > 0:
                x = self._refresh(x, k, class_prompts)
            x = block(x)
        return vit.fc_norm(vit.norm(x)[:, 0])  # (B, D)

    def _refresh(self, x: torch.Tensor, k: int, class_prompts: torch.Tensor | None) -> torch.Tensor:
        """Before block k: fresh T^k (k < L) and t^c_k (k < CLS-L); older prompt outputs flow on."""
        prompts = self.visual_prompts.prompts  # (L, N, D)
        n = prompts.shape[1]
        parts = [x[:, :1]]
        parts.append(prompts[k].to(x.dtype).expand(x.shape[0], -1, -1) if k < prompts.shape[0]
                     else x[:, 1:1 + n])
        end = 1 + n
        if class_prompts is not None:
            m = class_prompts.shape[2]
            parts.append(class_prompts[:, k].to(x.dtype) if k < class_prompts.shape[1] else x[:, end:end + m])
            end += m
        return torch.cat(parts + [x[:, end:]], dim=1)


def class_prompt_init_bound(vit: VisionTransformer) -> float:
    """U(-v, v) bound of prompts, as VPT: v = sqrt(6 / (3 * patch_h * patch_w + D))."""
    proj = vit.patch_embed.proj
    fan_in = proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1]
    return math.sqrt(6.0 / float(fan_in + vit.embed_dim))


def init_class_prompts(num_classes: int, shape: tuple[int, int, int], bound: float,
                       seed: int = 0) -> torch.Tensor:
    """The class-prompt table (C, CLS-L, m, D), U(-bound, bound) from its own seeded generator (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_classes, *shape, generator=gen) * 2 - 1) * bound
