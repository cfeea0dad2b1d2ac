"""Learning-rate schedules of the papers that `transformers` does not offer in their exact form.

* `inverse_sqrt_lr`: the fairseq inverse square root with linear warm-up from `init_lr` to `peak_lr` (DLCL, SDT).
* `noam_lr`: the Vaswani et al. ("Noam") schedule, `scale * d^-0.5 * min(n^-0.5, n * W^-1.5)` with `n = step + 1`
  (DS-Init + MAtt, MSC).
* `stage_start_step`: SDT's restart rule between growing stages, as its reference code applies it (the schedule's
  step becomes min(steps so far, warm-up)): a new stage continues the warm-up when the previous one ended inside it,
  and otherwise jumps back to the peak and decays again. Each stage starts with a fresh optimizer.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def inverse_sqrt_lr(step: int, peak_lr: float, warmup_steps: int, init_lr: float = 1e-7) -> float:
    """`init + step * (peak - init) / W` during warm-up, then `peak * sqrt(W / step)`."""
    if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}.")
    if warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be >= 1, got {warmup_steps}.")
    if step < warmup_steps:
        return init_lr + step * (peak_lr - init_lr) / warmup_steps
    return peak_lr * math.sqrt(warmup_steps / step)


def stage_start_step(previous_stage_end_step: int, warmup_steps: int) -> int:
    """Scheduler step at which a new SDT stage starts: `min(previous end, W)` — the warm-up continues if it was not
    finished, otherwise the rate restarts at the peak (the reference code resets its step counter to W)."""
    return min(previous_stage_end_step, warmup_steps)


def inverse_sqrt_scheduler(
    optimizer: Optimizer, warmup_steps: int, init_lr: float = 1e-7, start_step: int = 0
) -> LambdaLR:
    """`LambdaLR` over `optimizer` (whose learning rate is the peak) following `inverse_sqrt_lr` from `start_step`."""
    peaks = [group["lr"] for group in optimizer.param_groups]
    if any(peak <= 0 for peak in peaks):
        raise ValueError(f"The optimizer's learning rate is the peak and must be > 0, got {peaks}.")

    def factor(peak: float):
        return lambda step: inverse_sqrt_lr(start_step + step, peak, warmup_steps, init_lr) / peak

    return LambdaLR(optimizer, [factor(peak) for peak in peaks])


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """`scale * d_model^-0.5 * min(n^-0.5, n * warmup^-1.5)` with `n = step + 1` (the update being made, counted
    from 1, as in the DS-Init reference code); the peak, at `n = warmup_steps`, is `scale / sqrt(d_model * warmup)`."""
    if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}.")
    if warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be >= 1, got {warmup_steps}.")
    if d_model < 1:
        raise ValueError(f"`d_model` must be >= 1, got {d_model}.")
    n = step + 1
    return scale * d_model**-0.5 * min(n**-0.5, n * warmup_steps**-1.5)


def noam_scheduler(optimizer: Optimizer, d_model: int, warmup_steps: int) -> LambdaLR:
    """`LambdaLR` over `optimizer` whose learning rate is the Noam scale (`lrate`, 1.0 in the papers)."""
    scales = [group["lr"] for group in optimizer.param_groups]
    if any(scale <= 0 for scale in scales):
        raise ValueError(f"The optimizer's learning rate is the Noam scale and must be > 0, got {scales}.")
    noam_lr(0, d_model, warmup_steps)  # argument checks
    return LambdaLR(optimizer, lambda step: noam_lr(step, d_model, warmup_steps))
