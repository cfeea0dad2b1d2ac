"""Preparing a run's data from its checked recipe: the tokenizer, the training data the Trainer reads, and the
validation split the final evaluation scores.

`prepare` builds one of two training-data sources and does the rest the same way for both: the prepared-data folder
(`hf_deep_nmt.data.prepared`: the corpus tokenized once, memory-mapped by every later run and rank) or, with
`streaming: true`, a stream read while training (`hf_deep_nmt.data.streaming`). The validation split is read whole
either way; its sources are held to the longest input `translate` accepts (the final evaluation translates each in
full) before anything trains, and it is tokenized without dropping a pair, so BLEU covers the whole set.

What is read is what the run's plan (`hf_deep_nmt.training.plan.RunPlan`) checked: the files each corpus path
resolves to and the saved model's config are used as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import datasets
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, set_seed
from transformers.utils import logging

from hf_deep_nmt.data.corpus import SOURCE, TARGET, tokenize_parallel
from hf_deep_nmt.data.prepared import ID_COLUMNS, PreparedData, prepare_data, tokenizer_digest, tokenizer_train_pairs
from hf_deep_nmt.data.streaming import StreamedCorpus, StreamedPairs, read_validation, stream_source
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.folders import write_marked_folder
from hf_deep_nmt.model_folders import check_local_path, check_saved_json_files
from hf_deep_nmt.serving.options import MAX_SOURCE_TOKENS

logger = logging.get_logger(__name__)


class CheckedRecipe(Protocol):
    """What preparing reads of a run's plan (`hf_deep_nmt.training.plan.RunPlan` is one): the parsed arguments, the
    files each corpus path resolves to (checked there and readable), and the config of the saved model the run starts
    from (None for a fresh preset)."""

    model_args: Any
    data_args: Any
    training_args: Any
    corpus: Mapping[str, tuple[Path, ...]]
    saved_config: Any


def _claim_nothing(path: Path) -> None:
    pass


@dataclass
class Prepared:
    """Everything a training run needs besides the model: the validation text (`raw["validation"]`), tokenizer,
    training data (`train_dataset`: a tokenized Dataset memory-mapped from the prepared-data folder `data`, or a
    `StreamedPairs`), the tokenized validation split and its references."""

    raw: Any
    tokenizer: PreTrainedTokenizerBase
    train_dataset: Any
    eval_dataset: Any
    references: list[str]
    data: PreparedData | None = None

    @property
    def train_pairs(self) -> int:
        """Training pairs read (before the length filter)."""
        return self.data.record["counts"]["train"]["pairs_read"] if self.data else len(self.raw["train"])


def prepare(
    recipe: CheckedRecipe, tokenizer_dir: Path | None = None, claim: Callable[[Path], None] = _claim_nothing
) -> Prepared:
    """The recipe's tokenizer, training data and validation split. Under `torchrun` / `accelerate launch` the main
    process prepares while the others wait. `tokenizer_dir`: where a tokenizer trained here is saved and an earlier
    run's is found (streaming: default `output_dir/tokenizer`); `claim(path)` lists a path in the run record before it
    is written there."""
    set_seed(recipe.training_args.seed)
    build = _streamed if recipe.data_args.streaming else _prepared_folder
    prepared, validation = build(recipe, tokenizer_dir, claim)
    if validation is not None:  # the final evaluation translates each source in full: checked before step 1
        check_validation_lengths(validation[SOURCE], prepared.tokenizer, recipe.data_args)
        prepared.raw["validation"] = validation.select_columns([SOURCE, TARGET])
        prepared.references = prepared.raw["validation"][TARGET]
    return prepared


def check_validation_lengths(sources: Sequence[str], tokenizer: PreTrainedTokenizerBase, data_args) -> None:
    """`check_source_lengths` of the validation split against `translate`'s limit, naming the file or the split."""
    if data_args.dataset_name:
        split = data_args.dataset_validation_split
        where = f"{data_args.dataset_name!r} split {split!r}, counting rows as lines from 1,"
    else:
        where = f"`validation_file` {data_args.corpus_paths()[1]!r}"
    check_source_lengths(sources, tokenizer, MAX_SOURCE_TOKENS, where)


def check_source_lengths(
    sources: Sequence[str], tokenizer: PreTrainedTokenizerBase, limit: int, name: str, first_line: int = 1
) -> None:
    """`ValueError` naming `name` (the file or split), the first source over `limit` tokens, its length and the way
    out; the final evaluation translates every source in full, as `translate` does with its own limit, so a source
    beyond it is refused before training rather than after. `first_line`: the line number of `sources[0]`."""
    encoded = tokenizer(list(sources), verbose=False)["input_ids"] if sources else []
    overlong = [index for index, ids in enumerate(encoded) if len(ids) > limit]
    if overlong:
        first = overlong[0]
        raise ValueError(
            f"{name}: {len(overlong)} source sentence(s) are longer than {limit} tokens, the longest `translate` "
            f"accepts (line {first + first_line} has {len(encoded[first])}); the final evaluation would translate "
            "them in full, in time that grows with the square of the length. Split them into sentences or remove "
            "them from the file."
        )


# ---- the two sources ------------------------------------------------------------------------------------------------


def _prepared_folder(recipe: CheckedRecipe, tokenizer_dir: Path | None, claim) -> tuple[Prepared, Any]:
    """The prepared-data folder of the recipe (`prepare_data`: built once, then reused by every run and rank), and its
    validation split (text and ids)."""
    model_args, data_args, training_args = recipe.model_args, recipe.data_args, recipe.training_args
    given = given_tokenizer(model_args, tokenizer_dir, recipe.saved_config)
    with training_args.main_process_first(desc="preparing the data"):
        data = None
        if given is not None and not model_args.saved_tokenizer():  # the tokenizer an earlier run of ours saved
            data = prepare_data(model_args, data_args, training_args.seed, build=False, corpus=recipe.corpus)
            if data is not None and tokenizer_digest(data.tokenizer) != tokenizer_digest(given):
                data = None  # not the tokenizer these settings train now: the data is prepared with it
        data = data or prepare_data(model_args, data_args, training_args.seed, given, corpus=recipe.corpus)
    tokenizer = given or data.tokenizer
    if given is None and tokenizer_dir is not None and training_args.process_index == 0:
        claim(tokenizer_dir)
        write_marked_folder(tokenizer_dir, tokenizer.save_pretrained)  # whole or absent, never half-written
    validation = data.validation
    eval_dataset = validation.select_columns(list(ID_COLUMNS)) if validation is not None else None
    return Prepared(datasets.DatasetDict(), tokenizer, data.train, eval_dataset, [], data), validation


def _streamed(recipe: CheckedRecipe, tokenizer_dir: Path | None, claim) -> tuple[Prepared, Any]:
    """A stream of the recipe's training corpus (`StreamedPairs`, read while training) with its tokenizer (the
    recipe's, the one an earlier run saved in `tokenizer_dir`, or one trained on the first `tokenizer_train_pairs`
    pairs of the stream and saved there), and the validation split, read whole."""
    model_args, data_args, training_args = recipe.model_args, recipe.data_args, recipe.training_args
    source = stream_source(data_args, recipe.corpus)
    source.check_head()
    validation = read_validation(data_args, recipe.corpus)
    if validation is not None and data_args.max_eval_samples:
        validation = validation.select(range(min(data_args.max_eval_samples, len(validation))))
    tokenizer_dir = Path(tokenizer_dir or Path(training_args.output_dir) / "tokenizer")
    # one process trains and saves the tokenizer; the others then load it from `tokenizer_dir`
    with training_args.main_process_first(local=False, desc="streaming tokenizer"):
        sample: dict[str, Any] = {}
        if not model_args.saved_tokenizer() and not (tokenizer_dir / "tokenizer.json").is_file():
            head = source.first_pairs(tokenizer_train_pairs(model_args))
            if not head[SOURCE]:
                raise ValueError(f"The streamed corpus {source.name!r} holds no sentence pairs; give one with pairs.")
            sample = {"train": {SOURCE: head[SOURCE], TARGET: head[TARGET]}}
            logger.warning(f"Training the tokenizer on the first {len(head[SOURCE])} pairs of the stream.")
        tokenizer = load_tokenizer(model_args, sample, tokenizer_dir, recipe.saved_config, claim)
    eval_dataset = None
    if validation is not None:  # evaluation keeps every pair (truncating, never dropping)
        limits = (data_args.max_source_length, data_args.max_target_length)
        eval_dataset = tokenize_parallel(validation, tokenizer, *limits, drop_long=False)
    stream = StreamedPairs(
        source,
        tokenizer,
        data_args.stream_buffer_pairs,
        data_args.max_source_length,
        data_args.max_target_length,
        max_tokens=training_args.max_tokens,
        max_sentences=training_args.per_device_train_batch_size,
        seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
    )
    return Prepared({"train": StreamedCorpus(stream)}, tokenizer, stream, eval_dataset, []), validation


# ---- `hf-deep-nmt prepare` ------------------------------------------------------------------------------------------


def prepare_ahead(recipe: CheckedRecipe) -> dict[str, Any]:
    """Build (or find) the recipe's prepared-data folder ahead of training (`hf-deep-nmt prepare`); returns
    `PreparedData.summary()`."""
    model_args, training_args = recipe.model_args, recipe.training_args
    given = given_tokenizer(model_args, saved_config=recipe.saved_config)
    with training_args.main_process_first(desc="preparing the data"):
        data = prepare_data(model_args, recipe.data_args, training_args.seed, given, corpus=recipe.corpus)
    return data.summary()


# ---- the tokenizer --------------------------------------------------------------------------------------------------


def given_tokenizer(
    model_args, tokenizer_dir: Path | None = None, saved_config=None
) -> PreTrainedTokenizerBase | None:
    """The saved model's or the given tokenizer; else the one saved in `tokenizer_dir` by an earlier run; else None
    (a joint tokenizer is trained with the data). `saved_config`: the config of the saved model the run starts from,
    whose folder the plan checked (`check_saved_model`); a tokenizer given on its own is checked here."""
    saved_tokenizer = model_args.saved_tokenizer()
    if saved_tokenizer:
        if saved_config is None or model_args.tokenizer_name_or_path:  # the saved model's folder: checked there
            check_local_path(saved_tokenizer, "Tokenizer folder")
        if saved_config is None:  # `check_saved_model` read the JSON files of both
            check_saved_json_files(saved_tokenizer, "Tokenizer folder")
        tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
        check_tokenizer_vocabulary(model_args, tokenizer, saved_config)
        return tokenizer
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        check_saved_json_files(tokenizer_dir, "The tokenizer an earlier run trained,")
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer_dir is not None and os.path.lexists(tokenizer_dir):
        if not tokenizer_dir.is_dir() or any(tokenizer_dir.iterdir()):
            raise FileExistsError(
                f"{str(tokenizer_dir)!r}, where this run saves the tokenizer it trains, already holds files but no "
                "tokenizer.json; move them away, or name a tokenizer with `tokenizer_name_or_path`."
            )
    return None


def load_tokenizer(
    model_args, raw, tokenizer_dir: Path | None = None, saved_config=None, claim: Callable = _claim_nothing
) -> PreTrainedTokenizerBase:
    """`given_tokenizer`, else a joint tokenizer trained on the training split of `raw` (and saved in
    `tokenizer_dir`, listed first by `claim`)."""
    tokenizer = given_tokenizer(model_args, tokenizer_dir, saved_config)
    if tokenizer is not None:
        return tokenizer
    tokenizer = train_joint_tokenizer(
        zip(raw["train"][SOURCE], raw["train"][TARGET]),
        vocab_size=model_args.tokenizer_vocab_size,
        model=model_args.tokenizer_model,
    )
    if tokenizer_dir is not None:
        claim(tokenizer_dir)
        write_marked_folder(tokenizer_dir, tokenizer.save_pretrained)  # whole or absent, never half-written
    return tokenizer


def check_tokenizer_vocabulary(model_args, tokenizer: PreTrainedTokenizerBase, config=None) -> None:
    """A saved model with a separately given tokenizer must have exactly its vocabulary: a smaller tokenizer (another
    run's) never produces the model's other ids, and its ids mean other pieces. `config`: the saved model's, when
    already read."""
    if not (model_args.model_name_or_path and model_args.tokenizer_name_or_path):
        return
    config = config if config is not None else AutoConfig.from_pretrained(model_args.model_name_or_path)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) != vocab:
        raise ValueError(
            f"The tokenizer {model_args.tokenizer_name_or_path!r} has {len(tokenizer)} tokens but the model "
            f"{model_args.model_name_or_path!r} has a vocabulary of {vocab}: it is another model's tokenizer. Leave "
            "`tokenizer_name_or_path` unset to use the one saved with the model."
        )
