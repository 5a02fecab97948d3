"""docs/config.md is generated from the config dataclass tree and kept in sync with it."""

import dataclasses
import textwrap
from pathlib import Path

from longrl.config import docs as config_docs
from longrl.config.schema import Config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    assert DOCS.is_file(), f"docs/config.md is missing: run `{config_docs.REGENERATE}`"
    assert DOCS.read_text() == config_docs.render(), \
        f"docs/config.md is out of date with src/longrl/config/schema.py: run `{config_docs.REGENERATE}`"


def test_every_config_key_is_documented():
    missing = config_docs.undocumented()
    assert not missing, (f"config keys without a meaning: {', '.join(missing)}; add a `# ...` comment after each field "
                         f"in src/longrl/config/schema.py (or metadata={{'help': ...}}), then run `{config_docs.REGENERATE}`")
    text = config_docs.render()
    for section in ("model", "lora", "data", "generation", "train", "output"):
        for f in dataclasses.fields(type(getattr(Config(), section))):
            assert f"`{section}.{f.name}`" in text


def test_comment_rules():
    """Trailing comments with their continuation lines, comment blocks above a field, and help metadata."""
    source = textwrap.dedent('''
        from dataclasses import dataclass, field

        @dataclass
        class Section:
            a: int = 1  # first line
            #             continues here
            b: int = 2
            # a block above c
            # in two lines
            c: str = "x"
            d: list = field(default_factory=list, metadata={"help": "from metadata"})
            e: float = (
                0.5)  # after a statement of two lines
    ''')
    docs = config_docs.field_comments(source)["Section"]
    assert docs == {"a": "first line continues here", "b": "", "c": "a block above c in two lines", "d": "",
                    "e": "after a statement of two lines"}
