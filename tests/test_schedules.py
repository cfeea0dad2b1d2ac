"""The fairseq inverse-sqrt schedule and SDT's restart between stages, against hand-computed rates."""

import math

import pytest
import torch

from hf_deep_nmt.training.schedules import inverse_sqrt_lr, inverse_sqrt_scheduler, stage_start_step

PEAK, WARMUP, INIT = 2e-3, 8, 1e-7


def run_stage(steps: int, start_step: int) -> list[float]:
    """Learning rates used by `steps` consecutive updates of a stage with a fresh optimizer."""
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = inverse_sqrt_scheduler(optimizer, WARMUP, INIT, start_step=start_step)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


def test_warm_up_is_linear_from_init_to_peak_then_decays_as_inverse_sqrt():
    assert inverse_sqrt_lr(0, PEAK, WARMUP, INIT) == pytest.approx(1e-7)
    assert inverse_sqrt_lr(4, PEAK, WARMUP, INIT) == pytest.approx(1e-7 + 4 * (2e-3 - 1e-7) / 8)
    assert inverse_sqrt_lr(8, PEAK, WARMUP, INIT) == pytest.approx(2e-3)
    assert inverse_sqrt_lr(32, PEAK, WARMUP, INIT) == pytest.approx(2e-3 * math.sqrt(8 / 32))  # = 1e-3


def test_two_stages_restart_at_the_peak_after_warm_up():
    first = run_stage(20, start_step=0)
    assert first[0] == pytest.approx(1e-7) and first[8] == pytest.approx(2e-3)
    assert first[18] == pytest.approx(2e-3 * math.sqrt(8 / 18))
    start = stage_start_step(20, WARMUP)
    assert start == 8
    second = run_stage(10, start_step=start)
    assert second[0] == pytest.approx(2e-3)  # back to the peak, no new warm-up
    assert second[8] == pytest.approx(2e-3 * math.sqrt(8 / 16))  # decays by the stage's own step count


def test_a_stage_that_ends_inside_the_warm_up_continues_it():
    first = run_stage(5, start_step=0)
    second = run_stage(3, start_step=stage_start_step(5, WARMUP))
    assert second[0] == pytest.approx(1e-7 + 5 * (2e-3 - 1e-7) / 8)  # step 5 of the warm-up, where stage 1 stopped
    assert second[2] == pytest.approx(1e-7 + 7 * (2e-3 - 1e-7) / 8)
    assert first[-1] < second[0]


@pytest.mark.parametrize(("step", "warmup", "message"), [(-1, 8, r"`step` must be >= 0, got -1"), (3, 0, r"got 0")])
def test_bad_arguments_are_named(step, warmup, message):
    with pytest.raises(ValueError, match=message):
        inverse_sqrt_lr(step, PEAK, warmup)
