"""How a RoundPipe issues optimizer steps: `step()`, the G-copy that moves landed gradients into p.grad,
the fp16 loss scale's bookkeeping, and a checkpoint's pending step issued again.  `RoundPipe` (model.py)
derives from `ModelSteps`; the update itself runs per layer on the host thread (engine/step/: async_step.py
the gates and the stale window, optimizer_step.py the optimizer protocol, loss_scale.py the scale).
"""
from __future__ import annotations

from roundpipe.core.executor import on_thread, register_then_queue
from roundpipe.engine.step import loss_scale
from roundpipe.engine.step.async_step import run_gcopy, run_step
from roundpipe.engine.step.optimizer_step import check_step_args, copy_step, make_step


class ModelSteps:
    """The step side of `RoundPipe` (see the module docstring)."""

    def _issue_gcopy(self) -> None:
        """Moves the gradients landed since the last G-copy into p.grad (after earlier steps read it)."""
        if not self.run_state.grads_pending:
            return
        self.run_state.grads_pending = False
        sync, host, dp = self.sync, self.host, self.dp   # a queued job must not keep the model alive
        reduce = dp.reducer(host) if dp is not None else None
        register_then_queue(sync.issue_gcopy, lambda after: self.gcopy_thread.submit(
            lambda: run_gcopy(sync, after, host.gcopy, reduce)))

    def step(self, optimizer, asynchronous: bool = False, *, lr_scheduler=None,
             max_grad_norm: float | None = None) -> None:
        """Applies the gradients accumulated since the last step, then clears them.

        optimizer: a torch.optim.Optimizer over `parameters()` (every parameter that requires
        grad, nothing else), a zero-argument callable, or a per-layer fused optimizer (an object
        with `step_layer(params, upload)`, e.g. roundpipe.optim.AdamW: updates one layer's fp32
        masters from their `.grad` and writes their upload copies, layer by layer as the next
        call frees them).  asynchronous=False (default) returns with the update applied: training
        equals plain PyTorch's.  True overlaps the update with the next call (one step stale, see
        roundpipe/engine/step/async_step.py): faster where the step does not hide otherwise, at a
        measured cost in loss (docs/staleness.md, "The default").
        lr_scheduler: stepped right after this update, as `opt.step(); sched.step()` would.
        max_grad_norm: clip like torch.nn.utils.clip_grad_norm_ over every gradient first.
        Errors inside the update are raised here (synchronous), else by the engine call during
        which they happen or by the next one (README: Errors).
        """
        with self._api:
            self._check_open()
            max_norm = check_step_args(asynchronous, lr_scheduler, max_grad_norm, optimizer)
            if asynchronous and self.device_step is not None:
                raise ValueError("step(asynchronous=True) with device_step=True: the device step updates the "
                                 "weights the next call binds in place, so it is synchronous only; call "
                                 "step(optimizer) (asynchronous=False)")
            comp = self.compensation
            fns = self._make_step(optimizer, lr_scheduler, max_norm, self._scale_index(),
                                  comp.predict if comp is not None and asynchronous else 0.0,
                                  comp.lr_factor(self.run_state.counted[1] + self.sync.steps_issued) if comp else 1.0)
            self._issue_step(fns, asynchronous)

    def _make_step(self, optimizer, lr_scheduler, max_norm: float | None, scale_used: int, predict: float,
                   lr_factor: float):
        """The next step's StepFns; what it was given is kept for a checkpoint saved while it is pending."""
        self.run_state.step_info = {"optimizer": optimizer, "lr_scheduler": lr_scheduler, "max_grad_norm": max_norm,
                           "scale_used": scale_used, "predict": predict, "lr_factor": lr_factor}
        device = (self.device_step, self.device_step.chosen(0) | self._device_layers) \
            if self.device_step is not None else None
        fns = make_step(optimizer, self.host, list(self.module.named_parameters()), lr_scheduler, max_norm,
                        self.scaler, self.sync.steps_issued + 1, scale_used, self.shards, predict, lr_factor,
                        device)
        return self.offload.wrap(fns, optimizer) if self.offload is not None else fns

    def _scale_index(self) -> int:
        """The loss-scale history entry of the calls issued now and of the step after them."""
        return loss_scale.LossScaler.group_index(self.sync.steps_issued, self.run_state.latest_asynchronous)

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (after the last step that checked its gradients), or None."""
        return self.scaler.scale if self.scaler is not None else None

    def _issue_step(self, fns, asynchronous: bool, window: int | None = None) -> None:
        if asynchronous and self._grads_reserved:   # the set a pending step holds while the next calls land theirs
            self.host.reserve_gradients(2, reduced=self.dp is not None)
        self._refresh_edited()   # calls in this step's stale window read the masters as they are now
        self._issue_gcopy()
        sync, w, host = self.sync, self.workers[0], self.host_thread   # a queued job must not keep the model alive
        warm = not asynchronous and len(self.workers) == 1 and w.device.type == "cpu" and not (self.dp or self.offload)
        register_then_queue(lambda: sync.new_step(asynchronous, fns.before_gates, window), lambda rec: host.submit(
            on_thread(w.submit, lambda: run_step(sync, rec, fns)) if warm else lambda: run_step(sync, rec, fns)))
        self.run_state.latest_asynchronous = asynchronous
        if not asynchronous:
            self._drain()

    def reissue_step(self, step: dict, optimizer, lr_scheduler) -> None:
        """A checkpoint's pending step, issued again with its stale window (used by load_checkpoint)."""
        used = step["scale_used"] + self.sync.steps_issued + 1   # saved relative to the step's own index
        if step["kind"] == "update":
            fns = self._make_step(optimizer, lr_scheduler, step["max_grad_norm"], used, step["predict"],
                                  step["lr_factor"])
        else:
            self.run_state.step_info = {"optimizer": optimizer, "lr_scheduler": lr_scheduler, "max_grad_norm": None,
                               "scale_used": used, "predict": 0.0, "lr_factor": 1.0}
            fns = copy_step(optimizer, self.host, lr_scheduler, step["skipped"])
        self._issue_step(fns, True, window=step["window"])
        self.sync.wait_settled()   # a restored whole update clears p.grad before the gradients return
