"""Plain PyTorch training with the engine's documented asynchronous step semantics.

Step s opens a window of k training calls (k = training calls since the previous step,
at least 1) that still read the weights from before step s; the next step and every
sync point (synchronize, state_dict, load_state_dict, a synchronous step, a forward-only
call) close it.  Gradients accumulate in p.grad across calls; step() applies them with
optional global-norm clipping and an lr scheduler stepped right after the update.
"""
import copy

import torch
import torch.nn.functional as F


class StaleReference:
    def __init__(self, module, opt_factory, sched_factory=None, max_grad_norm=None, loss_fn=F.mse_loss):
        self.cur = copy.deepcopy(module)
        self.stale = copy.deepcopy(module)
        self.opt = opt_factory(self.cur.parameters())
        self.sched = sched_factory(self.opt) if sched_factory is not None else None
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.prev = None          # state dict before the latest step
        self.window = 0           # training calls still reading self.prev
        self.calls_since = 0
        self.calls = []           # (x, y, the weights it read) of each training call since the last step

    def forward_backward(self, x, y, return_outputs=False):
        model = self.cur
        if self.window > 0:
            self.window -= 1
            self.stale.load_state_dict(self.prev)
            model = self.stale
        self.calls_since += 1
        params = [p for p in model.parameters() if p.requires_grad]
        self.calls.append((x.detach().clone(), y.detach().clone(), copy.deepcopy(model.state_dict())))
        out = model(x)
        loss = self.loss_fn(out, y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip([p for p in self.cur.parameters() if p.requires_grad], grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        return (loss.detach(), out.detach()) if return_outputs else loss.detach()

    def composed(self, x, y):
        """`loss_fn(model(x), y).backward()` through a composed call: its forward is a sync point, and its
        backward a training call on the newest weights."""
        self.flush()
        return self.forward_backward(x, y, return_outputs=True)

    def step(self, asynchronous, max_grad_norm=...):
        """max_grad_norm: this step's clipping (default: the constructor's)."""
        max_grad_norm = self.max_grad_norm if max_grad_norm is ... else max_grad_norm
        self.prev = copy.deepcopy(self.cur.state_dict())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self.cur.parameters() if p.grad is not None],
                                           max_grad_norm)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.window = max(1, self.calls_since) if asynchronous else 0
        self.calls_since = 0
        self.calls = []

    def flush(self):
        self.window = 0

    def __call__(self, x):
        self.flush()
        with torch.no_grad():
            return self.cur(x)
