"""Train a deep translation model from a recipe config: train -> sacreBLEU on validation -> sample translations ->
Hub-ready folder.

    python recipes/train.py recipes/configs/sample.json
    accelerate launch recipes/train.py recipes/configs/sample.json
    hf-deep-nmt train recipes/configs/sample.json --num-train-epochs 1   # flags override the file

Every step is a library call (hf_deep_nmt.training.pipeline.run, through the command line's error reporting: an
expected failure is one line per process naming the way out, not a traceback); the config file holds the model preset,
its overrides, the data, `Seq2SeqTrainingArguments` and the export settings.
"""

import sys

from hf_deep_nmt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
