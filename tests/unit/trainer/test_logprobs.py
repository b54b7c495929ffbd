import torch

from dora_megatron.trainer.logprobs import token_logprobs_and_entropy


def test_matches_log_softmax_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    logp, ent = token_logprobs_and_entropy(logits, targets, vocab_size=11)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(logp, ref.gather(-1, targets[..., None])[..., 0], atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_padded_vocab_rows_are_ignored():
    logits = torch.randn(1, 3, 12)
    logits[..., 10:] = 50.0  # padding rows must not take probability mass
    targets = torch.tensor([[1, 2, 3]])
    logp, ent = token_logprobs_and_entropy(logits, targets, vocab_size=10)
    ref = torch.log_softmax(logits[..., :10], -1)
    assert torch.allclose(logp, ref.gather(-1, targets[..., None])[..., 0], atol=1e-6)
    assert torch.isfinite(ent).all()


def test_gradient_matches_autograd_of_log_softmax():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    targets = torch.tensor([[0, 6, 3, 3]])
    logp, _ = token_logprobs_and_entropy(logits, targets, vocab_size=7, with_entropy=False)
    logp.sum().backward()
    g1 = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, targets[..., None]).sum().backward()
    assert torch.allclose(g1, logits.grad, atol=1e-6)
