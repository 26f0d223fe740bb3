"""DeepSeek mixture-of-experts feed-forward: top-k routed experts plus always-on shared experts.

Routing follows the checkpoints' config, as transformers' DeepSeek-V2/V3 do:
- `scoring_func` softmax (V2) or sigmoid (V3);
- `topk_method` greedy (top-k over all experts), group_limited_greedy (V2: keep
  the `topk_group` groups with the best expert, then top-k), or noaux_tc (V3:
  groups ranked by the sum of their two best bias-corrected scores, experts
  chosen by bias-corrected score but weighted by the raw score);
- `norm_topk_prob` renormalises the chosen weights; `routed_scaling_factor` scales them.
Parameter names are the HF ones (`gate.weight`, `experts.{e}.gate_proj.weight`,
`shared_experts.*`, `gate.e_score_correction_bias`).
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from kvforge.config import ModelConfig
from kvforge.hf_config import is_moe_layer as hf_is_moe_layer, routed_experts
from kvforge.models.layers import GatedMLP

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class TopkRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x = cfg.extra
        self.num_experts = num_routed_experts(cfg)
        self.top_k = int(x["num_experts_per_tok"])
        # transformers' DeepseekV3Config has no topk_method: V3 always routes noaux_tc
        self.method = x.get("topk_method") or ("noaux_tc" if cfg.model_type == "deepseek_v3" else "greedy")
        if self.method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.method!r}")
        default_scoring = "sigmoid" if self.method == "noaux_tc" else "softmax"
        self.scoring = x.get("scoring_func") or default_scoring
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        self.n_group, self.topk_group = int(x.get("n_group") or 1), int(x.get("topk_group") or 1)
        if self.method != "greedy" and self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})")
        self.norm_topk_prob = bool(x.get("norm_topk_prob", False))
        self.model_type = cfg.model_type
        self.norm_eps = 0.0 if cfg_is_qwen(cfg.model_type) else 1e-20  # as each family's transformers code
        self.routed_scaling_factor = float(x.get("routed_scaling_factor", 1.0))
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def _group_mask(self, choice: torch.Tensor) -> torch.Tensor:
        """[T, E] scores -> [T, E] bool: experts in the `topk_group` best groups."""
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        if self.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        if self.method == "greedy":
            weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        elif self.method == "group_limited_greedy":
            masked = scores.masked_fill(~self._group_mask(scores), 0.0)
            weights, idx = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)
        else:
            choice = scores + self.e_score_correction_bias.float()
            choice = choice.masked_fill(~self._group_mask(choice), float("-inf"))
            idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
        if self.norm_topk_prob and (self.top_k > 1 or cfg_is_qwen(self.model_type)):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        return weights * self.routed_scaling_factor, idx


class DeepseekMoE(nn.Module):
    """Routed experts plus optional always-on shared experts: DeepSeek-V2/V3, and Qwen3-MoE (no shared experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x = cfg.extra
        inter = int(x["moe_intermediate_size"])
        self.gate = TopkRouter(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg.hidden_size, inter, cfg.hidden_act) for _ in range(self.gate.num_experts)
        )
        n_shared = int(x.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(cfg.hidden_size, inter * n_shared, cfg.hidden_act) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        out = torch.zeros_like(x)
        # One pass per expert that received tokens (not per token): gather its rows, run, scatter-add.
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def cfg_is_qwen(model_type: str) -> bool:
    return model_type.startswith("qwen")


def num_routed_experts(cfg: ModelConfig) -> int:
    """Routed experts under any HF spelling (`hf_config.routed_experts`)."""
    return routed_experts(cfg.extra)


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has a routed MoE feed-forward, by each family's rule (`hf_config.is_moe_layer`,
    which the planner counts by too)."""
    return hf_is_moe_layer(cfg.extra, layer_idx, cfg.model_type)
