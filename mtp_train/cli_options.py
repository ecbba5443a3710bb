"""Command-line options generated from the recipe schema: one place (the recipe's `Field`) for each option's type,
choices, default, limits and help.

A subcommand names the recipe keys it exposes (`add_recipe_args(parser, ["eval.limit", ...])`); each becomes an option
whose spelling is the key's last part (`--limit`), the field's `flag` (`json_schema_extra`, e.g. precision.compute's
`--dtype`) or the one the command gives. Its help is the field's description, its choices the field's `Literal`
values, its limits and default the field's. A value given is applied like `--set KEY=VALUE` (parsed as YAML, after
every `--set`) and checked by the recipe's validation alone, so an out-of-range value gets the same error, naming the
option and the key (`--limit 0: eval.limit: expected a value >= 1, got 0`).
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mtp_train.recipe import DEFAULT_RECIPE_PATH, Override, Recipe, build_recipe, load_recipe, parse_value

_BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


@dataclass(frozen=True)
class RecipeOption:
    """One generated option: the recipe key it sets and how it reads on the command line."""

    key: str  # dotted recipe key, e.g. "eval.limit"
    flag: str  # e.g. "--limit"
    dest: str  # the argparse destination (absent from the namespace when the option is not given)
    is_list: bool
    is_bool: bool


def schema_field(key: str) -> FieldInfo:
    """The pydantic field of a dotted recipe key (`eval.limit`); KeyError naming the key's part that is not one."""
    model: type[BaseModel] = Recipe
    parts = key.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            raise KeyError(f"{key}: {'.'.join(parts[: depth + 1])} is not a recipe key")
        if depth == len(parts) - 1:
            return field
        inner = field.annotation
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            raise KeyError(f"{key}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        model = inner
    raise KeyError(key)


def _without_none(annotation: Any) -> Any:
    """`X | None` → X (a nullable option takes `null`)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _bounds(annotation: Any, field: FieldInfo | None = None) -> list[str]:
    """The limits of a field or list item as text (`>= 1`, `<= 8`), from its `Field(ge=..., le=...)` metadata."""
    metadata = list(field.metadata) if field is not None else []
    if get_origin(annotation) is Annotated:
        for extra in get_args(annotation)[1:]:
            metadata += list(extra.metadata) if isinstance(extra, FieldInfo) else [extra]
    texts = []
    for item in metadata:
        for name, symbol in _BOUND_TEXT.items():
            if isinstance(item, getattr(annotated_types, name.capitalize())):
                texts.append(f"{symbol} {getattr(item, name)}")
    return texts


def _text_or_null(text: str) -> str | None:
    """A nullable string option's value: the text, or None for `null` or an empty value (as `--set` reads them)."""
    return None if text.strip() in ("", "null") else text


def _value(text: str) -> Any:
    """A non-string option's value as `--set` reads it (YAML: `3`, `0.5`, `null`, `true`); text that is not valid
    YAML is passed on as it is, for the recipe's validation to name."""
    try:
        return parse_value(text)
    except yaml.YAMLError:
        return text


def _option_kwargs(key: str, field: FieldInfo) -> tuple[dict[str, Any], bool, bool]:
    """argparse keywords of the option for `key` (type, nargs, choices, metavar, help), and whether it is a list
    and a bool."""
    annotation = _without_none(field.annotation)
    is_list = get_origin(annotation) is list
    item = get_args(annotation)[0] if is_list else annotation
    bounds = _bounds(item) if is_list else _bounds(annotation, field)
    base = get_args(item)[0] if get_origin(item) is Annotated else item
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS}  # not given: no attribute (a given `null` is None)
    is_bool = base is bool and not is_list
    if is_bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(base) is Literal:
        kwargs["choices"] = [str(choice) for choice in get_args(base)]
    else:
        nullable = field.annotation is not annotation
        kwargs["type"] = (_text_or_null if nullable else str) if base is str else _value
        kwargs["metavar"] = {int: "N", float: "X", str: "TEXT"}.get(base, "VALUE")
    if is_list:
        kwargs["nargs"] = "+"
    default = field.get_default(call_default_factory=True)
    notes = [f"each {' and '.join(bounds)}" if is_list else " and ".join(bounds)] if bounds else []
    if field.annotation is not annotation:
        notes.append("null = none")
    shown = "null" if default is None else default
    help_text = (field.description or "").replace("%", "%%")
    limits = f"; {', '.join(notes)}" if notes else ""
    kwargs["help"] = f"{help_text} (recipe: {key}, default {shown}{limits})".lstrip()
    return kwargs, is_list, is_bool


def add_recipe_options(parser: argparse.ArgumentParser, keys: Iterable[str],
                       flags: Mapping[str, str] | None = None) -> list[RecipeOption]:
    """Add one option per recipe key in `keys` to `parser`, spelt as `flags` says, else as the field's `flag`, else
    `--<last part>`; the options are recorded on the parsed namespace (`recipe_options`) for `recipe_overrides`."""
    flags = dict(flags or {})
    options = []
    for key in keys:
        field = schema_field(key)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = flags.pop(key, None) or extra.get("flag") or "--" + key.rsplit(".", 1)[-1].replace("_", "-")
        kwargs, is_list, is_bool = _option_kwargs(key, field)
        dest = "recipe:" + key
        parser.add_argument(flag, dest=dest, **kwargs)
        options.append(RecipeOption(key, flag, dest, is_list, is_bool))
    if flags:
        raise KeyError(f"flags given for keys not exposed: {sorted(flags)}")
    parser.set_defaults(recipe_options=tuple(options))
    return options


def recipe_overrides(args: argparse.Namespace) -> list[Override]:
    """The generated options given on the command line, as overrides of their recipe keys (in the order the command
    declared them)."""
    overrides = []
    for option in getattr(args, "recipe_options", ()):
        if not hasattr(args, option.dest):
            continue
        value = getattr(args, option.dest)
        if option.is_bool:
            origin = option.flag if value else "--no-" + option.flag.removeprefix("--")
        else:
            shown = value if option.is_list else [value]
            origin = f"{option.flag} {' '.join('null' if v is None else str(v) for v in shown)}"
        overrides.append(Override(tuple(option.key.split(".")), value, origin))
    return overrides


def add_recipe_args(parser: argparse.ArgumentParser, keys: Iterable[str] = (),
                    flags: Mapping[str, str] | None = None) -> list[RecipeOption]:
    """Add `--recipe PATH`, repeatable `--set KEY=VALUE` (dest: recipe, overrides) and the generated options of
    `keys` (`add_recipe_options`) to a subcommand's parser."""
    parser.add_argument(
        "--recipe", default=DEFAULT_RECIPE_PATH, metavar="PATH", help=f"recipe YAML (default: {DEFAULT_RECIPE_PATH})"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set train.lr=3e-4 (YAML values; repeatable; the options below are "
        "applied after every --set)",
    )
    return add_recipe_options(parser, keys, flags)


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe named by `--recipe` with the `--set` overrides, then the generated options, applied."""
    return load_recipe(args.recipe, [*args.overrides, *recipe_overrides(args)])


def defaults_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe of schema defaults with the generated options applied, for a command that reads no recipe file
    (`generate`): its options are checked by the same validation."""
    return build_recipe({"name": "defaults"}, recipe_overrides(args), "<defaults>")
