"""Rebuild the bundled sample corpus (hf_deep_nmt/sample_data/) from a verse-aligned Spanish-English Bible corpus: a
folder with `train.tsv` and `valid.tsv` (`spanish<TAB>english`, one verse per line, validation verses from books kept
out of training) and the `COPYRIGHT.*` and `PACKAGES.txt` files that come with it.

The slice is deterministic: verses of at most MAX_WORDS words on both sides, every STRIDE-th of them, so that the
sample spreads over all training books; validation verses come from the held-out books only.

    python recipes/make_sample_corpus.py ../shared/data/bible-es-en
"""

import argparse
import shutil
from pathlib import Path

MAX_WORDS = 30
TRAIN_PAIRS = 8000
VALID_PAIRS = 300


def short_pairs(path: Path) -> list[str]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        source, target = line.split("\t")
        if len(source.split()) <= MAX_WORDS and len(target.split()) <= MAX_WORDS:
            lines.append(line)
    return lines


def spread(lines: list[str], count: int) -> list[str]:
    stride = max(len(lines) // count, 1)
    return lines[::stride][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="folder with train.tsv, valid.tsv and the COPYRIGHT files")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "hf_deep_nmt" / "sample_data"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", TRAIN_PAIRS), ("valid", VALID_PAIRS)):
        pairs = spread(short_pairs(args.source / f"{name}.tsv"), count)
        (args.out / f"{name}.tsv").write_text("\n".join(pairs) + "\n", encoding="utf-8")
        print(f"{name}: {len(pairs)} pairs")
    for licence in sorted(args.source.glob("COPYRIGHT.*")) + [args.source / "PACKAGES.txt"]:
        shutil.copyfile(licence, args.out / licence.name)


if __name__ == "__main__":
    main()
