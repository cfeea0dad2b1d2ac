"""The documents a newcomer reads point at what exists: every relative link in README.md, benchmarks/README.md,
CONTRIBUTING.md and tests/README.md names an existing file or folder, and every repository path (`recipes/...`,
`benchmarks/...`, `tests/...`) in a command of their ```bash blocks exists. Run from the repository root, as the
documents' commands are. tests/README.md also lists every test file exactly once."""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "benchmarks/README.md", "CONTRIBUTING.md", "tests/README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
REPOSITORY_PATH = re.compile(r"^(recipes|benchmarks|tests)/")


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
