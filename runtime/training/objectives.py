"""EAGLE-3 training objectives (`train_draft.algorithm.loss`). ModelOpt 0.47 trains the draft on the soft
cross-entropy to the target's distribution over the draft vocabulary (modelopt/torch/speculative/plugins/hf_eagle.py,
`HFEagleModel._eagle_loss`: -sum_v p_v log q_v, the forward KL plus the target's entropy): `kl`, the default, keeps it.

The LK losses (Samarin et al., arXiv 2602.23881) optimise acceptance itself: the acceptance rate of a draft
distribution q under a target distribution p is the overlap alpha = sum_v min(p_v, q_v) = 1 - TV(p, q). As vLLM's
speculators implements them (src/speculators/losses/eager.py, commit c05b95b303f7, `neg_log_acceptance_loss`,
`lk_hybrid_loss`):
- `nla`: -log(max(alpha, 1e-5)), cross-entropy when p is a point mass;
- `lk_hybrid`: lambda KL(p || q) + (1 - lambda) (1 - alpha) with lambda = exp(-eta sg[alpha]): KL's gradient while
  the overlap is small, TV once it grows (eta 3, the paper's best).
The objective replaces the model's `_eagle_loss` (same arguments, same accuracy), so ModelOpt's TTT loop, its
decay over TTT steps and its masks stay as they are."""
from __future__ import annotations

OBJECTIVES = ("kl", "lk_hybrid", "nla")
_NLA_EPS = 1e-5


def per_position(kind: str, p, draft_logits, eta: float = 3.0):
    """The loss of each position ([..., V] -> [...]): `p` the target's probabilities over the draft vocabulary,
    `draft_logits` the draft's logits. `kl` is the forward KL (ModelOpt's loss less the target's entropy, which
    has no gradient)."""
    import torch

    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    p = p.float()
    if kind == "kl":
        return (torch.xlogy(p, p) - p * logq).sum(-1)
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    if kind == "nla":
        return -torch.log(alpha.clamp_min(_NLA_EPS))
    if kind == "lk_hybrid":
        kl = (torch.xlogy(p, p) - p * logq).sum(-1)
        weight = torch.exp(-eta * alpha.detach())
        return weight * kl + (1.0 - weight) * (1.0 - alpha)
    raise ValueError(f"unknown EAGLE-3 objective {kind!r}; one of {OBJECTIVES}")


def eagle_loss(kind: str, eta: float):
    """A replacement for ModelOpt's `HFEagleModel._eagle_loss(base_output_softmax_logits, base_output_predict_tok,
    eagle_logits, loss_mask)` -> (loss over the unmasked positions, accuracy of the draft's argmax)."""

    def loss(base_output_softmax_logits, base_output_predict_tok, eagle_logits, loss_mask):
        mask = loss_mask[:, : eagle_logits.shape[1]].float()
        value = (per_position(kind, base_output_softmax_logits, eagle_logits, eta) * mask).sum() / (mask.sum() + 1e-5)
        valid = mask.bool()
        correct = (base_output_predict_tok == eagle_logits.detach().argmax(dim=-1)) & valid
        return value, correct.sum().float() / valid.sum().clamp_min(1).float()

    return loss


def install(model, kind: str, eta: float, compile_loss: bool = False) -> None:
    """Train `model` (converted by ModelOpt for EAGLE-3) on objective `kind`; `kl` leaves ModelOpt's loss."""
    if kind not in OBJECTIVES:
        raise ValueError(f"unknown EAGLE-3 objective {kind!r}; one of {OBJECTIVES}")
    if kind == "kl":
        return
    fn = eagle_loss(kind, eta)
    if compile_loss:
        import torch

        fn = torch.compile(fn, dynamic=False, fullgraph=True)
    model._eagle_loss = fn
