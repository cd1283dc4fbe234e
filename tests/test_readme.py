"""README.md's code blocks run as written; every document the README, the docs and the code cite exists.

Python blocks run in README order in one namespace, like a notebook, on CPU workers: the quick
start from an empty namespace (it must run as is), later blocks with its names plus two
placeholders, `layers` (a fresh tiny language model) and `data` (a few batches).  A block whose
first line starts with NOT_RUN is illustrative only and skipped.  Shell blocks: every `roundpipe`
command runs (in a scratch folder, in order; `train` only with a few steps), `make demo` /
`make test` are checked against the Makefile instead of run, and any other command fails the
test until it is covered here.
"""
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = "# not run"
CHEAP = {"doctor", "simulate", "timeline", "train"}   # roundpipe subcommands this test runs
MAX_TRAIN_STEPS = 5


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, code, `## ` section) of every fenced block, in order."""
    out = []
    for m in re.finditer(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S):
        sections = re.findall(r"^## (.*)$", text[:m.start()], re.M)
        out.append((m.group(1), m.group(2), sections[-1] if sections else ""))
    return out


BLOCKS = fenced_blocks(README.read_text())


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


def roundpipe_exe() -> str:
    script = Path(sys.executable).with_name("roundpipe")
    return str(script) if script.exists() else shutil.which("roundpipe") or pytest.fail("no roundpipe script")


def test_readme_has_the_blocks_this_test_expects():
    """The quick start is a Python block that is run, and the README stays short."""
    kinds = [(lang, section) for lang, _, section in BLOCKS]
    assert ("python", "Quick start") in kinds and ("python", "API in brief") in kinds
    assert ("bash", "Two commands") in kinds
    assert len(README.read_text().splitlines()) <= 160


def tiny_lm_layers(vocab: int = 64, width: int = 32) -> list[nn.Module]:
    return [nn.Embedding(vocab, width), nn.Sequential(nn.Linear(width, width), nn.GELU()), nn.Linear(width, vocab)]


def test_python_blocks_run(tmp_path, monkeypatch, capsys):
    """Every Python block runs on CPU workers; the quick start's loss falls."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    ran = 0
    for lang, code, section in BLOCKS:
        if lang != "python" or code.lstrip().startswith(NOT_RUN):
            continue
        if ran:   # after the quick start: the placeholders the API block names
            torch.manual_seed(1)
            namespace["layers"] = tiny_lm_layers()
            namespace["data"] = [(x, (x + 1) % 64) for x in torch.randint(0, 64, (3, 4, 8)).unbind(0)]
        exec(compile(code, f"README.md ({section})", "exec"), namespace)
        ran += 1
        if section == "Quick start":
            m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", capsys.readouterr().out)
            assert m, "the quick start prints 'loss FIRST -> LAST'"
            assert float(m.group(2)) < float(m.group(1)) - 0.5
    assert ran >= 2
    assert (tmp_path / "run.json").exists()   # the API block's trace


def check_make_target(argv: list[str]) -> None:
    assert argv[1:] in (["demo"], ["test"]), f"README runs {shlex.join(argv)}; only `make demo` / `make test` are known"
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(rf"^{argv[1]}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, f"the Makefile has no `{argv[1]}` target with a recipe"
    assert {"demo": "roundpipe train", "test": "pytest"}[argv[1]] in recipe.group(1)


def train_output_labels() -> list[str]:
    """'model', 'data', ... : the labels of the README's example output of `roundpipe train`."""
    block = next(code for lang, code, section in BLOCKS if lang == "" and "roundpipe train" in section)
    return [m.group(1) for m in re.finditer(r"^([a-z][a-z -]*):", block, re.M)]


SHELL_BLOCKS = [pytest.param(code, id=section.split(":")[0].strip().replace(" ", "-"))
                for lang, code, section in BLOCKS if lang in ("bash", "sh", "console")]


@pytest.mark.parametrize("code", SHELL_BLOCKS)
def test_shell_commands(code, tmp_path):
    """Cheap `roundpipe` commands exit 0 (in order, in a scratch folder); make targets exist."""
    commands = shell_commands(code)
    assert commands
    for argv in commands:
        if argv[0] == "make":
            check_make_target(argv)
            continue
        assert argv[0] == "roundpipe", f"README command {shlex.join(argv)!r} is not covered by {__file__}"
        assert argv[1] in CHEAP, f"`roundpipe {argv[1]}` is not known to be cheap: cover it in {__file__}"
        if argv[1] == "train":
            steps = argv[argv.index("--steps") + 1] if "--steps" in argv else None
            assert steps is not None and int(steps) <= MAX_TRAIN_STEPS, "README's train command must be short"
        done = subprocess.run([roundpipe_exe(), *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        if argv[1] == "train":   # the README's example output has the same lines
            for label in train_output_labels():
                assert re.search(rf"^{re.escape(label)}:", done.stdout, re.M), (label, done.stdout)


def markdown_links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_resolve(doc):
    """Every relative link of README.md and docs/*.md names an existing file and heading."""
    for link in markdown_links(doc):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name} links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{doc.name}: no heading for #{anchor} in {path.name}"


def test_cited_documents_exist():
    """Every .md document the package, native sources, kernels, benchmarks, scripts or docs cite is in the repo."""
    roots = ["roundpipe", "csrc", "kernels", "bench", "scripts", "docs"]
    files = [p for r in roots for p in (ROOT / r).rglob("*") if p.suffix in {".py", ".h", ".cpp", ".sh", ".md"}]
    missing = []
    for path in files + [README]:
        text = path.read_text(errors="replace")
        for name in set(re.findall(r"[\w./-]*\b[A-Za-z_]\w*\.md\b", text)):
            name = name.lstrip("./")
            if not any((base / name).exists() for base in (ROOT, ROOT / "docs", path.parent)):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        missing += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"\bDESIGN(?:\.md)? \d[\d.]*", text)]
    assert not missing, missing
