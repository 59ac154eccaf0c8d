"""The Triton log-prob backward tile: the shared chunked backward (``grpo_fast.logprobs_torch._backward``) with the
Triton ``dz`` kernel in place of the torch tile. The forward and the autograd wiring are in ``grpo_fast.ops``."""

from __future__ import annotations

import torch


def triton_tile_grad(h_r, w_c, bias_c, y_r, g_r, ge_r, m_r, logs_r, ent_r, c0, c1, params, acc):
    """The Triton twin of ``logprobs_torch.torch_tile_grad``: same inputs, ``dz [R, C]`` in ``acc``."""
    from grpo_fast.kernels.linear_logprobs import linear_logprob_dlogits

    stats = torch.cat([m_r, logs_r, ent_r if ent_r is not None else torch.zeros_like(m_r)], dim=1).float()
    return linear_logprob_dlogits(
        h_r.contiguous(), w_c, bias_c, (y_r - c0).contiguous(), stats.contiguous(),
        None if g_r is None else g_r.float().contiguous(), None if ge_r is None else ge_r.float().contiguous(),
        params.temperature, params.softcap, acc,
    )
