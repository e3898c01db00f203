"""The algorithm in plain PyTorch (FlashAttentionTorch): the kernels' tiling and online softmax, fp32
accumulation, runs anywhere. Slow (Python loops over tiles); for reading, debugging, and the op's
body off the Triton path (CPU inputs under torch.compile; eager CPU calls take sdpa.py). Same
contract as the launchers, the tile edge in place of their config.

Dense inputs skip the key tiles the mask hides, as the kernels do. Packed documents are one sequence
of all of them, under a mask that also hides the other documents' keys, and the loop runs over key
tiles for every query tile at once: step j visits, for each query tile, the j-th key tile it may
see (`_PackedTiles`). On a CPU the cumulative lengths are read (free on the host) to find those
tiles, so a batch costs what its documents' tiles cost, in as many Python steps as the longest
stretch of key tiles one query tile sees (about a document's length / TORCH_TILE), however many
documents and rows the batch holds. Elsewhere, and while torch.compile traces (where each document
lies is data then), every query tile visits every key tile: the cost of dense attention over the
total length, in total_k / TORCH_TILE steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlm.ops.common import cdiv, is_traced
from fastlm.ops.flash_attention.layout import contiguous_gradients, empty_result
from fastlm.ops.flash_attention.masks import UNBOUNDED, visible, window_bounds

# tile edge of FlashAttentionTorch: on a CPU, fewer Python steps and larger matmuls pay for the
# masked part of diagonal tiles
TORCH_TILE = 64


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
    """Which keys each query row sees, on one sequence of M queries and N keys per batch entry."""

    def __init__(self, M: int, N: int, causal: bool, window: tuple[int, int], device: torch.device):
        self.left, self.right = window_bounds(causal, window)
        self.diag = N - M  # the causal diagonal: row i sits at key position i + diag
        self.positions = torch.arange(M, device=device) + self.diag

    def tile(self, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor | None:
        """(m1 - m0, n1 - n0) bool: which keys n0..n1-1 rows m0..m1-1 see; None: all of them."""
        if self.left < 0 and self.right < 0:
            return None
        keys = torch.arange(n0, n1, device=self.positions.device)
        return visible(self.positions[m0:m1], keys, self.left, self.right)

    def key_tiles(self, m0: int, m1: int, N: int, tile: int) -> range:
        """First keys of the tiles rows m0..m1-1 may see: the window's tiles."""
        low = max(m0 + self.diag - self.left, 0) if self.left >= 0 else 0
        high = min(m1 - 1 + self.diag + self.right + 1, N) if self.right >= 0 else N
        return range(low // tile * tile, high, tile)


class _PackedTiles:
    """Packed rows cut into T = cdiv(M, tile) query tiles and cdiv(N, tile) key tiles, and which key
    tiles each query tile visits: ``first[t]`` to ``first[t] + count[t] - 1``, one per step of
    ``steps`` (`key_tile`). Rows and keys past the last tile's end belong to no document.

    With the cumulative lengths on the CPU and not traced, a query tile visits the key tiles of the
    documents its rows belong to, within the rows' window: ``steps`` is the largest such count,
    read on the host. Otherwise every key tile (``steps`` = key tiles): exact too, as the mask hides
    the rest, and no value is read.
    """

    def __init__(
        self,
        M: int,
        N: int,
        causal: bool,
        window: tuple[int, int],
        tile: int,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
    ):
        device = cu_seqlens_q.device
        self.left, self.right = window_bounds(causal, window)
        self.tile, self.query_tiles, self.key_tiles = tile, cdiv(M, tile), cdiv(N, tile)
        query_docs = _documents(cu_seqlens_q, M).long()
        # row r of document d: position r - cu_q[d] + len_k - len_q inside it, + cu_k[d] packed
        shift = (cu_seqlens_k[1:] - cu_seqlens_q[1:]).long()
        positions = torch.arange(M, device=device) + shift[query_docs]
        pad = self.query_tiles * tile - M
        self.query_docs = F.pad(query_docs, (0, pad), value=-1).view(-1, tile)  # (T, tile); -1 past M
        self.positions = F.pad(positions, (0, pad)).view(-1, tile)  # (T, tile)
        # (key tiles * tile,): -2 past N, which no query row's document (nor -1) equals
        self.key_docs = F.pad(_documents(cu_seqlens_k, N).long(), (0, self.key_tiles * tile - N), value=-2)
        if device.type == "cpu" and not is_traced(cu_seqlens_q) and self.query_tiles:
            self.first, self.count = self._visited(M, query_docs, positions, cu_seqlens_k.long())
            self.steps = int(self.count.max())
        else:
            self.first = torch.zeros(self.query_tiles, dtype=torch.long, device=device)
            self.count = torch.full((self.query_tiles,), self.key_tiles, dtype=torch.long, device=device)
            self.steps = self.key_tiles

    def _visited(self, M: int, query_docs, positions, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, count), (T,) each: the key tiles of tile t's documents (the keys from its first
        row's document's first key to its last row's document's last: rows' documents never fall)
        that its rows' window reaches."""
        tile = self.tile
        starts = torch.arange(0, M, tile, device=positions.device)
        ends = (starts + tile).clamp(max=M)  # (T,) one past each tile's last row
        low, high = cu_seqlens_k[query_docs[starts]], cu_seqlens_k[query_docs[ends - 1] + 1]
        if self.left >= 0 or self.right >= 0:  # the window's keys: positions may fall from row to row
            rows = torch.arange(self.query_tiles * tile, device=positions.device).clamp(max=M - 1)
            padded = positions[rows].view(-1, tile)  # (T, tile): the last tile's spare rows repeat row M - 1
            if self.left >= 0:
                low = torch.maximum(low, padded.amin(1) - self.left)
            if self.right >= 0:
                high = torch.minimum(high, padded.amax(1) + self.right + 1)
        first = low.div(tile, rounding_mode="floor")
        count = (high + tile - 1).div(tile, rounding_mode="floor") - first
        return first, torch.where(high > low, count, 0)  # no key at all: no tile

    def key_tile(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, seen) of step ``step``: (T,) the key tile each query tile visits (clamped into the
        key tiles: a query tile past its count revisits one, wholly hidden), (T, tile, tile) bool
        which of its keys each row sees."""
        index = self.first + step
        live = step < self.count  # (T,)
        index = index.clamp(max=self.key_tiles - 1)
        keys = index[:, None] * self.tile + torch.arange(self.tile, device=index.device)  # (T, tile)
        seen = visible(self.positions, keys, self.left, self.right)
        same = self.query_docs[:, :, None] == self.key_docs[keys][:, None, :]
        return index, seen & same & live[:, None, None]


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


def _scores(s: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores, chain) of the scaled scores ``s``: with softcap c, c tanh(s / c) and the factor
    1 - tanh^2 of their gradient; without (c = 0), s and None."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, 1 - t * t


def _forward_tiles(q, k, v, mask: _Mask, scale: float, tile: int, softcap: float):
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
            s, _ = _scores(qi @ k[:, :, n0:n1].transpose(-1, -2) * scale, softcap)
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


def _backward_tiles(grad_out, q, k, v, o, lse, mask: _Mask, scale: float, tile: int, softcap: float):
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
            s, chain = _scores(qi @ kj.transpose(-1, -2) * scale, softcap)
            seen = mask.tile(m0, m1, n0, n1)
            if seen is not None:
                s = s.masked_fill(~seen, float("-inf"))
            p = torch.exp(s - lse_safe[:, :, m0:m1, None])
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ doi
            dp = doi @ vj.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1, None])
            if chain is not None:
                ds = ds * chain
            dq[:, :, m0:m1] += ds @ kj * scale
            dk[:, :, n0:n1] += ds.transpose(-1, -2) @ qi * scale
    dk, dv = _reduce_groups(dk, Hkv), _reduce_groups(dv, Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _as_tiles(t: torch.Tensor, tiles: int, tile: int) -> torch.Tensor:
    """(H, rows, D) -> (tiles, H, tile, D) fp32, rows zero-padded to tiles * tile."""
    H, rows, D = t.shape
    t = F.pad(t.float(), (0, 0, 0, tiles * tile - rows))
    return t.view(H, tiles, tile, D).transpose(0, 1)


def _from_tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`_as_tiles` undone: (tiles, H, tile, ...) -> (1, H, rows, ...)."""
    tiles, H, tile, *rest = t.shape
    return t.transpose(0, 1).reshape(1, H, tiles * tile, *rest)[:, :, :rows]


def _packed_forward_tiles(q, k, v, tiles: _PackedTiles, scale: float, softcap: float):
    """(O, L) of packed (1, H, M, D) q and (1, Hkv, N, D) k, v: the online softmax of every query
    tile at once, one key tile per query tile and step."""
    H, M = q.shape[1], q.shape[2]
    qt = _as_tiles(q[0], tiles.query_tiles, tiles.tile)  # (T, H, tile, D)
    kt = _as_tiles(expand_kv(k, H)[0], tiles.key_tiles, tiles.tile)  # (key tiles, H, tile, D)
    vt = _as_tiles(expand_kv(v, H)[0], tiles.key_tiles, tiles.tile)
    m_i = torch.full(qt.shape[:-1], float("-inf"), device=q.device)  # (T, H, tile)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros_like(qt)
    for step in range(tiles.steps):
        index, seen = tiles.key_tile(step)
        s, _ = _scores(qt @ kt[index].transpose(-1, -2) * scale, softcap)
        s = s.masked_fill(~seen[:, None], float("-inf"))
        m_new = torch.maximum(m_i, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m_i - m_safe)
        l_i = alpha * l_i + p.sum(-1)
        acc = alpha[..., None] * acc + p @ vt[index]
        m_i = m_new
    empty = l_i == 0
    o = acc / torch.where(empty, 1.0, l_i)[..., None]
    lse = torch.where(empty, float("-inf"), m_i + torch.log(l_i))
    return _from_tiles(o, M).to(q.dtype), _from_tiles(lse, M).contiguous()  # L contiguous, as the kernels'


def _packed_backward_tiles(grad_out, q, k, v, o, lse, tiles: _PackedTiles, scale: float, softcap: float):
    """(dQ, dK, dV) of packed 4-D inputs (`_packed_forward_tiles`), from the forward's O and L (1, H, M).
    The key tiles' gradients gather each step's contributions by index (index_add_: in order, so
    reproducible)."""
    H, M = q.shape[1], q.shape[2]
    Hkv, N = k.shape[1], k.shape[2]
    T, tile = tiles.query_tiles, tiles.tile
    qt, dot = _as_tiles(q[0], T, tile), _as_tiles(grad_out[0], T, tile)
    kt = _as_tiles(expand_kv(k, H)[0], tiles.key_tiles, tile)
    vt = _as_tiles(expand_kv(v, H)[0], tiles.key_tiles, tile)
    delta = (dot * _as_tiles(o[0], T, tile)).sum(-1)  # Dlt = rowsum(dO * O), (T, H, tile)
    lse = F.pad(lse[0], (0, T * tile - M)).view(H, T, tile).transpose(0, 1)
    lse_safe = torch.where(lse == float("-inf"), 0.0, lse)  # empty rows: every score is masked
    dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kt), torch.zeros_like(vt)
    for step in range(tiles.steps):
        index, seen = tiles.key_tile(step)
        kj, vj = kt[index], vt[index]
        s, chain = _scores(qt @ kj.transpose(-1, -2) * scale, softcap)
        p = torch.exp(s.masked_fill(~seen[:, None], float("-inf")) - lse_safe[..., None])
        dv.index_add_(0, index, p.transpose(-1, -2) @ dot)
        ds = p * (dot @ vj.transpose(-1, -2) - delta[..., None])
        if chain is not None:
            ds = ds * chain
        dq += ds @ kj * scale
        dk.index_add_(0, index, ds.transpose(-1, -2) @ qt * scale)
    dk, dv = _reduce_groups(_from_tiles(dk, N), Hkv), _reduce_groups(_from_tiles(dv, N), Hkv)
    return _from_tiles(dq, M).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tiled_forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    tile: int,
    *,
    window=UNBOUNDED,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    softcap: float = 0.0,
):
    """(O, L) as `launchers._launch_forward` returns them."""
    packed = cu_seqlens_q is not None
    q4, k4, v4 = (_batched(t, packed) for t in (q, k, v))
    M, N = q4.shape[2], k4.shape[2]
    if packed:
        tiles = _PackedTiles(M, N, causal, window, tile, cu_seqlens_q, cu_seqlens_k)
        o, lse = _packed_forward_tiles(q4, k4, v4, tiles, scale, softcap)
    else:
        o, lse = _forward_tiles(q4, k4, v4, _Mask(M, N, causal, window, q.device), scale, tile, softcap)
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
    softcap: float = 0.0,
):
    """(dq, dk, dv) as `launchers._launch_backward` returns them."""
    packed = cu_seqlens_q is not None
    q4, k4, v4, do4, o4 = (_batched(t, packed) for t in (q, k, v, grad_out, o))
    lse4 = lse.unsqueeze(0) if packed else lse.unsqueeze(1) if q.dim() == 3 else lse
    M, N = q4.shape[2], k4.shape[2]
    if packed:
        tiles = _PackedTiles(M, N, causal, window, tile, cu_seqlens_q, cu_seqlens_k)
        dq, dk, dv = _packed_backward_tiles(do4, q4, k4, v4, o4, lse4, tiles, scale, softcap)
    else:
        mask = _Mask(M, N, causal, window, q.device)
        dq, dk, dv = _backward_tiles(do4, q4, k4, v4, o4, lse4, mask, scale, tile, softcap)
    dq_contiguous, dkv_contiguous = contiguous_gradients(q, k, v)
    return (
        _unbatched(dq, q, packed, dq_contiguous),
        _unbatched(dk, k, packed, dkv_contiguous),
        _unbatched(dv, v, packed, dkv_contiguous),
    )
