"""The docs name what exists: the modules they point to, the files they link, every config of
every group in running.md's list; they cite no internal tracker and nothing outside the
repository; and the README's set-up line says how an ordinary machine gets the CPU torch."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGES = ("common", "policies", "simulator", "real_backend", "experiments", "benchmarks",
            "tests")


def _where(doc: Path, text: str, pos: int) -> str:
    return f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def test_every_module_the_docs_name_exists():
    module = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})/[\w/]+\.py)\b")
    missing = [f"{_where(doc, text, m.start())}: {m[1]}" for doc in DOCS
               for text in [doc.read_text()] for m in module.finditer(text)
               if not (ROOT / m[1]).is_file()]
    assert not missing, missing  # install.md named experiments/paths.py (common/paths.py)


def test_every_link_and_relative_path_stays_in_the_repository_and_exists():
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        targets = [(m.start(), m[1]) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
        targets += [(m.start(), m[1]) for m in re.finditer(r"`(\.\./[^`\s]*)`", text)]
        for pos, target in targets:
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{_where(doc, text, pos)}: {target}")
    assert not bad, bad  # vllm_published.md named ../shared/docs/... outside the repository


def test_no_doc_cites_an_internal_tracker_number():
    """vLLM's issues and PRs are cited as #NNNN or by URL; "issue 32" meant this project's own
    tracker, which a reader of the repository cannot open."""
    cites = [f"{_where(doc, text, m.start())}: {m[0]}" for doc in DOCS
             for text in [doc.read_text()] for m in re.finditer(r"\b[Ii]ssues? \d+", text)]
    assert not cites, cites


def test_running_md_lists_every_config_of_every_group():
    text = (ROOT / "docs" / "running.md").read_text()
    section = text.split("\n## Config groups\n", 1)[1].split("\n## ", 1)[0]
    bullets = {m[1]: m[2] for m in re.finditer(r"^- `(\w+)`([^\n]*(?:\n  [^\n]*)*)", section,
                                               re.MULTILINE)}
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml"))
              for d in (ROOT / "conf").iterdir() if d.is_dir() and d.name != "hydra"
              and any(d.glob("*.yaml"))}
    assert set(bullets) == set(groups), (sorted(bullets), sorted(groups))
    for group, names in groups.items():
        listed = set(re.findall(r"[\w]+", bullets[group]))
        assert not set(names) - listed, (group, sorted(set(names) - listed))


def test_the_readme_set_up_line_says_where_the_cpu_torch_comes_from():
    """On that line, not only in install.md: PyPI's torch is a CUDA build on Linux."""
    block = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("\n", 1)[1]
    block = block.split("```", 1)[0]
    (line,) = [ln for ln in block.splitlines() if "pip install" in ln and "torch" in ln]
    command, _, comment = line.partition("  # ")
    assert "pip install" in command and "CPU" in comment
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in comment
