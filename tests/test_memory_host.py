"""Host memory: nothing the engine builds outlives its use (planning copies, autograd graphs), and the
host bytes per parameter of a bf16 model with rp AdamW stay near the accounted 16-18."""
import gc
import warnings

import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe.commands.train import TrainConfig
from roundpipe.engine.autoplan import size_costs
from roundpipe.models.tiny_decoder import build_layers, loss_fn


def _live(pred) -> list:
    """Live objects for which pred holds (after a collection)."""
    gc.collect()
    with warnings.catch_warnings():   # isinstance on deprecated torch.distributed aliases warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if pred(o)]


def _graph_tensors() -> int:
    """Live tensors that carry an autograd graph (grad_fn)."""
    return len(_live(lambda o: isinstance(o, torch.Tensor) and o.grad_fn is not None))


def _decoder(seed: int = 0):
    cfg = TrainConfig(size="tiny", devices=["cpu"], seq_len=32, batch_size=2).resolved()
    return build_layers(cfg.model_config(), seed=seed)


def test_dry_run_keeps_no_layer_copies():
    """The planner's CPU dry run (bf16 copies of every layer, one forward with grad) leaves no autograd
    graph and no layer copy behind (its saved-tensor hook once packed each tensor as itself: a cycle
    through the graph that gc cannot see, keeping the copies' weights alive for good)."""
    torch.manual_seed(0)
    layers = _decoder()
    x = torch.randint(0, 256, (2, 32))
    before = _graph_tensors()
    costs = size_costs(layers, ((x,), {}), torch.bfloat16, "cpu")
    assert len(costs) == len(layers) and all(c.act_bytes > 0 for c in costs)
    assert _graph_tensors() == before


def test_no_graph_or_weight_copy_after_synchronize():
    """After calls and steps and a sync point, no tensor with an autograd graph is alive and no compute-dtype
    Parameter (a worker's or the planner's layer copy) either."""
    torch.manual_seed(0)
    layers = _decoder()
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.step(opt, asynchronous=True)
        model.synchronize()
        assert _graph_tensors() == 0
        assert not _live(lambda o: isinstance(o, torch.nn.Parameter) and o.dtype == torch.bfloat16)
