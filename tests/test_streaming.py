"""`streaming: true`: a corpus read while training, in token-budget batches from a seeded length-bucketing buffer.

Pinned down here: the batches of a buffer by hand (budget, padding-aware, seeded order); every pair once per pass,
on one rank and split over two; the reader never ahead of the buffer (lines counted); the per-line checks and their
messages are those of the in-memory reader; the features are `tokenize_parallel`'s; a stream restarted from any
batch's position continues with exactly the batches that followed it (local files and a `datasets` stream); the real
`hf-deep-nmt train` trains from a stream, and a run stopped by SIGTERM continues, in the same command, with the
batches the uninterrupted run trained after that step, to the same weights; bad settings and checkpoints whose
position cannot hold are refused by name."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast

from hf_deep_nmt.data import preparation, streaming
from hf_deep_nmt.data.corpus import read_parallel_file, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.data.streaming import (
    STREAM_STATE_FILE,
    FileSource,
    HubSource,
    StreamedPairs,
    StreamLoader,
    recorded_position,
)
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.training import pipeline as training
from hf_deep_nmt.training.arguments import parse_arguments
from hf_deep_nmt.training.preemption import TrainingPreempted
from hf_deep_nmt.training.staged import run_staged
from hf_deep_nmt.training.trainer import DeepNMTTrainer

WORDS = [f"w{index}" for index in range(40)]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One id per space-separated word, then `</s>`: a pair's length is its longer side's word count + 1."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{word: 4 + index for index, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def words(count: int, first: int = 0) -> str:
    return " ".join(WORDS[(first + index) % len(WORDS)] for index in range(count))


def write_tsv(path: Path, sizes: list[tuple[int, int]]) -> Path:
    """Pair `j` has `sizes[j]` words per side, starting at word `j` (so every pair's ids differ)."""
    path.write_text("".join(f"{words(s, j)}\t{words(t, j + 1)}\n" for j, (s, t) in enumerate(sizes)), encoding="utf-8")
    return path


def pair_numbers(path: Path) -> dict[int, int]:
    """Pair `j` of a file without blank lines, by the byte offset of its line (the number a stream gives a pair of a
    single-file corpus: no reader of a byte range knows how many lines come before it)."""
    offsets, offset = {}, 0
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True)):
        offsets[offset] = number
        offset += len(line)
    return offsets


def stream(source, **settings) -> StreamedPairs:
    defaults = dict(buffer_pairs=4, max_source_length=16, max_target_length=16, max_tokens=12, seed=3)
    return StreamedPairs(source, word_tokenizer(), **{**defaults, **settings})


def take(batches, count: int) -> list:
    return [next(batches) for _ in range(count)]


SIZES = [(3, 2), (1, 1), (5, 4), (2, 3), (6, 6), (1, 2), (4, 4), (2, 2), (3, 3), (7, 1), (2, 5)]


def test_a_buffer_is_cut_by_the_padded_budget_and_handed_out_in_a_seeded_order(tmp_path):
    # lengths (longer side + </s>) of pairs 0-3: 4, 2, 6, 4; budget 12 = sentences x longest.
    # Sorted: 1 (2), then 0 and 3 (4, order by the seeded tie-break), then 2 (6):
    # [1, 0|3] costs 2 x 4 = 8, adding the other 4 would cost 12 <= 12 -> [1, 0, 3]; then 2 alone (4 x 6 > 12).
    source = FileSource(write_tsv(tmp_path / "c.tsv", SIZES[:4]), "es", "en")
    first = take(stream(source).batches(), 2)
    number = pair_numbers(tmp_path / "c.tsv")
    assert sorted(sorted(number[j] for j in batch.pairs) for batch in first) == [[0, 1, 3], [2]]
    size = (tmp_path / "c.tsv").stat().st_size
    assert first[0].position["pass"] == 0 and first[1].position == {
        "pass": 0,
        "buffer": 1,
        "reader": {"offsets": [size], "pair": 4, "range": [0, size]},
        "done": 0,
        "batches": 2,
        "corpus_pairs": None,
    }
    # the collator pads each batch: both tensors stay within the budget
    collator = DataCollatorForSeq2Seq(word_tokenizer(), label_pad_token_id=-100)
    for batch in first:
        padded = collator(batch.features)
        assert padded["input_ids"].numel() <= 12 and padded["labels"].numel() <= 12
    # the same seed gives the same batches in the same order; over a longer corpus another seed another order
    source = FileSource(write_tsv(tmp_path / "long.tsv", SIZES * 4), "es", "en")
    runs = [
        [batch.pairs for batch in take(stream(source, buffer_pairs=20, seed=seed).batches(), 10)] for seed in (3, 3, 4)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_without_max_tokens_a_batch_holds_a_sentence_count(tmp_path):
    source = FileSource(write_tsv(tmp_path / "c.tsv", SIZES), "es", "en")
    batches = take(stream(source, buffer_pairs=5, max_tokens=None, max_sentences=2).batches(), 6)
    assert [len(batch.pairs) for batch in batches[:3]] in ([2, 2, 1], [2, 1, 2], [1, 2, 2])
    assert all(len(batch.pairs) <= 2 for batch in batches)


def pass_pairs(batches, passes: int) -> list[list[int]]:
    """The pair numbers each pass delivered, from a stream of batches (the first `passes` passes)."""
    seen = [[] for _ in range(passes + 1)]
    for batch in batches:
        if batch.position["pass"] >= passes:
            break
        seen[batch.position["pass"]] += batch.pairs
    return seen[:passes]


def test_every_pair_is_delivered_once_per_pass_on_one_rank_and_split_over_two(tmp_path, caplog):
    sizes = SIZES * 3 + [(20, 1)]  # the last pair is over the length limit of 16: dropped, counted
    source = FileSource(write_tsv(tmp_path / "c.tsv", sizes), "es", "en")
    kept = sorted(pair_numbers(tmp_path / "c.tsv"))[:-1]  # byte offsets of the pairs' lines
    for passes in (
        pass_pairs(stream(source, buffer_pairs=5).batches(), 2),
        pass_pairs(stream(source, buffer_pairs=len(sizes) * 2).batches(), 2),
    ):
        assert [sorted(pairs) for pairs in passes] == [kept, kept]
    assert "dropped 1 of 34 pairs longer than 16 source / 16 target tokens" in caplog.text
    shares = [pass_pairs(stream(source, rank=rank, world_size=2).batches(), 2) for rank in (0, 1)]
    # rank 0 reads the lines that start in the first half of the file's bytes, rank 1 the rest
    first = len(shares[0][0])
    assert 0 < first < len(kept)
    for rank, share in enumerate(shares):
        assert [sorted(pairs) for pairs in share] == [kept[:first] if rank == 0 else kept[first:]] * 2
    # the passes differ in order (the seed includes the pass)
    one = pass_pairs(stream(source, buffer_pairs=5).batches(), 2)
    assert one[0] != one[1]


def test_a_stream_restarted_at_any_batch_continues_with_the_batches_that_followed(tmp_path):
    source = FileSource(write_tsv(tmp_path / "c.tsv", SIZES * 2), "es", "en")
    uninterrupted = take(stream(source, buffer_pairs=5).batches(), 24)  # over two passes
    assert uninterrupted[-1].position["pass"] == 1
    for index, batch in enumerate(uninterrupted[:-1]):
        restarted = take(stream(source, buffer_pairs=5).batches(batch.position), len(uninterrupted) - index - 1)
        assert [b.features for b in restarted] == [b.features for b in uninterrupted[index + 1 :]], index
        assert [b.pairs for b in restarted] == [b.pairs for b in uninterrupted[index + 1 :]]
        assert restarted[-1].position == uninterrupted[-1].position


class CountingFile:
    """A binary corpus file that counts the lines read through it."""

    lines = 0

    def __init__(self, handle):
        self.handle = handle

    def readline(self):
        line = self.handle.readline()
        CountingFile.lines += bool(line)
        return line

    def seek(self, offset):
        return self.handle.seek(offset)

    def read(self, size=-1):
        return self.handle.read(size)

    def close(self):
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.close()


def test_the_reader_never_reads_past_the_buffer_in_progress(tmp_path, monkeypatch):
    path = write_tsv(tmp_path / "c.tsv", SIZES * 5)  # 55 lines
    monkeypatch.setattr(streaming, "_open_corpus", lambda file: CountingFile(Path(file).open("rb")))
    CountingFile.lines = 0
    delivered = 0
    batches = stream(FileSource(path, "es", "en"), buffer_pairs=7).batches()
    for number in range(20):
        batch = next(batches)
        if number == 0:
            assert CountingFile.lines == 7  # one buffer read, nothing more
        delivered += len(batch.pairs)
        assert delivered <= CountingFile.lines <= delivered + 7 - 1
    assert CountingFile.lines < 55  # 20 batches in, the file is not read through


def malformed_corpora(folder: Path) -> dict[str, bytes | tuple[bytes, bytes]]:
    return {
        "no-tab.tsv": b"uno\tone\ndos two\n",
        "two-tabs.tsv": b"uno\tone\ndos\ttwo\tthree\n",
        "empty-target.tsv": b"uno\tone\ndos\t \n",
        "gap.tsv": b"uno\tone\n\ndos\ttwo\n",
        "nul.tsv": b"uno\tone\ndo\0s\ttwo\n",
        "latin1.tsv": b"uno\tone\nca\xf1a\tcane\n",
        "utf16.tsv": "uno\tone\n".encode("utf-16"),
        "bad-json.jsonl": b'{"es": "uno", "en": "one"}\n{"es": "dos", "en": \n',
        "no-key.jsonl": b'{"es": "uno", "en": "one"}\n{"es": "dos"}\n',
        "list.jsonl": b'["uno", "one"]\n',
        "short": (b"uno\ndos\ntres\n", b"one\ntwo\n"),
        "blank": (b"uno\n\ntres\n", b"one\ntwo\nthree\n"),
    }


def test_every_line_is_checked_as_the_in_memory_reader_checks_it_with_the_same_message(tmp_path):
    for name, content in malformed_corpora(tmp_path).items():
        if isinstance(content, tuple):
            (tmp_path / f"{name}.es").write_bytes(content[0])
            (tmp_path / f"{name}.en").write_bytes(content[1])
        else:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError) as expected:
            read_parallel_file(tmp_path / name, "es", "en")
        source = FileSource(tmp_path / name, "es", "en")
        with pytest.raises(ValueError) as streamed:
            list(source.reader())
        assert str(streamed.value) == str(expected.value), name
    # what the in-memory reader accepts, the stream reads the same: a byte-order mark, CRLF, trailing blank lines
    (tmp_path / "fine.tsv").write_bytes(b"\xef\xbb\xbfuno\tone\r\ndos\ttwo\r\n\n\n")
    expected = read_parallel_file(tmp_path / "fine.tsv", "es", "en")
    assert list(FileSource(tmp_path / "fine.tsv", "es", "en").reader()) == list(zip(*expected.values()))


def test_the_features_are_those_of_tokenize_parallel(tmp_path):
    import datasets

    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:60]
    (tmp_path / "c.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pairs = read_parallel_file(tmp_path / "c.tsv")
    tokenizer = train_joint_tokenizer(zip(*pairs.values()), vocab_size=300)
    expected = tokenize_parallel(datasets.Dataset.from_dict(pairs), tokenizer, 40, 40)
    source = FileSource(tmp_path / "c.tsv", "es", "en")
    batches = StreamedPairs(source, tokenizer, 25, 40, 40, max_tokens=200).batches()
    by_pair = {}
    for batch in batches:
        if batch.position["pass"] == 1:
            break
        by_pair.update(zip(batch.pairs, batch.features))
    assert 0 < len(by_pair) == len(expected) < 60  # some pairs are over 40 tokens and dropped
    assert [by_pair[j] for j in sorted(by_pair)] == expected.to_list()


def test_the_piece_by_piece_encoding_gives_the_backends_ids():
    pairs = read_parallel_file(sample_corpus_dir() / "train.tsv")
    texts = [text for side in pairs.values() for text in side[:1000]]
    tokenizer = train_joint_tokenizer(zip(*(side[:200] for side in pairs.values())), vocab_size=300)
    assert streaming._piece_encoder(tokenizer) is not None  # the tokenizer the project trains takes the fast path
    # what the fast path must leave to the backend or split exactly as it does: spaces at either end and in runs,
    # contractions, digits, punctuation runs, Latin letters beyond ASCII, compatibility characters NFKC changes, a
    # combining accent, special tokens' text, control characters, other scripts
    texts += [" lead", "trail ", "two  spaces", "   ", "a", "it's they're we've I'm you'll he'd 'S", "x1 22 3.5 1,000"]
    texts += ["¿Qué? ¡Sí! ...!!", "ñandú Ærø ǅ ȹ ɏ", "½ ª ² ﬁ", "e\u0301 combining", "<s> and </s> <unk>", "tab\there"]
    texts += ["mixed 日本 text", "a\u00a0nbsp", "x\x1fy", "…", "’s curly", ""]
    expected = [encoding.ids for encoding in tokenizer._tokenizer.encode_batch(texts, add_special_tokens=True)]
    assert streaming.encode_texts(tokenizer, texts, target=False) == expected
    assert streaming.encode_texts(tokenizer, texts, target=True) == tokenizer(text_target=texts)["input_ids"]
    assert streaming._piece_encoder(word_tokenizer()) is None  # another pre-tokenizer and model: the backend's ids


def test_the_plain_split_is_the_byte_level_split_on_every_plain_character():
    plain = [chr(code) for code in (*range(0x20, 0x7F), *range(0xA1, 0x250)) if chr(code) != "<"]
    texts = [text for c in plain for text in (f" {c}", f"a{c}b {c}{c}  1{c}'s", f"{c}'re {c} {c}9 ")]
    texts += [line for line in (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:300]]
    texts = [text for text in texts if streaming._PLAIN_TEXT.fullmatch(text)]
    assert len(texts) > 1500
    assert [streaming._PLAIN_SPLIT.findall(text) for text in texts] == [
        streaming._BYTE_LEVEL_SPLIT.findall(text) for text in texts
    ]


def test_a_full_piece_memo_still_gives_the_backends_ids(monkeypatch):
    """Pieces past `PIECE_MEMO_SIZE`, and texts the backend encodes, hold slots for one call only."""
    pairs = read_parallel_file(sample_corpus_dir() / "train.tsv")
    tokenizer = train_joint_tokenizer(zip(*(side[:200] for side in pairs.values())), vocab_size=300)
    texts = [text for side in pairs.values() for text in side[:100]] + ["日本 a", "<s> b", "", "½ x"]
    expected = [encoding.ids for encoding in tokenizer._tokenizer.encode_batch(texts, add_special_tokens=True)]
    monkeypatch.setattr(streaming, "PIECE_MEMO_SIZE", 50)
    encoder = streaming._piece_encoder(tokenizer)
    for half in (texts[::2], texts[1::2], texts):  # a cold memo, one that fills up, a full one
        assert encoder.encode(half) == [expected[texts.index(text)] for text in half]
    assert len(encoder.memo) == 51 and encoder.slots == 51  # 50 pieces and the suffix
    ids, lengths = streaming.encode_arrays(tokenizer, texts, target=False)
    assert ids.dtype == np.int32 and lengths.tolist() == [len(row) for row in expected]
    assert ids.tolist() == [token for row in expected for token in row]


def random_texts(seed: int, count: int, single_spaced: bool) -> list[str]:
    """Texts of pieces the word-by-word encoding must split as the backend does: contractions, digits, punctuation
    runs, Latin letters beyond ASCII, quotes at a word's start, spaces in runs and at either end (unless
    `single_spaced`)."""
    atoms = ["a", "bc", "É", "ñ", "'", "'s", "'re", "1", "22", ".", ",", "!?", " ", "  ", "ɏ", "-", "x'", "ll", "¿"]
    generator = np.random.default_rng(seed)
    texts = ["".join(generator.choice(atoms, size=generator.integers(1, 14))) for _ in range(count)]
    return [" ".join(text.split()) or "z" for text in texts] if single_spaced else texts


def test_the_word_by_word_encoding_gives_the_backends_ids_on_any_chunk(monkeypatch):
    """A chunk of single-spaced plain texts is split at once (joined), any other chunk text by text (words, the
    pieces of a text with other spaces, or the backend); the ids are the backend's either way, and a full memo keeps
    its size, its table included, whatever comes after."""
    pairs = read_parallel_file(sample_corpus_dir() / "train.tsv")
    tokenizer = train_joint_tokenizer(zip(*(side[:200] for side in pairs.values())), vocab_size=300)
    monkeypatch.setattr(streaming, "PIECE_MEMO_SIZE", 300)
    joined, joinable = [], streaming._PieceEncoder._joinable

    def spy(text: str, texts: int) -> bool:
        joined.append(joinable(text, texts))
        return joined[-1]

    monkeypatch.setattr(streaming._PieceEncoder, "_joinable", staticmethod(spy))
    encoder = streaming._piece_encoder(tokenizer)
    chunks = [random_texts(seed, 40, single_spaced=seed % 2 == 0) for seed in range(12)]
    chunks += [
        list(pairs.values())[0][:50],
        ["a\nb", "c"],
        ["x y", "日本 z", "", "<s> w", " lead", "trail ", "a  b", "ǅ ½"],
    ]
    for chunk in chunks:
        expected = [encoding.ids for encoding in tokenizer._tokenizer.encode_batch(chunk, add_special_tokens=True)]
        assert streaming.encode_texts(tokenizer, chunk, target=False) == expected, chunk
    # the single-spaced random chunks and the sample's sentences went the joined way, the others not
    assert joined == [True, False] * 6 + [True, False, False]
    full = (len(encoder.memo), encoder.slots, encoder.used, len(encoder.table), len(encoder.starts))
    assert full[:2] == (301, 301) and encoder.used == encoder.lengths[: encoder.slots].sum()  # nothing else kept
    for chunk in chunks + [random_texts(seed, 40, single_spaced=True) for seed in range(100, 106)]:
        streaming.encode_arrays(tokenizer, chunk, target=False)
    assert (len(encoder.memo), encoder.slots, encoder.used, len(encoder.table), len(encoder.starts)) == full
    # long words fill the memo's ids before its keys: it then keeps the words whose ids fit
    monkeypatch.setattr(streaming, "PIECE_MEMO_IDS", 60)
    texts = [" ".join("ab" * (seed + 3) + "c" * index for index in range(4)) for seed in range(12)]
    expected = [encoding.ids for encoding in tokenizer._tokenizer.encode_batch(texts, add_special_tokens=True)]
    encoder = streaming._PieceEncoder(tokenizer._tokenizer, [tokenizer.eos_token_id])
    for chunk in (texts[:6], texts, texts[6:]):
        assert encoder.encode(chunk) == [expected[texts.index(text)] for text in chunk]
        assert 30 < encoder.used <= 60 and encoder.used == encoder.lengths[: encoder.slots].sum() and encoder.slots > 1


def hub_style_dataset(folder: Path, splits: dict[str, list[tuple[str, str]]]) -> str:
    folder.mkdir()
    for split, rows in splits.items():
        lines = [json.dumps({"translation": {"es": es, "en": en}}) for es, en in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(folder)


def test_a_datasets_stream_is_read_once_per_pass_and_restarts_exactly(tmp_path, caplog):
    rows = [(words(s, j), words(t, j + 1)) for j, (s, t) in enumerate(SIZES * 2)] + [("", "w1")]
    name = hub_style_dataset(tmp_path / "hub", {"train": rows})
    source = HubSource(name, None, "es", "en")
    uninterrupted = take(stream(source, buffer_pairs=5).batches(), 20)
    assert [sorted(pairs) for pairs in pass_pairs(iter(uninterrupted), 1)] == [list(range(22))]
    assert "dropped 1 rows with an empty side" in caplog.text
    for index in (0, 3, 9, 13):
        restarted = take(stream(source, buffer_pairs=5).batches(uninterrupted[index].position), 20 - index - 1)
        assert [b.features for b in restarted] == [b.features for b in uninterrupted[index + 1 :]]
    shares = [pass_pairs(stream(source, rank=rank, world_size=2).batches(), 1)[0] for rank in (0, 1)]
    assert len(shares[0]) + len(shares[1]) == 22  # split by datasets: each row of the pass to one process


TINY = {
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 24,
    "decoder_ffn_dim": 20,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:80]
    (folder / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "valid.tsv").write_text("\n".join(lines[:2]) + "\n", encoding="utf-8")
    return folder


def train_argv(corpus: Path, output_dir: Path, **changes) -> list[str]:
    recipe = {
        "model_type": "deep_nmt",
        "model_overrides": TINY,
        "tokenizer_vocab_size": 300,
        "streaming": True,
        "stream_buffer_pairs": 12,
        "tokenizer_train_pairs": 50,
        "train_file": str(corpus / "train.tsv"),
        "validation_file": str(corpus / "valid.tsv"),
        "max_source_length": 64,
        "max_target_length": 64,
        "max_tokens": 256,
        "max_steps": 5,
        "gradient_accumulation_steps": 2,
        "save_strategy": "steps",
        "save_steps": 1000,
        "learning_rate": 1e-3,
        "output_dir": str(output_dir),
        "seed": 0,
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "num_beams": 1,
        "max_length_b": 2,
        "translate_examples": 0,
        "plot_curves": False,
        "dataloader_num_workers": 0,
        **changes,
    }
    path = output_dir.parent / f"{output_dir.name}-recipe.json"
    path.write_text(json.dumps(recipe))
    return [str(path)]


@pytest.fixture
def trained_batches(monkeypatch):
    """The `input_ids` and `labels` of every batch the Trainer trains on, in order; `stop_at[0]` = n sends this process
    SIGTERM during the n-th batch (the cluster's preemption signal)."""
    record, stop_at = [], [None]
    original = DeepNMTTrainer.training_step

    def spy(self, model, inputs, *args, **kwargs):
        record.append((inputs["input_ids"].tolist(), inputs["labels"].tolist()))
        if stop_at[0] == len(record):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(DeepNMTTrainer, "training_step", spy)
    return record, stop_at


def test_streaming_trains_and_a_preempted_run_continues_with_the_batches_it_had_not_trained(
    corpus, tmp_path, trained_batches, monkeypatch
):
    record, stop_at = trained_batches
    summary = training.run(train_argv(corpus, tmp_path / "whole"))
    assert summary["train_steps"] == 5 and len(record) == 10  # 5 steps x 2 accumulated batches
    whole = list(record)
    assert all(len(ids) * len(ids[0]) <= 256 and len(labels) * len(labels[0]) <= 256 for ids, labels in whole)
    assert (tmp_path / "whole" / "tokenizer" / "tokenizer.json").is_file()

    record.clear()
    stop_at[0] = 5  # SIGTERM in step 3: it ends, is saved (checkpoint-3) and the run stops
    argv = train_argv(corpus, tmp_path / "stopped", dataloader_num_workers=1)
    with pytest.raises(TrainingPreempted, match="checkpoint-3"):
        training.run(argv)
    assert len(record) == 6 and record == whole[:6]
    saved = json.loads((tmp_path / "stopped" / "checkpoint-3" / STREAM_STATE_FILE).read_text())
    assert saved["processes"][0]["batches"] == 6
    checksums = json.loads((tmp_path / "stopped" / "checkpoint_checksums.json").read_text())
    assert STREAM_STATE_FILE in checksums["checkpoints"]["checkpoint-3"]

    record.clear()
    stop_at[0] = None
    trainings = []
    monkeypatch.setattr(preparation, "train_joint_tokenizer", lambda *a, **k: trainings.append(1))
    summary = training.run(argv)  # the same command continues from checkpoint-3
    assert summary["train_steps"] == 5 and not trainings  # the saved tokenizer is loaded, not trained again
    assert record == whole[6:]  # exactly the batches the uninterrupted run trained after step 3
    ends = [load_file(tmp_path / run / "checkpoint-5" / "model.safetensors") for run in ("whole", "stopped")]
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


def test_a_checkpoint_whose_position_cannot_hold_is_refused_by_name(corpus, tmp_path, trained_batches):
    argv = train_argv(corpus, tmp_path / "run", max_steps=2, save_steps=1, gradient_accumulation_steps=1)
    training.run(argv)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "run" / "tokenizer")
    source = FileSource(corpus / "train.tsv", "es", "en")
    same = StreamedPairs(source, tokenizer, 12, 64, 64, max_tokens=256, seed=0)
    assert recorded_position(checkpoint, same)["batches"] == 2
    with pytest.raises(ValueError, match=r"other settings \(stream_buffer_pairs: 12 -> 13\)"):
        recorded_position(checkpoint, same.replace(buffer_pairs=13))
    with pytest.raises(ValueError, match=r"other settings \(seed: 0 -> 1; world_size: 1 -> 2\)"):
        recorded_position(checkpoint, same.replace(seed=1, world_size=2))
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / "train.tsv").write_bytes((corpus / "train.tsv").read_bytes() + b"uno\tone\n")
    with pytest.raises(ValueError, match="the corpus changed"):
        recorded_position(checkpoint, same.replace(source=FileSource(grown / "train.tsv", "es", "en")))
    shifted = tmp_path / "shifted"  # the same size, but the recorded offset is no longer a line start
    shifted.mkdir()
    text = (corpus / "train.tsv").read_bytes()
    offset = recorded_position(checkpoint, same)["reader"]["offsets"][0]
    assert text[offset - 1 : offset] == b"\n"
    (shifted / "train.tsv").write_bytes(text[: offset - 2] + b"\n " + text[offset:])
    with pytest.raises(
        ValueError, match=rf"records byte {offset} of .*train.tsv as the start of a line, but it is not"
    ):
        recorded_position(checkpoint, same.replace(source=FileSource(shifted / "train.tsv", "es", "en")))
    edited = tmp_path / "edited"  # edited in place: same size, same line starts, other text
    edited.mkdir()
    lines = text.decode().splitlines(keepends=True)
    (edited / "train.tsv").write_text("".join([lines[0], lines[1].upper(), *lines[2:]]))
    assert len((edited / "train.tsv").read_bytes()) == len(text) and lines[1].upper() != lines[1]
    with pytest.raises(ValueError, match=r"another version of .*edited/train.tsv: its contents changed since"):
        recorded_position(checkpoint, same.replace(source=FileSource(edited / "train.tsv", "es", "en")))
    (checkpoint / STREAM_STATE_FILE).unlink()
    with pytest.raises(ValueError, match=r"checkpoint-2'? has no stream_state\.json: it was not written by a stream"):
        recorded_position(checkpoint, same)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_steps": -1}, r"`streaming: true` needs `max_steps` .* got max_steps=-1"),
        ({"stream_buffer_pairs": 0}, r"`stream_buffer_pairs` \(pairs held in .*\) must be an integer >= 1, got 0"),
        ({"tokenizer_train_pairs": 0}, r"`tokenizer_train_pairs` must be >= 1 or unset, got 0"),
        ({"train_file": None}, r"needs the corpus to stream, `train_file` or `dataset_name` \(`validation_file` '.*"),
        ({"max_tokens": 40}, r"`max_tokens` \(40\) must hold the longest pair .* = 64 tokens"),
    ],
)
def test_bad_streaming_settings_are_refused_by_name_before_any_work(corpus, tmp_path, changes, message):
    argv = train_argv(corpus, tmp_path / "run", **changes)
    with pytest.raises(ValueError, match=message):
        training.run(argv)
    assert not (tmp_path / "run" / "tokenizer").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"`train_file` '.*train.tsv' holds no sentence pairs"),
        ("source\ttarget\n", r"holds only a header line \('source' / 'target'\) and no sentence pairs"),
    ],
)
def test_an_empty_streamed_corpus_is_refused_before_training(corpus, tmp_path, text, message):
    (tmp_path / "train.tsv").write_text(text, encoding="utf-8")
    argv = train_argv(corpus, tmp_path / "run", train_file=str(tmp_path / "train.tsv"))
    with pytest.raises(ValueError, match=message):
        training.run(argv)


def test_train_staged_refuses_streaming(corpus, tmp_path):
    argv = train_argv(corpus, tmp_path / "run", stage_depths=[1, 2], stage_max_steps=1)
    with pytest.raises(ValueError, match=r"`hf-deep-nmt train-staged` does not stream its corpus"):
        run_staged(argv)


def test_prepare_refuses_a_streaming_recipe(corpus, tmp_path):
    """A streamed corpus is read while training and may not fit the disk: `hf-deep-nmt prepare` has nothing to do."""
    argv = train_argv(corpus, tmp_path / "run")
    with pytest.raises(ValueError, match=r"`streaming: true` reads the corpus while training: there is nothing to"):
        training.run_prepare(argv)
    assert not (tmp_path / "run").exists()


def test_a_streamed_datasets_name_trains_with_its_validation_split(tmp_path):
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:40]
    rows = [tuple(line.split("\t")) for line in lines]
    name = hub_style_dataset(tmp_path / "hub", {"train": rows, "validation": rows[:3]})
    changes = dict(train_file=None, validation_file=None, dataset_name=name, max_steps=2)
    model_args, data_args, _, training_args = parse_arguments(train_argv(tmp_path, tmp_path / "prepared", **changes))
    prepared = training.prepare(model_args, data_args, training_args)
    assert prepared.references == [target for _, target in rows[:3]] and len(prepared.eval_dataset) == 3
    assert isinstance(prepared.train_dataset, StreamedPairs)
    summary = training.run(train_argv(tmp_path, tmp_path / "run", **changes))
    assert summary["train_steps"] == 2 and summary["eval_pairs"] == 3


def test_two_loader_workers_read_their_own_pairs_and_resume_where_each_stopped(tmp_path):
    """With `dataloader_num_workers: 2` each worker tokenizes its own pairs (half the file's bytes each), the
    loader takes their batches in turn, and a loader restarted from the position after any batch hands out exactly
    the batches that followed, even when the other worker's turn comes first."""
    source = FileSource(write_tsv(tmp_path / "c.tsv", SIZES * 2), "es", "en")
    two = stream(source, buffer_pairs=5, workers=2)
    loader = StreamLoader(two, lambda features: features, num_workers=2)
    uninterrupted, positions = [], []
    for batch in loader:
        uninterrupted.append(batch)
        positions.append(loader.position)
        if len(uninterrupted) == 14:
            break
    readers = [stream(source, buffer_pairs=5, rank=reader, world_size=2) for reader in (0, 1)]
    expected = [take(reader.batches(), 7) for reader in readers]  # the single readers of each half
    assert uninterrupted == [expected[index % 2][index // 2].features for index in range(14)]
    assert positions[5]["batches"] == 6 and positions[5]["next"] == 0
    for index in (4, 7):  # resumed after an even and an odd number of batches
        resumed = StreamLoader(two.replace(start=positions[index]), lambda features: features, num_workers=2)
        assert take(iter(resumed), 13 - index) == uninterrupted[index + 1 :], index
    with pytest.raises(ValueError, match="A stream of 2 readers needs 2 loader workers"):
        StreamLoader(two, lambda features: features, num_workers=1)


def test_a_run_with_two_loader_workers_resumes_with_the_batches_it_had_not_trained(corpus, tmp_path, trained_batches):
    record, stop_at = trained_batches
    training.run(train_argv(corpus, tmp_path / "whole", dataloader_num_workers=2))
    whole = list(record)
    record.clear()
    stop_at[0] = 5  # SIGTERM in step 3: checkpoint-3 records where each of the two readers stopped
    argv = train_argv(corpus, tmp_path / "stopped", dataloader_num_workers=2)
    with pytest.raises(TrainingPreempted, match="checkpoint-3"):
        training.run(argv)
    assert record == whole[:6]
    saved = json.loads((tmp_path / "stopped" / "checkpoint-3" / STREAM_STATE_FILE).read_text())
    assert saved["settings"]["loader_workers"] == 2 and len(saved["processes"][0]["readers"]) == 2
    record.clear()
    stop_at[0] = None
    training.run(argv)
    assert record == whole[6:]


def test_a_reader_checks_the_lines_of_its_byte_range_with_the_message_of_the_in_memory_reader(tmp_path):
    """A reader of a byte range checks the lines that start in it, and no other: a bad line stops the reader whose line
    it is, with the message of the in-memory reader (the line's number counted only then); a blank line followed by
    text stops the reader whose range holds the blank line (it looks past its range for the text) and one whose range
    starts inside the blank lines; misaligned two files (dealt out by pair) stop every reader."""
    files = {
        # 28 bytes, ranges [0, 14) and [14, 28): the malformed line 3 starts at byte 16, in the second
        "late.tsv": b"uno\tone\ndos\ttwo\nno tab here\n",
        # pair 1 malformed, in the first range; trailing blank lines (one a no-break space) in the second
        "bad.tsv": b"uno\tone\nno tab here\ntres\tthree\n\xc2\xa0\n\n",
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError) as expected:
            read_parallel_file(tmp_path / name, "es", "en")
        owner = 1 if name == "late.tsv" else 0
        with pytest.raises(ValueError) as raised:
            list(FileSource(tmp_path / name, "es", "en").reader(rank=owner, world_size=2))
        assert str(raised.value) == str(expected.value), name
    assert list(FileSource(tmp_path / "late.tsv", "es", "en").reader(rank=0, world_size=2)) == [
        ("uno", "one"),
        ("dos", "two"),
    ]
    assert list(FileSource(tmp_path / "bad.tsv", "es", "en").reader(rank=1, world_size=2)) == [("tres", "three")]
    (tmp_path / "gap.tsv").write_bytes(b"uno\tone\n\ndos\ttwos\n")  # 18 bytes: the blank line 2 ends [0, 9)
    with pytest.raises(ValueError, match=r"gap.tsv:2: empty line inside the file"):
        list(FileSource(tmp_path / "gap.tsv", "es", "en").reader(rank=0, world_size=2))
    assert list(FileSource(tmp_path / "gap.tsv", "es", "en").reader(rank=1, world_size=2)) == [("dos", "twos")]
    (tmp_path / "gaps.tsv").write_bytes(b"uno\tone\n\n\n\n\ndos\ttwo\n")  # blank lines 2-5 span both ranges
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"gaps.tsv:2: empty line inside the file"):
            list(FileSource(tmp_path / "gaps.tsv", "es", "en").reader(rank=rank, world_size=2))
    (tmp_path / "m.es").write_bytes(b"uno\ndos\ntres\n")
    (tmp_path / "m.en").write_bytes(b"one\ntwo\n")
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"m.es has 3 lines but .*m.en has 2; parallel files must align"):
            list(FileSource(tmp_path / "m", "es", "en").reader(rank=rank, world_size=2))
    (tmp_path / "m.en").write_bytes(b"one\ntwo\nthree\n")  # two files are dealt out by pair: j to reader j mod 2
    assert list(FileSource(tmp_path / "m", "es", "en").reader(rank=1, world_size=2)) == [("dos", "two")]


def test_the_readers_byte_ranges_hold_every_pair_once_read_by_its_reader_alone_and_resume_exactly(
    tmp_path, monkeypatch
):
    pairs = [(f"{'ñ' * (j % 7)}{'語' * (j % 3)} w{j}", f"{'x' * (j * 5 % 23)}é{j}") for j in range(40)]
    texts = {
        "final.tsv": "".join(f"{s}\t{t}\n" for s, t in pairs),
        "open.tsv": "\n".join(f"{s}\t{t}" for s, t in pairs),  # no final newline
        "rows.jsonl": "".join(json.dumps({"es": s, "en": t}, ensure_ascii=False) + "\n" for s, t in pairs),
    }
    monkeypatch.setattr(streaming, "_open_corpus", lambda file: CountingFile(Path(file).open("rb")))
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        source = FileSource(tmp_path / name, "es", "en")
        for world in (1, 2, 3, 5):
            shares = []
            for rank in range(world):
                CountingFile.lines = 0
                shares.append(list(source.reader(rank=rank, world_size=world)))
                # its own lines, and the tail of the line before its range (skipped to find its first line start)
                assert CountingFile.lines == len(shares[-1]) + (rank > 0), (name, world, rank)
            assert [pair for share in shares for pair in share] == pairs, (name, world)  # each once, in file order
        reader = source.reader(rank=1, world_size=3)
        read, positions = [], []
        for pair in reader:
            read.append(pair)
            positions.append(reader.position())
        for index, position in enumerate(positions):  # a reader restarted after any pair continues with the rest
            source.check_position(position, "here", (1, 3))
            assert list(source.reader(position, rank=1, world_size=3)) == read[index + 1 :], (name, index)
        with pytest.raises(
            ValueError, match=r"here records where reader 2 of 3 stopped in .* in bytes \[\d+, \d+\], but"
        ):
            source.check_position(positions[0], "here", (2, 3))
    # a position of the readers that dealt out pairs (no byte range) holds with one reader only
    dealt = {"offsets": [0], "line": 1, "pair": 0}
    source.check_position(dealt, "here", (0, 1))
    with pytest.raises(
        ValueError, match=r"reader 1 of 3 stopped in .*rows.jsonl with the lines dealt out by pair, but"
    ):
        source.check_position(dealt, "here", (1, 3))


def test_each_process_and_each_of_its_loader_workers_reads_its_own_byte_range_alone(tmp_path, monkeypatch):
    """Rank r of W with N loader workers: worker i is reader r x N + i of W x N, and a pass of it reads the lines that
    start in that reader's quarter of the file's bytes and nothing else (the tail of the line before it, to find its
    first line start), whatever the other processes read."""
    path = write_tsv(tmp_path / "c.tsv", SIZES * 4)
    size, offsets = path.stat().st_size, sorted(pair_numbers(path))
    monkeypatch.setattr(streaming, "_open_corpus", lambda file: CountingFile(Path(file).open("rb")))
    source = FileSource(path, "es", "en")
    for rank in (0, 1):
        process = stream(source, buffer_pairs=100, rank=rank, world_size=2, workers=2)
        for worker in (0, 1):
            share, reader = process.reader_share(worker), rank * 2 + worker
            assert (share.rank, share.world_size, share.workers) == (reader, 4, 1)
            mine = [offset for offset in offsets if reader * size // 4 <= offset < (reader + 1) * size // 4]
            CountingFile.lines = 0
            first_pass = pass_pairs(share.batches(), 1)[0]  # (the pass after it begins: its first buffer is read)
            assert sorted(first_pass) == mine
            assert CountingFile.lines == 2 * (len(mine) + (reader > 0))
