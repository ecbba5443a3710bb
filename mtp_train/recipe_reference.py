"""The recipe key reference (docs/recipe-reference.md), generated from the recipe schema (mtp_train/recipe.py).

Every key of every section, with its type, limits, default and description, in the order the schema declares them;
a section's docstring heads its table. The file is generated, never edited by hand: tests/test_recipe_reference.py
fails when the committed copy differs from what the schema gives, and names the command that rewrites it:

    python -m mtp_train.recipe_reference            # rewrite docs/recipe-reference.md
    python -m mtp_train.recipe_reference --check    # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mtp_train.recipe import Recipe

REFERENCE_PATH = Path("docs/recipe-reference.md")
REGENERATE_COMMAND = "python -m mtp_train.recipe_reference"

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))

_HEADER = f"""\
# Recipe key reference

<!-- Generated from mtp_train/recipe.py by `{REGENERATE_COMMAND}`; do not edit by hand. -->

Every key a recipe (a YAML file such as those in `recipes/`) can set, section by section, as the schema in
`mtp_train/recipe.py` declares it. A key left out of a recipe takes the default shown; an unknown key is an error
that names it. Any key can be set from the command line with `--set section.key=value` (the value is read as YAML:
`--set train.lr=3e-4`, `--set eval.num_speculative_tokens=[1,2]`, `--set eval.prompts=` for null). Paths are
relative to the directory the command runs in (the repository root).

The shipped recipes, the hardware each is for and where their data comes from: [recipes.md](recipes.md).
"""


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the section model a field holds, whether it is a list of them) or (None, False) for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None, False


def _bounds(metadata: Sequence[Any]) -> list[str]:
    """The limits in a field's metadata as text: `>= 1`, `< 1.0`."""
    texts = []
    for item in metadata:
        for name, symbol in _BOUNDS:
            if isinstance(item, getattr(annotated_types, name.capitalize())):
                texts.append(f"{symbol} {getattr(item, name)}")
    return texts


def type_text(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """A field's type as a recipe writer reads it: `int (>= 1)`, `one of: auto, cpu, cuda`, `list of int`,
    `str or null`."""
    metadata = list(metadata)
    if get_origin(annotation) is Annotated:
        base, *extras = get_args(annotation)
        for extra in extras:
            metadata += list(extra.metadata) if isinstance(extra, FieldInfo) else [extra]
        return type_text(base, metadata)
    bounds = _bounds(metadata)
    limits = f" ({', '.join(bounds)})" if bounds else ""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        texts = [type_text(member, metadata) for member in members]
        if len(members) < len(get_args(annotation)):
            texts.append("null")
        return " or ".join(texts)
    if get_origin(annotation) is Literal:
        choices = [str(choice) for choice in get_args(annotation)]
        return choices[0] if len(choices) == 1 else "one of: " + ", ".join(choices)
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return f"list of {type_text(item)}{limits}"
    if get_origin(annotation) is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type):
        return annotation.__name__ + limits
    return str(annotation)


def default_text(field: FieldInfo) -> str:
    """The default as YAML flow text (`null`, `true`, `[1, 2, 3]`, `{}`); `(required)` for a key without one."""
    default = field.get_default(call_default_factory=True)
    if field is Recipe.model_fields["name"]:
        return "(the file's stem)"  # no schema default: load_recipe fills it in
    if default is PydanticUndefined:
        return "(required)"
    if isinstance(default, BaseModel):
        default = default.model_dump(mode="json")
    elif isinstance(default, list):
        default = [item.model_dump(mode="json") if isinstance(item, BaseModel) else item for item in default]
    return _flow(default)


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped, and `<`/`>` outside code spans written as
    entities (`data/prepared/<name>` would otherwise render as an HTML tag and vanish)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for index in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[index] = parts[index].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((inspect.getdoc(model) or "").split())


def _sections(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted name, model) of `model` and of every section nested in it, depth first in declaration order; a list of
    sections is named `key[]`."""
    yield prefix, model
    for name, field in model.model_fields.items():
        inner, is_list = _section_model(field.annotation)
        if inner is not None:
            yield from _sections(inner, f"{prefix}.{name}[]" if is_list else f"{prefix}.{name}")


def _table(section: str, fields: dict[str, FieldInfo]) -> list[str]:
    """The Markdown table of one section's keys; a nested section's row links to its own table."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in fields.items():
        inner, is_list = _section_model(field.annotation)
        key = f"`{section}.{name}`" if section else f"`{name}`"
        if inner is None:  # a value: its type and default read as code
            kind = f"`{type_text(field.annotation, field.metadata)}`"
            default = f"`{default_text(field)}`"
            description = field.description or ""
        else:  # a section: a link to its own table; a list's default is its items, a section's its keys' defaults
            where = f"{section}.{name}[]" if is_list else f"{section}.{name}"
            kind = f"{'list of sections' if is_list else 'section'}: [{where}](#{_anchor(where)})"
            default = f"`{default_text(field)}`" if is_list else "its keys' defaults"
            description = field.description or _doc(inner)
        rows.append(f"| {key} | {_cell(kind)} | {_cell(default)} | {_cell(description)} |")
    return rows


def _anchor(heading: str) -> str:
    """GitHub's anchor of a `## heading`: lower case, punctuation other than '-' and '_' dropped."""
    return "".join(char for char in heading.lower() if char.isalnum() or char in "-_ ").replace(" ", "-")


def render_reference() -> str:
    """The whole reference as Markdown."""
    top_level = {name: field for name, field in Recipe.model_fields.items()
                 if _section_model(field.annotation)[0] is None}
    lines = [_HEADER, "## Top level", "", _doc(Recipe), "", *_table("", top_level), ""]
    for name, field in Recipe.model_fields.items():
        inner, is_list = _section_model(field.annotation)
        if inner is None:
            continue
        for section, model in _sections(inner, f"{name}[]" if is_list else name):
            lines += [f"## {section}", "", _doc(model), "", *_table(section, model.model_fields), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.recipe_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH, help="file written (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out is out of date")
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is out of date with mtp_train/recipe.py; run `{REGENERATE_COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
