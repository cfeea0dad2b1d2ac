"""Child process of the kill tests: `python fault_worker.py train|train-staged ARGS...` runs the real command line
(`hf_deep_nmt.cli.main`), with two test-only slow-downs set by environment variables so that a SIGKILL from the test
lands where it is meant to:

- FAULT_STEP_DELAY: seconds to sleep after every optimizer step (so a kill after checkpoint N lands before N + 1);
- FAULT_HANG_AT_STEP / FAULT_MARKER: while writing the checkpoint of that step, after its weights, optimizer and
  scheduler files but before its RNG and trainer state, create the marker file and hang (the test kills it there);
- FAULT_STEP_FILE: after every optimizer step, write the step number into this file (so that a signal can be sent
  once training is under way);
- FAULT_HANG_IN_EVALUATION: at the start of the final evaluation, create this marker file and hang (the test signals
  it there).
"""

import os
import sys
import time
from pathlib import Path

import torch
import transformers.trainer
from transformers import Trainer, TrainerCallback

from hf_deep_nmt import cli
from hf_deep_nmt.training import pipeline as training

STEP_DELAY = float(os.environ.get("FAULT_STEP_DELAY", "0"))
HANG_AT_STEP = int(os.environ.get("FAULT_HANG_AT_STEP", "0"))
MARKER = os.environ.get("FAULT_MARKER")
STEP_FILE = os.environ.get("FAULT_STEP_FILE")
HANG_IN_EVALUATION = os.environ.get("FAULT_HANG_IN_EVALUATION")


class SlowSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if STEP_FILE:
            Path(STEP_FILE).write_text(str(state.global_step))
        time.sleep(STEP_DELAY)


_save_optimizer_and_scheduler = Trainer._save_optimizer_and_scheduler


def save_optimizer_and_scheduler_then_hang(self, output_dir):
    _save_optimizer_and_scheduler(self, output_dir)
    if self.state.global_step == HANG_AT_STEP:
        Path(MARKER).write_text(output_dir)
        time.sleep(600)


def hang_in_evaluation(*args, **kwargs):
    Path(HANG_IN_EVALUATION).write_text("evaluating")
    time.sleep(600)


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers.trainer.DEFAULT_CALLBACKS.append(SlowSteps)
    if HANG_AT_STEP:
        Trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler_then_hang
    if HANG_IN_EVALUATION:
        training.score_validation = hang_in_evaluation
    sys.exit(cli.main(sys.argv[1:]))
