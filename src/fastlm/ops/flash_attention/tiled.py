"""The algorithm in plain PyTorch (FlashAttentionTorch): the kernels' tiling and online softmax, fp32
accumulation, runs anywhere. Slow (Python loops over tiles); for reading, debugging, and the CPU
path. Same contract as the launchers, the tile edge in place of their config.

Dense inputs skip the key tiles the mask hides, as the kernels do. Packed documents are computed as
one sequence of all of them, under a mask that also hides the other documents' keys: every tile
pair is visited (where each document lies is data, and the loops stay traceable by torch.compile
without reading it), so packed inputs cost what dense attention over the total length costs.
"""

from __future__ import annotations

import torch

from fastlm.ops.flash_attention.layout import contiguous_gradients, empty_result
from fastlm.ops.flash_attention.masks import UNBOUNDED, visible, window_bounds

TORCH_TILE = 32  # tile edge of FlashAttentionTorch


def as_4d(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(B, N, D) -> (B, 1, N, D) views; 4-D tensors pass through."""
    return [t.unsqueeze(1) if t.dim() == 3 else t for t in tensors]


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(Z, Hkv, N, D) -> (Z, H, N, D): key/value head h // (H // Hkv) for query head h (Hkv = 0
    comes with H = 0: nothing to expand)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] else t


def _reduce_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(Z, H, N, D) per-query-head gradient -> (Z, Hkv, N, D) summed over each group."""
    Z, H, N, D = grad.shape
    return grad.view(Z, kv_heads, H // kv_heads, N, D).sum(2) if kv_heads else grad


def _documents(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) the document of each packed row: the last d with cu_seqlens[d] <= row (empty documents
    own no row)."""
    positions = torch.arange(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


class _Mask:
    """Which keys each query row sees, on one sequence of M queries and N keys per batch entry
    (packed: every document end to end)."""

    def __init__(
        self,
        M: int,
        N: int,
        causal: bool,
        window: tuple[int, int],
        device: torch.device,
        cu_seqlens_q: torch.Tensor | None,
        cu_seqlens_k: torch.Tensor | None,
    ):
        self.left, self.right = window_bounds(causal, window)
        rows = torch.arange(M, device=device)
        if cu_seqlens_q is None:
            self.diag = N - M  # the causal diagonal: row i sits at key position i + diag
            self.positions = rows + self.diag
            self.query_docs = self.key_docs = None
        else:
            self.diag = None
            self.query_docs, self.key_docs = _documents(cu_seqlens_q, M), _documents(cu_seqlens_k, N)
            # row r of document d: position r - cu_q[d] + len_k - len_q inside it, + cu_k[d] packed
            shift = (cu_seqlens_k[1:] - cu_seqlens_q[1:]).long()
            self.positions = rows + shift[self.query_docs]

    def tile(self, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor | None:
        """(m1 - m0, n1 - n0) bool: which keys n0..n1-1 rows m0..m1-1 see; None: all of them."""
        packed = self.query_docs is not None
        if not packed and self.left < 0 and self.right < 0:
            return None
        keys = torch.arange(n0, n1, device=self.positions.device)
        seen = visible(self.positions[m0:m1], keys, self.left, self.right)
        return seen & (self.query_docs[m0:m1, None] == self.key_docs[None, n0:n1]) if packed else seen

    def key_tiles(self, m0: int, m1: int, N: int, tile: int) -> range:
        """First keys of the tiles rows m0..m1-1 may see: dense inputs skip the tiles the window
        hides, packed ones visit all."""
        if self.diag is None:
            return range(0, N, tile)
        low = max(m0 + self.diag - self.left, 0) if self.left >= 0 else 0
        high = min(m1 - 1 + self.diag + self.right + 1, N) if self.right >= 0 else N
        return range(low // tile * tile, high, tile)


def _batched(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """A (Z, heads, rows, D) view: dense 3-D tensors as one head, packed (total, heads, D) ones as
    one batch entry."""
    if packed:
        return t.transpose(0, 1).unsqueeze(0)
    return t.unsqueeze(1) if t.dim() == 3 else t


def _unbatched(t: torch.Tensor, like: torch.Tensor, packed: bool, contiguous: bool = False) -> torch.Tensor:
    """`_batched` undone for a result of ``like``'s shape, laid out as the launchers' results (4-D:
    `empty_result`, token-major unless ``contiguous``)."""
    if packed:
        return t[0].transpose(0, 1).contiguous()
    if like.dim() == 3:
        return t.squeeze(1)  # (Z, 1, rows, D) contiguous: already row-major
    return empty_result(t, contiguous).copy_(t)


def _forward_tiles(q, k, v, mask: _Mask, scale: float, tile: int):
    """(O, L) of 4-D inputs: q (Z, H, M, D), k and v (Z, Hkv, N, D)."""
    Z, H, M, D = q.shape
    N = k.shape[2]
    k, v = expand_kv(k, H).float(), expand_kv(v, H).float()
    o = torch.zeros((Z, H, M, D), device=q.device, dtype=torch.float32)
    lse = torch.full((Z, H, M), float("-inf"), device=q.device, dtype=torch.float32)
    for m0 in range(0, M, tile):
        m1 = min(m0 + tile, M)
        qi = q[:, :, m0:m1].float()
        m_i = torch.full((Z, H, m1 - m0), float("-inf"), device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(qi)
        for n0 in mask.key_tiles(m0, m1, N, tile):
            n1 = min(n0 + tile, N)
            s = qi @ k[:, :, n0:n1].transpose(-1, -2) * scale
            seen = mask.tile(m0, m1, n0, n1)
            if seen is not None:
                s = s.masked_fill(~seen, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m_i - m_safe)
            l_i = alpha * l_i + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v[:, :, n0:n1]
            m_i = m_new
        empty = l_i == 0
        o[:, :, m0:m1] = acc / torch.where(empty, 1.0, l_i)[..., None]
        lse[:, :, m0:m1] = torch.where(empty, float("-inf"), m_i + torch.log(l_i))
    return o.to(q.dtype), lse


def _backward_tiles(grad_out, q, k, v, o, lse, mask: _Mask, scale: float, tile: int):
    """(dQ, dK, dV) of 4-D inputs, from the forward's O and L (Z, H, M)."""
    Z, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    qf, dof = q.float(), grad_out.float()
    kf, vf = expand_kv(k, H).float(), expand_kv(v, H).float()
    delta = (dof * o.float()).sum(-1)  # Dlt = rowsum(dO * O), (Z, H, M)
    lse_safe = torch.where(lse == float("-inf"), 0.0, lse)  # empty rows: every score is masked
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for m0 in range(0, M, tile):
        m1 = min(m0 + tile, M)
        qi, doi = qf[:, :, m0:m1], dof[:, :, m0:m1]
        for n0 in mask.key_tiles(m0, m1, N, tile):
            n1 = min(n0 + tile, N)
            kj, vj = kf[:, :, n0:n1], vf[:, :, n0:n1]
            s = qi @ kj.transpose(-1, -2) * scale
            seen = mask.tile(m0, m1, n0, n1)
            if seen is not None:
                s = s.masked_fill(~seen, float("-inf"))
            p = torch.exp(s - lse_safe[:, :, m0:m1, None])
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ doi
            dp = doi @ vj.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1, None])
            dq[:, :, m0:m1] += ds @ kj * scale
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ qi * scale
    dk, dv = _reduce_groups(dk, Hkv), _reduce_groups(dv, Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tiled_forward(
    q, k, v, causal: bool, scale: float, tile: int, *, window=UNBOUNDED, cu_seqlens_q=None, cu_seqlens_k=None
):
    """(O, L) as `launchers._launch_forward` returns them."""
    packed = cu_seqlens_q is not None
    q4, k4, v4 = (_batched(t, packed) for t in (q, k, v))
    mask = _Mask(q4.shape[2], k4.shape[2], causal, window, q.device, cu_seqlens_q, cu_seqlens_k)
    o, lse = _forward_tiles(q4, k4, v4, mask, scale, tile)
    return _unbatched(o, q, packed), lse[0] if packed else lse.squeeze(1) if q.dim() == 3 else lse


def _tiled_backward(
    grad_out,
    q,
    k,
    v,
    o,
    lse,
    causal: bool,
    scale: float,
    tile: int,
    *,
    window=UNBOUNDED,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    """(dq, dk, dv) as `launchers._launch_backward` returns them."""
    packed = cu_seqlens_q is not None
    q4, k4, v4, do4, o4 = (_batched(t, packed) for t in (q, k, v, grad_out, o))
    lse4 = lse.unsqueeze(0) if packed else lse.unsqueeze(1) if q.dim() == 3 else lse
    mask = _Mask(q4.shape[2], k4.shape[2], causal, window, q.device, cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = _backward_tiles(do4, q4, k4, v4, o4, lse4, mask, scale, tile)
    dq_contiguous, dkv_contiguous = contiguous_gradients(q, k, v)
    return (
        _unbatched(dq, q, packed, dq_contiguous),
        _unbatched(dk, k, packed, dkv_contiguous),
        _unbatched(dv, v, packed, dkv_contiguous),
    )
