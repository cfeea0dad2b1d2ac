"""Train a deep translation model from a recipe config: train -> sacreBLEU on validation -> sample translations ->
Hub-ready folder.

    python recipes/train.py recipes/configs/sample.json
    accelerate launch recipes/train.py recipes/configs/sample.json
    hf-deep-nmt train recipes/configs/sample.json --num_train_epochs 1   # flags override the file

Every step is a library call (hf_deep_nmt.training.run); the config file holds the model preset, its overrides, the
data, `Seq2SeqTrainingArguments` and the export settings.
"""

import json
import sys

from hf_deep_nmt.training import run

if __name__ == "__main__":
    summary = run(sys.argv[1:])
    print(json.dumps({key: value for key, value in summary.items() if key != "examples"}, indent=2))
