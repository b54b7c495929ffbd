"""The CPU compatibility layer redirects CUDA placements only while active and undoes everything."""

import pytest
import torch

pytest.importorskip("megatron.core")

from dora_megatron.trainer import cpu_compat  # noqa: E402


def test_cuda_placements_become_cpu_while_active():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    with cpu_compat.cpu_compat("cpu"):
        a = torch.zeros(2, device="cuda")
        b = torch.empty(3, device=torch.device("cuda", 0))
        c = torch.ones(1, device=torch.cuda.current_device())
        assert a.device.type == b.device.type == c.device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.to(torch.float64).dtype == torch.float64
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_megatron_rng_helpers_use_cpu_generator_and_are_restored():
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    orig_get = mrandom._get_cuda_rng_state
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    handle = cpu_compat.activate("cpu")
    try:
        torch.manual_seed(5)
        state = mrandom._get_cuda_rng_state()
        x = torch.rand(3)
        mrandom._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(3), x)
        assert moe_utils.te_general_gemm is None or had_gemm
    finally:
        handle.deactivate()
    handle.deactivate()  # idempotent
    assert mrandom._get_cuda_rng_state is orig_get
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert not handle.active


def test_inactive_for_cuda_device():
    handle = cpu_compat.activate("cuda")
    assert not handle.active
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
