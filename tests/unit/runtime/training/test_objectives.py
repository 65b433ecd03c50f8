"""EAGLE-3 training objectives (runtime/training/objectives.py): ModelOpt's loss read as what it is, the LK losses
as vLLM's speculators defines them (src/speculators/losses/eager.py, commit c05b95b303f7: tv_loss,
neg_log_acceptance_loss, lk_hybrid_loss), and the replacement of ModelOpt's `_eagle_loss` keeping its arguments and
its accuracy (modelopt 0.47, modelopt/torch/speculative/plugins/hf_eagle.py `HFEagleModel._eagle_loss`)."""
from __future__ import annotations

import pytest
import torch

from runtime.training import objectives as O


def _dists(seed=0, shape=(2, 5, 11)):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g) * 2, -1), torch.randn(*shape, generator=g) * 2


def test_modelopt_loss_is_kl_plus_the_targets_entropy_and_the_replacement_keeps_its_accuracy():
    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel

    p, logits = _dists()
    logits[0, :2] = 3 * p[0, :2].log()          # the draft agrees with the target at two unmasked positions
    tok = p.argmax(-1)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    ref_loss, ref_acc = HFEagleModel._eagle_loss(None, p, tok, logits, mask)     # ModelOpt's (it reads no state)
    kl_loss, acc = O.eagle_loss("kl", 3.0)(p, tok, logits, mask)
    entropy = -(torch.xlogy(p, p).sum(-1) * mask).sum() / (mask.sum() + 1e-5)
    assert kl_loss + entropy == pytest.approx(ref_loss.item(), abs=1e-5)
    assert acc.item() == pytest.approx(ref_acc.item()) and 0 < acc.item() < 1
    for kind in ("nla", "lk_hybrid"):
        value, acc = O.eagle_loss(kind, 3.0)(p, tok, logits, mask)
        assert acc.item() == pytest.approx(ref_acc.item()) and value.item() != pytest.approx(kl_loss.item(), abs=1e-3)


def test_lk_losses_are_speculators_formulas():
    p, logits = _dists(1)
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(p, q).sum(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(O.per_position("kl", p, logits), kl, atol=1e-5)
    assert torch.allclose(O.per_position("nla", p, logits), -alpha.log(), atol=1e-5)
    w = torch.exp(-3.0 * alpha)
    assert torch.allclose(O.per_position("lk_hybrid", p, logits, 3.0), w * kl + (1 - w) * (1 - alpha), atol=1e-5)
    # the blend's ends: eta -> 0 is KL, eta -> inf is TV (speculators' tests of lk_hybrid_loss)
    assert torch.allclose(O.per_position("lk_hybrid", p, logits, 1e-9), kl, atol=1e-5)
    assert torch.allclose(O.per_position("lk_hybrid", p, logits, 1e9), 1 - alpha, atol=1e-5)
    # identical distributions accept everything; a point-mass target makes nla the cross-entropy
    assert torch.allclose(O.per_position("nla", q, logits), torch.zeros_like(alpha), atol=1e-5)
    one_hot = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), p.argmax(-1).reshape(-1), reduction="none")
    assert torch.allclose(O.per_position("nla", one_hot, logits).reshape(-1), ce, atol=1e-5)


def test_lk_hybrid_weight_carries_no_gradient_and_install_replaces_the_loss():
    p, logits = _dists(2)
    logits.requires_grad_(True)
    O.per_position("lk_hybrid", p, logits).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(p, q).sum(-1)
    w = torch.exp(-3.0 * alpha).detach()
    (w * (p * (p.log() - q.log())).sum(-1) + (1 - w) * (1 - alpha)).sum().backward()
    assert torch.allclose(g, logits.grad, atol=1e-6)

    class Model:
        _eagle_loss = "modelopt's"

    m = Model()
    O.install(m, "kl", 3.0)
    assert m._eagle_loss == "modelopt's"
    O.install(m, "nla", 3.0)
    tok, mask = p.argmax(-1), torch.ones(2, 5)
    assert m._eagle_loss(p, tok, logits, mask)[0].item() == pytest.approx(O.per_position("nla", p, logits).mean().item(),
                                                                           rel=1e-4)
    with pytest.raises(ValueError, match="unknown EAGLE-3 objective 'tv'"):
        O.install(m, "tv", 3.0)
