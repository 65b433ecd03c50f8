"""Choosing tokens: the target's (and a drafter's) sampling distribution (`probs`: temperature and nucleus
top_p), one pick from it (`pick`: greedy argmax at temperature 0), and the acceptance rule that decides how many
draft tokens a verification keeps (`accept`): greedy (d_j accepted while it equals the target's argmax) or the
standard rejection-sampling rule (accept d_j with probability min(1, p(d_j)/q(d_j)); on the first rejection
sample from norm(max(0, p - q)); if all k are accepted, sample a bonus token from p), so the output
distribution is exactly the target's. `SpeculativeEngine._accept` is `accept` (a subclass may replace it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """A batch's sampling rule: `temperature` (0: greedy), `top_p` (< 1: sampling restricted to the nucleus) and the
    seed of the batch's random generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


GREEDY = Sampling()     # the default: greedy decoding, seed 0


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T), restricted to the smallest set of tokens whose mass reaches top_p (nucleus), renormalized."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sp, si = p.sort(-1, descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p           # mass before this token already reaches top_p
    sp = sp.masked_fill(drop, 0.0)
    p = torch.zeros_like(p).scatter(-1, si, sp)
    return p / p.sum(-1, keepdim=True)


def pick(logits: torch.Tensor, temperature: float, gen, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy argmax, or a sample from softmax(logits / T) (nucleus-filtered by top_p) with its distribution."""
    if temperature <= 0:
        return logits.argmax(-1), None
    p = probs(logits, temperature, top_p)
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(p.shape[:-1]), p


def accept(logits, d, q, temperature, gen, top_p: float = 1.0, lens: torch.Tensor | None = None):
    """logits [B, k+1, V]. Returns (accepted count [B], next token [B]). `lens` [B]: only the first lens[b] drafts
    of row b are proposals (the rest is padding, never accepted; its q must be zero)."""
    B, T, V = logits.shape
    rows = torch.arange(B, device=logits.device)
    real = None if lens is None or d is None else torch.arange(d.shape[1], device=d.device)[None] < lens[:, None]
    if temperature <= 0:
        tgt = logits.argmax(-1)
        if d is None:
            return torch.zeros(B, dtype=torch.long, device=logits.device), tgt[:, 0]
        same = d == tgt[:, :-1]
        acc = torch.cumprod((same if real is None else same & real).long(), 1).sum(1)
        return acc, tgt[rows, acc]
    p = probs(logits, temperature, top_p)
    if d is None:
        return torch.zeros(B, dtype=torch.long, device=logits.device), torch.multinomial(p[:, 0], 1, generator=gen)[:, 0]
    k = d.shape[1]
    pd = p[:, :k].gather(-1, d[..., None])[..., 0]
    qd = q.gather(-1, d[..., None])[..., 0]
    u = torch.rand(B, k, generator=gen, device=logits.device)
    ok = u * qd < pd                                # u < min(1, p/q) without dividing by q
    if real is not None:
        ok &= real                                  # padding: stop there; its q = 0, so the next token is from p
    acc = torch.cumprod(ok.long(), 1).sum(1)
    # where rejected at position a: residual norm(max(0, p_a - q_a)); all accepted: p_k
    q_full = torch.cat((q, q.new_zeros(B, 1, V)), 1)
    resid = (p - q_full).clamp_min(0)
    resid_a = resid[rows, acc]
    mass = resid_a.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, resid_a / mass.clamp_min(1e-30), p[rows, acc])
    return acc, torch.multinomial(dist, 1, generator=gen)[:, 0]
