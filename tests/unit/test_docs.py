"""Documentation that is generated must match the code that generates it."""

from pathlib import Path

import meshformer.models  # noqa: F401 (registers the families: model_config.type's choices, as the CLI does)
from meshformer.cli.config_cmd import iter_fields, markdown

ROOT = Path(__file__).resolve().parents[2]


def test_config_md_is_generated_from_the_schema():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), (
        "docs/config.md is stale: run `.venv/bin/meshformer config explain --markdown > docs/config.md`"
    )


def test_every_field_has_a_one_line_doc():
    for name, _tp, _default, doc, _choices in iter_fields():
        assert doc and "\n" not in doc and len(doc) < 200, name


def test_readme_opens_with_the_two_setup_commands():
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip()]
    assert lines[1] == "```bash" and lines[2].startswith("make demo") and lines[3].startswith("make test")


def test_commands_in_docs_run_from_the_virtualenv():
    # The README's spelling everywhere: a command copied from any page runs without activating the venv.
    bare = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        inside = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                inside = not inside
            elif inside and line.split(" ", 1)[0] in ("meshformer", "python", "torchrun", "pip"):
                bare.append(f"{page.name}:{n}: {line}")
    assert not bare, "use .venv/bin/...: " + "; ".join(bare)
