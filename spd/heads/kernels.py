"""Hand-written autograd kernels of the head's training forward (:meth:`spd.heads.speculator.Speculator.forward_train`).

- :class:`ConcatLinear`: ``cat(xs, -1) @ weight.T`` without materialising the concatenation (the fusion of a
  depth's anchor states; also used at inference, where it is a plain matmul per anchor);
- :func:`offset_band_attention`: attention of every query row over depth-max memory plus a band of single
  keys at shallower depths, blockwise over query rows and flash-style (only the output and the log-sum-exp
  are kept for backward), never materialising the (n+1)N x N structural mask of the dense reference.

Shape suffixes: B batch, N positions, D hidden, H query heads, Dh head dim; inside the blockwise attention: K kv
heads, G query heads per kv head, C rows of a query block, Q = G x C, P deep keys a block sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ConcatLinear(torch.autograd.Function):
    """``cat(xs, -1) @ weight.T`` without the concatenation: neither materialised nor kept for backward.

    Backward keeps the anchor states the caller holds anyway instead of a concatenated copy per depth
    (len(anchors) x D per row: 25 D over the 9 depths of n = 8, 420 MB at D = N = 2048). Same products, summed per
    anchor (equal to the concatenated product up to rounding); the autocast dtype under autocast.
    """

    @staticmethod
    def forward(ctx, weight, *xs):
        dev = weight.device
        dt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else weight.dtype
        d = xs[0].shape[-1]
        w = weight.to(dt)
        out = torch.matmul(xs[0].to(dt), w[:, :d].t())
        for i, x in enumerate(xs[1:], start=1):
            out += torch.matmul(x.to(dt), w[:, i * d : (i + 1) * d].t())
        ctx.save_for_backward(weight, *xs)
        ctx.dt = dt
        return out

    @staticmethod
    def backward(ctx, dout):
        weight, *xs = ctx.saved_tensors
        d = xs[0].shape[-1]
        dout_flat = dout.to(ctx.dt).reshape(-1, dout.shape[-1])  # (batch x positions, D)
        grad_w = None
        if ctx.needs_input_grad[0]:
            grad_w = torch.empty(weight.shape, dtype=ctx.dt, device=weight.device)
            for i, x in enumerate(xs):
                torch.mm(dout_flat.t(), x.to(ctx.dt).reshape(-1, d), out=grad_w[:, i * d : (i + 1) * d])
            grad_w = grad_w.to(weight.dtype)
        w = weight.to(ctx.dt)
        grads_x = [
            torch.matmul(dout.to(ctx.dt), w[:, i * d : (i + 1) * d]).to(x.dtype)
            if ctx.needs_input_grad[i + 1]
            else None
            for i, x in enumerate(xs)
        ]
        return grad_w, *grads_x


def offset_band_attention(
    q_BHND: torch.Tensor,
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    deep_depth: int,
    band_depths: list[int],
    fill_B: torch.Tensor,
    valid_BN: torch.Tensor,
    query_chunk: int = 512,
) -> torch.Tensor:
    """Attention (B, H, N, Dh) of every query ``t`` over deep keys ``i <= t - a`` and ``a`` band keys, one softmax.

    ``kv`` maps depth -> (keys, values) (B, Hk, N, Dh). The deep keys are the rows at ``deep_depth``; band
    key ``j`` of query ``t`` is row ``t - j`` at depth ``band_depths[j]``; ``a = fill_B`` per example;
    padding rows (``~valid_BN``) are never attended. Queries run in blocks of ``query_chunk`` rows.
    """
    depths = sorted(kv)
    return _OffsetBandAttention.apply(
        q_BHND,
        fill_B,
        valid_BN,
        depths.index(deep_depth),
        tuple(depths.index(d) for d in band_depths),
        query_chunk,
        *(x for d in depths for x in kv[d]),
    )


class _OffsetBandAttention(torch.autograd.Function):
    """Flash-style blockwise attention: forward keeps only the output and the log-sum-exp for backward.

    Per block of C query rows the deep scores cover only the keys left of the block's shifted causal
    diagonal (keys right of it are never computed) and the J band scores join them in one softmax;
    backward recomputes the probabilities from the log-sum-exp. So at most C x N scores per head exist at
    a time and nothing of the score size lives from forward to backward. Matmuls run in the inputs' dtype
    (the autocast dtype under autocast); softmax statistics and gradient sums in at least float32.
    """

    @staticmethod
    def forward(ctx, q_BHND, fill_B, valid_BN, deep, band, chunk, *kv):
        dev = q_BHND.device
        dt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else q_BHND.dtype
        acc = torch.promote_types(dt, torch.float32)
        b, h, n_pos, dh = q_BHND.shape
        hk = kv[0].shape[1]
        q_BKGND = q_BHND.to(dt).reshape(b, hk, h // hk, n_pos, dh)  # query head hk * G + r reads kv head hk
        # The deep keys and values go through matmuls (contiguous, copied once); band rows are only
        # multiplied elementwise, so they stay as they are (no copy of 2 x n x N x D).
        keys = [x.to(dt).contiguous() if i == deep else x.to(dt) for i, x in enumerate(kv[0::2])]
        values = [x.to(dt).contiguous() if i == deep else x.to(dt) for i, x in enumerate(kv[1::2])]
        min_fill = int(fill_B.min())
        out_BKGND = q_BKGND.new_empty(q_BKGND.shape)
        lse_BKGN = torch.empty(q_BKGND.shape[:-1], dtype=acc, device=dev)
        for lo in range(0, n_pos, chunk):
            blk = _QueryBlock(q_BKGND, keys, values, deep, band, fill_B, valid_BN, min_fill, lo, chunk, acc)
            p_deep, p_band, lse_BKGC = blk.probs()
            out_BKGND[:, :, :, blk.rows] = blk.mix(p_deep, p_band)
            lse_BKGN[:, :, :, blk.rows] = lse_BKGC
        ctx.save_for_backward(q_BKGND, fill_B, valid_BN, out_BKGND, lse_BKGN, *keys, *values)
        ctx.meta = (deep, band, chunk, min_fill, q_BHND.dtype, [x.dtype for x in kv])
        return out_BKGND.view(b, h, n_pos, dh).to(q_BHND.dtype)

    @staticmethod
    def backward(ctx, dout_BHND):
        q_BKGND, fill_B, valid_BN, out_BKGND, lse_BKGN, *kv = ctx.saved_tensors
        deep, band, chunk, min_fill, q_dtype, kv_dtypes = ctx.meta
        keys, values = kv[: len(kv) // 2], kv[len(kv) // 2 :]
        acc = lse_BKGN.dtype
        b, hk, g, n_pos, dh = q_BKGND.shape
        dout_BKGND = dout_BHND.to(q_BKGND.dtype).reshape(q_BKGND.shape)
        dq_BKGND = torch.empty(q_BKGND.shape, dtype=acc, device=q_BKGND.device)
        dkeys = [torch.zeros(k.shape, dtype=acc, device=k.device) for k in keys]
        dvalues = [torch.zeros(v.shape, dtype=acc, device=v.device) for v in values]
        for lo in range(0, n_pos, chunk):
            blk = _QueryBlock(q_BKGND, keys, values, deep, band, fill_B, valid_BN, min_fill, lo, chunk, acc)
            p_deep, p_band, _ = blk.probs(lse_BKGN[:, :, :, blk.rows])
            dq_BKGND[:, :, :, blk.rows] = blk.backward(
                p_deep, p_band, dout_BKGND[:, :, :, blk.rows], out_BKGND[:, :, :, blk.rows], dkeys, dvalues
            )
        grads_kv = []
        for i, (dk, dv) in enumerate(zip(dkeys, dvalues)):
            grads_kv += [dk.to(kv_dtypes[2 * i]), dv.to(kv_dtypes[2 * i + 1])]
        return dq_BKGND.view(b, hk * g, n_pos, dh).to(q_dtype), None, None, None, None, None, *grads_kv


class _QueryBlock:
    """Query rows ``lo .. lo+C-1`` of :class:`_OffsetBandAttention`: masks, probabilities, output, gradients."""

    def __init__(
        self,
        q_BKGND: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        deep: int,
        band: tuple[int, ...],
        fill_B: torch.Tensor,
        valid_BN: torch.Tensor,
        min_fill: int,
        lo: int,
        chunk: int,
        acc: torch.dtype,
    ):
        b, _, _, n_pos, dh = q_BKGND.shape
        dev = q_BKGND.device
        hi = min(n_pos, lo + chunk)
        self.lo, self.hi, self.rows, self.acc, self.scale = lo, hi, slice(lo, hi), acc, dh**-0.5
        self.q_BKGCD = q_BKGND[:, :, :, lo:hi]
        self.keys, self.values, self.deep, self.band = keys, values, deep, band
        # Only deep keys i <= t - a for some row t < hi of some example: the rest lie right of the diagonal.
        self.n_deep = max(0, min(n_pos, hi - min_fill))
        t_C = torch.arange(lo, hi, device=dev)
        fill_B11 = fill_B.view(b, 1, 1)
        i_P = torch.arange(self.n_deep, device=dev)
        self.deep_B11CP = ((t_C[:, None] - i_P[None, :] >= fill_B11) & valid_BN[:, None, : self.n_deep])[:, None, None]
        j_J = torch.arange(len(band), device=dev)
        src_CJ = t_C[:, None] - j_J[None, :]  # the row that band key j of query t comes from
        self.band_B11CJ = ((j_J < fill_B11) & (src_CJ >= 0) & valid_BN[:, src_CJ.clamp(min=0)])[:, None, None]

    def _band_rows(self, x_BKND: torch.Tensor, j: int) -> torch.Tensor:
        """Rows ``t - j`` for the block's rows ``t`` (B, K, C, Dh); zeros where ``t - j < 0`` (masked)."""
        n_real = max(0, self.hi - j) - max(0, self.lo - j)
        return F.pad(x_BKND[:, :, max(0, self.lo - j) : max(0, self.hi - j)], (0, 0, self.hi - self.lo - n_real, 0))

    def _add_band_rows(self, grad_BKND: torch.Tensor, j: int, g_BKCD: torch.Tensor) -> None:
        """Adds a block's band-key gradient back to the rows it came from (inverse of :meth:`_band_rows`)."""
        lo, hi = max(0, self.lo - j), max(0, self.hi - j)
        grad_BKND[:, :, lo:hi] += g_BKCD[:, :, g_BKCD.shape[2] - (hi - lo) :]

    def _deep_scores(self) -> torch.Tensor:
        b, hk, g, c, dh = self.q_BKGCD.shape
        k_BKPD = self.keys[self.deep][:, :, : self.n_deep]
        s = torch.matmul(self.q_BKGCD.reshape(b, hk, g * c, dh), k_BKPD.transpose(-1, -2))
        s = s.view(b, hk, g, c, self.n_deep).to(self.acc).mul_(self.scale)
        return s.masked_fill_(~self.deep_B11CP, float("-inf"))

    def _band_scores(self) -> torch.Tensor:
        q = self.q_BKGCD.to(self.acc)
        s = torch.stack(
            [(q * self._band_rows(self.keys[d], j)[:, :, None].to(self.acc)).sum(-1) for j, d in enumerate(self.band)],
            dim=-1,
        )
        return s.mul_(self.scale).masked_fill_(~self.band_B11CJ, float("-inf"))

    def probs(self, lse_BKGC: torch.Tensor | None = None):
        """Softmax probabilities of the deep and band keys, and the log-sum-exp (given: recomputation)."""
        s_deep, s_band = self._deep_scores(), self._band_scores()
        if lse_BKGC is None:
            m_BKGC = s_band.amax(-1)
            if self.n_deep:
                m_BKGC = torch.maximum(m_BKGC, s_deep.amax(-1))
            m_BKGC = torch.where(torch.isfinite(m_BKGC), m_BKGC, 0.0)  # a row with no key: output 0
            s_deep.sub_(m_BKGC[..., None]).exp_()
            s_band.sub_(m_BKGC[..., None]).exp_()
            total_BKGC = s_deep.sum(-1) + s_band.sum(-1)
            # +inf for a row with no key, so that recomputed probabilities are exp(-inf - inf) = 0.
            lse_BKGC = torch.where(total_BKGC > 0, m_BKGC + total_BKGC.log(), float("inf"))
            total_BKGC = torch.where(total_BKGC > 0, total_BKGC, 1.0)[..., None]
            return s_deep.div_(total_BKGC), s_band.div_(total_BKGC), lse_BKGC
        return s_deep.sub_(lse_BKGC[..., None]).exp_(), s_band.sub_(lse_BKGC[..., None]).exp_(), lse_BKGC

    def mix(self, p_deep: torch.Tensor, p_band: torch.Tensor) -> torch.Tensor:
        """The block's output (B, K, G, C, Dh): probabilities times values."""
        b, hk, g, c, dh = self.q_BKGCD.shape
        dt = self.q_BKGCD.dtype
        v_BKPD = self.values[self.deep][:, :, : self.n_deep]
        out = torch.matmul(p_deep.to(dt).view(b, hk, g * c, self.n_deep), v_BKPD).view(b, hk, g, c, dh).to(self.acc)
        for j, d in enumerate(self.band):
            out += p_band[..., j, None] * self._band_rows(self.values[d], j)[:, :, None].to(self.acc)
        return out.to(dt)

    def backward(self, p_deep, p_band, dout_BKGCD, out_BKGCD, dkeys, dvalues) -> torch.Tensor:
        """Adds the block's key and value gradients to ``dkeys``/``dvalues``; returns its query gradient."""
        b, hk, g, c, dh = self.q_BKGCD.shape
        dt, acc, n_deep = self.q_BKGCD.dtype, self.acc, self.n_deep
        q_BKQD = self.q_BKGCD.reshape(b, hk, g * c, dh)  # Q = G x C query rows per kv head
        dout_BKQD = dout_BKGCD.reshape(b, hk, g * c, dh)
        # The softmax backward's row term: sum_k p_k dp_k = dout . out.
        delta_BKGC = (dout_BKGCD.to(acc) * out_BKGCD.to(acc)).sum(-1)
        k_BKPD = self.keys[self.deep][:, :, :n_deep]
        v_BKPD = self.values[self.deep][:, :, :n_deep]
        p_BKQP = p_deep.to(dt).view(b, hk, g * c, n_deep)
        dvalues[self.deep][:, :, :n_deep] += torch.matmul(p_BKQP.transpose(-1, -2), dout_BKQD)
        dp = torch.matmul(dout_BKQD, v_BKPD.transpose(-1, -2)).view(b, hk, g, c, n_deep).to(acc)
        ds_BKQP = p_deep.mul_(dp.sub_(delta_BKGC[..., None])).mul_(self.scale).to(dt).view(b, hk, g * c, n_deep)
        dkeys[self.deep][:, :, :n_deep] += torch.matmul(ds_BKQP.transpose(-1, -2), q_BKQD)
        dq_BKGCD = torch.matmul(ds_BKQP, k_BKPD).view(b, hk, g, c, dh).to(acc)
        dout_acc, q_acc = dout_BKGCD.to(acc), self.q_BKGCD.to(acc)
        for j, d in enumerate(self.band):
            k_BK1CD = self._band_rows(self.keys[d], j)[:, :, None].to(acc)
            v_BK1CD = self._band_rows(self.values[d], j)[:, :, None].to(acc)
            p_BKGC1 = p_band[..., j, None]
            ds_BKGC1 = p_BKGC1 * ((dout_acc * v_BK1CD).sum(-1, keepdim=True) - delta_BKGC[..., None]) * self.scale
            dq_BKGCD += ds_BKGC1 * k_BK1CD
            self._add_band_rows(dkeys[d], j, (ds_BKGC1 * q_acc).sum(2))
            self._add_band_rows(dvalues[d], j, (p_BKGC1 * dout_acc).sum(2))
        return dq_BKGCD
