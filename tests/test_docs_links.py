"""The documents a newcomer reads point at what exists: every relative link in README.md, the pages of docs/,
benchmarks/README.md, CONTRIBUTING.md and tests/README.md names an existing file or folder, every `#anchor` of a link
to a Markdown page (or within the same page) names one of its headings, and every repository path (`recipes/...`,
`benchmarks/...`, `tests/...`) in a command of their ```bash blocks exists. Run from the repository root, as the
documents' commands are. README.md links every page of docs/, and tests/README.md lists every test file exactly
once."""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# every page of docs/, found by glob, so that a new page is checked without being named here
DOCUMENTS = ["README.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))]
DOCUMENTS += ["benchmarks/README.md", "CONTRIBUTING.md", "tests/README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
REPOSITORY_PATH = re.compile(r"^(recipes|benchmarks|tests)/")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation other than `-` and `_` dropped, spaces as
    `-`, a repeated heading numbered `-1`, `-2`, ...; headings inside code blocks (shell comments) do not count."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, number = slug, 0
        while anchor in anchors:
            number += 1
            anchor = f"{slug}-{number}"
        anchors.add(anchor)
    return anchors


def relative_links(text: str) -> list[str]:
    """Link targets outside code that are neither URLs nor anchors within the same page."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [match.group(1) for match in LINK.finditer(prose)]
    return [target for target in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target)]


def bash_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks, comments removed and continued lines joined."""
    commands = []
    for language, body in FENCE.findall(text):
        if language not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def repository_paths(command: str) -> list[str]:
    """Words of a command that name a file or folder of this repository (an option's `--flag=value` included)."""
    paths = []
    for word in command.split():
        word = word.strip("'\"").split("=", 1)[-1].strip("'\"").rstrip(";,)")
        if REPOSITORY_PATH.match(word):
            paths.append(word)
    return paths


def exists(path: Path) -> bool:
    return bool(glob.glob(str(path))) if any(char in str(path) for char in "*?[") else path.exists()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_point_to_existing_files(document):
    path = ROOT / document
    targets = relative_links(path.read_text(encoding="utf-8"))
    missing = [target for target in targets if not exists(path.parent / target.split("#", 1)[0])]
    assert not missing, f"{document} links to files that do not exist: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_anchors_name_headings_of_the_linked_page(document):
    path = ROOT / document
    text = path.read_text(encoding="utf-8")
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [match.group(1) for match in LINK.finditer(prose)]
    broken = []
    for target in targets:
        page, _, anchor = target.partition("#")
        if not anchor or re.match(r"^[a-z][a-z0-9+.-]*:", page) or not (page == "" or page.endswith(".md")):
            continue
        linked = path if page == "" else path.parent / page
        if linked.is_file() and anchor not in heading_anchors(linked.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{document} links to anchors that no heading of the linked page has: {broken}"


def test_the_readme_links_every_docs_page():
    pages = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds no pages"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert not set(pages) - linked, f"README.md does not link these pages of docs/: {sorted(set(pages) - linked)}"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_paths_in_bash_commands_exist(document):
    missing = [
        (command, word)
        for command in bash_commands((ROOT / document).read_text(encoding="utf-8"))
        for word in repository_paths(command)
        if not exists(ROOT / word)
    ]
    assert not missing, f"{document}: commands name repository paths that do not exist: {missing}"


def test_the_checks_find_what_they_look_for():
    """The extraction itself: links outside code, URLs and anchors skipped, bash paths with flags and comments."""
    text = (
        'See [a](docs/a.md#part), ![b](img/b.png "title"), [web](https://x.org), [here](#top), `[c](no.md)`.\n'
        "```bash\n"
        "python benchmarks/x.py --out=tests/y.json \\\n"
        "    recipes/z.json   # writes benchmarks/results/w.json\n"
        "```\n"
        "```python\nopen('recipes/not_a_command.json')\n```\n"
    )
    assert relative_links(text) == ["docs/a.md#part", "img/b.png"]
    page = "# Top\n## Settings of `DeepNMTConfig`\n## Versions: what is tested, and more\n## Top\n"
    page += "```bash\n# one GPU\n```\n"
    assert heading_anchors(page) == {"top", "settings-of-deepnmtconfig", "versions-what-is-tested-and-more", "top-1"}
    (command,) = bash_commands(text)
    assert repository_paths(command) == ["benchmarks/x.py", "tests/y.json", "recipes/z.json"]


def test_the_tests_readme_lists_every_test_file_once():
    listed = re.findall(r"\]\((test_\w+\.py)\)", (ROOT / "tests" / "README.md").read_text(encoding="utf-8"))
    duplicated = sorted({name for name in listed if listed.count(name) > 1})
    assert not duplicated, f"tests/README.md lists these more than once: {duplicated}"
    on_disk = sorted(path.name for path in (ROOT / "tests").glob("test_*.py"))
    assert sorted(set(listed)) == on_disk, (
        f"tests/README.md misses {sorted(set(on_disk) - set(listed))} and lists absent "
        f"{sorted(set(listed) - set(on_disk))}"
    )
