"""Gradient comparisons shared by the tests that check rp.hf.wrap against transformers."""


def rel(a, b):
    """Largest absolute difference relative to b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def check_grads(model, ref, tol=1e-5, every=False):
    """Each of model's gradients within tol (rel) of ref's parameter of the same name; a parameter without
    a reference gradient must have none (or zeros) here, and with every=True must not exist at all."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name]
        if q.grad is None:
            assert not every, name
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert p.grad is not None, name
        assert rel(p.grad, q.grad) <= tol, (name, rel(p.grad, q.grad))
