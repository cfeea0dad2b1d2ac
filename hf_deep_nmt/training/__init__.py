"""The training journey: from a recipe to a trained, evaluated, exported model folder.

`arguments` and `recipes` read a recipe, `plan` checks the whole run before anything is built, `pipeline` runs it
(`run`: train, evaluate, export), `trainer` and `callbacks` are the Seq2SeqTrainer and its hooks, `staged` and
`growing` train shallow-to-deep, `schedules` the learning rates, `checkpoints`, `preemption` and `run_folder` (the
folder's `lock` and its `run_record`) keep a run safe to stop and resume, `averaging` averages checkpoints,
`evaluation` and `curves` score and plot."""

from hf_deep_nmt._moved import moved_names


def __getattr__(name: str):  # the names of the module `hf_deep_nmt.training` was until 0.2.0
    return moved_names(__name__, name)
