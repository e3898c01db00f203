"""Mixture of experts: the experts' gated MLPs over the tokens routed to them, forward and backward.

experts.py         moe_experts: sort, gathered GLU grouped matmul, grouped matmul, weighted combine
grouped_matmul.py  the matrix products over the experts' variable-size groups of rows
losses.py          the routers' load-balancing loss and z-loss
permute.py         the (token, expert) pairs in expert order, and the weighted sum back to tokens
routing.py         the routers' top-k: softmax then top-k, top-k then softmax, sigmoid with a bias
"""

from fastlm.ops.moe.experts import ACTIVATIONS, moe_experts, moe_experts_ref
from fastlm.ops.moe.losses import expert_counts, load_balancing_loss, router_z_loss
from fastlm.ops.moe.permute import ExpertOrder, expert_order
from fastlm.ops.moe.routing import ROUTINGS, route

__all__ = [
    "ACTIVATIONS",
    "ROUTINGS",
    "ExpertOrder",
    "expert_counts",
    "expert_order",
    "load_balancing_loss",
    "moe_experts",
    "moe_experts_ref",
    "route",
    "router_z_loss",
]
