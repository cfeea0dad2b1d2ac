"""The data journey: everything between a corpus on disk and the batches the Trainer takes.

`corpus` reads and checks parallel text (local files, `datasets` folders and Hub datasets, offline); `tokenizer`
trains and loads the shared subword tokenizer; `prepared` tokenizes a corpus once into a checked folder that every
later run and rank reuses; `streaming` reads a corpus too large to prepare, pair by pair; `batching` groups pairs by
a target-token budget. `preparation` turns a checked recipe into a run's data (tokenizer, training data, validation
split) from either source, and `training_data` is what the Trainer sees of any of them: the loader of its batches."""

from hf_deep_nmt._moved import moved_names


def __getattr__(name: str):  # the names of the module `hf_deep_nmt.data` was until 0.2.0
    return moved_names(__name__, name)
