r"""Paragraphs into sentences and back: the model translates sentences (it was trained on them, and the cost of a line
grows with the square of its length), a client sends paragraphs.

`split_sentences` cuts at the whitespace after a sentence's final punctuation (`.`, `!`, `?`, `…` and their
full-width forms, with any closing quotes or brackets) when the next word does not start in lower case, and at every
line break; an abbreviation (`Dr.`, `Sra.`, an initial `J.` or `e.g.`) does not end a sentence. It keeps every piece
of whitespace it cut at, and `join_sentences` puts the translations back between them, so a paragraph's line breaks and
indentation survive translation. No language model of sentence boundaries: a wrong cut costs a little context, never
text.
"""

from __future__ import annotations

import re

_GAP = re.compile(r"\s+")
_FINAL = re.compile(r"[.!?…。！？‼⁇⁈⁉][\"'»”’)\]]*$")
# titles before a name, and single letters (initials, "e.g.", "U.S."): a full stop that does not end the sentence
_ABBREVIATION = re.compile(r"(?:^|[\s(\"'«“‘])(?:Mr|Mrs|Ms|Dr|Prof|Sr|Sra|Srta|Jr|St|vs|No|(?:\w\.)*\w)\.$")


def _ends_sentence(text: str, following: str) -> bool:
    """Whether `text` (the sentence so far) ends a sentence, `following` being the first character after the gap."""
    return bool(_FINAL.search(text)) and not following.islower() and not _ABBREVIATION.search(text)


def split_sentences(text: str) -> tuple[list[str], list[str]]:
    """(sentences, gaps) of `text`: the sentences without their surrounding whitespace, and one more gap than
    sentences: the whitespace before the first, between each two, after the last. A blank text has no sentence and
    one gap, itself; `join_sentences(sentences, gaps) == text` always."""
    body = text.strip()
    if not body:
        return [], [text]
    lead = text[: len(text) - len(text.lstrip())]
    trail = text[len(text.rstrip()) :]
    sentences, gaps, start = [], [lead], 0
    for gap in _GAP.finditer(body):
        if "\n" in gap.group() or _ends_sentence(body[start : gap.start()], body[gap.end()]):
            sentences.append(body[start : gap.start()])
            gaps.append(gap.group())
            start = gap.end()
    sentences.append(body[start:])
    gaps.append(trail)
    return sentences, gaps


def join_sentences(translations: list[str], gaps: list[str]) -> str:
    """The translations of `split_sentences`' sentences, with the whitespace that was between them."""
    if len(gaps) != len(translations) + 1:
        raise ValueError(f"{len(translations)} translations need {len(translations) + 1} gaps, got {len(gaps)}.")
    return gaps[0] + "".join(text + gap for text, gap in zip(translations, gaps[1:]))
