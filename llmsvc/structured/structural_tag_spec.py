"""Reading a structural tag's JSON (structural_tag.py translates it): each field's type and
shape checked, a ConstraintError naming the part at fault otherwise."""
from __future__ import annotations

from llmsvc.structured import errors as E

KIND = "structural_tag"


def fail(path: str, why: str, reason: str = E.INVALID_GRAMMAR) -> E.ConstraintError:
    return E.ConstraintError(KIND, reason, f"{path}: {why}")


def leading_string(f) -> tuple[str, dict | None]:
    """(the string format `f` starts with, what follows it: None for a const_string, the tag
    with an empty begin for a tag); ("", None) when it starts with no known string."""
    if not isinstance(f, dict):
        return "", None
    if f.get("type") == "const_string" and isinstance(f.get("value"), str):
        return f["value"], None
    if f.get("type", "tag") == "tag" and isinstance(f.get("begin"), str) and f["begin"]:
        return f["begin"], dict(f, begin="")
    return "", None


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def string_field(f: dict, key: str, path: str, allow_empty: bool = False) -> str:
    v = f.get(key)
    if not isinstance(v, str) or not (v or allow_empty):
        raise fail(path, f'needs "{key}": a {"" if allow_empty else "non-empty "}string')
    return v


def strings_field(f: dict, key: str, path: str, default):
    v = f.get(key, default)
    if v is None or not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise fail(path, f'"{key}" must be a list of strings')
    return list(v)


def flag_field(f: dict, key: str, path: str) -> bool:
    v = f.get(key, False)
    if not isinstance(v, bool):
        raise fail(path, f'"{key}" must be true or false')
    return v


def elements_field(f: dict, path: str) -> list:
    v = f.get("elements")
    if not isinstance(v, list) or not v:
        raise fail(path, 'needs a non-empty "elements" list')
    return v


def tag_parts(f: dict, path: str) -> tuple[str, list[str]]:
    """(begin, [end, ...]) of a tag; a token-format begin or end is not supported."""
    begin, end = f.get("begin"), f.get("end")
    if not isinstance(begin, str):
        raise fail(path, 'a tag needs "begin": a string (token formats are not supported)')
    if isinstance(end, str):
        end = [end]
    if not isinstance(end, list) or not end or not all(isinstance(e, str) for e in end):
        raise fail(path, 'a tag needs "end": a string or a non-empty list of strings')
    if "content" not in f:
        raise fail(path, 'a tag needs "content"')
    return begin, end
