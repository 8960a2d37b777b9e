"""xgrammar's structural tags, as vLLM takes them, translated into one llguidance grammar.

A structural tag describes free text with tagged, constrained regions (tool calls inside a
reply). Both of vLLM's shapes are read: legacy {"structures": [{begin, schema, end}],
"triggers"} (read as one `triggered_tags`), and {"format": FORMAT}. docs/structured-output.md
lists the formats; token-level ones, `dispatch`, non-JSON `style`s and length budgets are refused.

llguidance lexes (xgrammar parses bytes), which shapes the translation:
- Free text (`any_text`, the text around `triggered_tags`) never contains a trigger, an
  exclude, or the end of the nearest enclosing tag (xgrammar's rules). Where text is followed
  by a known string (a trigger, the tag's end, the const_string after it) it is one lazy
  lexeme "text, then that string", which ends at the string's first occurrence; a greedy text
  lexeme could not give back the string's first bytes once it had taken them.
- A string is split into the model's special tokens and plain text (vocabulary.py): a special
  token is matched as that token (`<[id]>`), never as its spelling. Free text may hold special
  tokens (SMG relies on "<|tool_calls_section_end|>" after Kimi-K2's calls), except any that a
  trigger, an exclude or the string after the text names (Kimi-K3's "<|open|>tools<|sep|>"
  keeps "<|open|>" out: stricter than xgrammar, which allows "<|open|>" before other text) or
  whose text holds a plain exclude ("<|" keeps out every "<|...|>" token); a special token's
  spelling as plain text is excluded wherever the token is.
- Free text must end the output or be followed by a known string; followed by anything else
  (a JSON value, a repetition of itself) it could not tell where it ends, and is refused.
- JSON Schema, regex and grammar leaves are compiled as constraints of their own kinds
  (`leaf`) and become named sub-grammars, so JSON is laid out as for the json kind.
Each format becomes the expression for "this format, then `tail`" (the strings that must
follow), so that a text region can take the tail into its lazy lexeme.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from llmsvc.structured import errors as E
from llmsvc.structured.structural_tag_spec import (KIND, elements_field, fail, flag_field, is_int,
                                                   leading_string, string_field, strings_field, tag_parts)
from llmsvc.structured.vocabulary import Vocabulary, token_set

SUPPORTED = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "optional",
             "plus", "star", "repeat", "tag", "triggered_tags", "tags_with_separator")
_TEXT = "(?s:.*)"
# the tail of a format followed by something that is not a known string (a JSON value, a
# repetition of itself): free text there could not tell where it ends, so it is refused
UNKNOWN = ["\x00unknown"]


def grammar(text: str, vocab: Vocabulary, leaf: Callable[[str, Any], str]) -> str:
    """llguidance grammar (JSON) for the structural tag `text`; ConstraintError names the part
    at fault. `leaf(kind, value)` is the checked grammar text of a json / regex / grammar leaf."""
    tag = json.loads(text)  # StructuredOutputsParams.verify() has checked the outer shape
    if "structures" in tag:  # legacy: each structure is a tag whose content is its schema
        tags = [{"begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
                 "end": s.get("end")} if isinstance(s, dict) else s for s in tag["structures"]]
        fmt, path = {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}, "structures"
    else:
        fmt, path = tag["format"], "format"
    t = _Translator(vocab, leaf)
    start = t.format(fmt, path, tail=None, ends=[])
    return json.dumps({"grammars": [{"name": KIND, "lark_grammar": "\n".join([f"start: {start}", *t.lines])},
                                    *t.subgrammars]})


def _pieces(pieces: list) -> str:
    """Lark for Vocabulary.split's pieces in order: text as a string literal, a special token as `<[id]>`."""
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False) for p in pieces)


def _regex_escape(s: str) -> str:
    """`s` literally in a Lark /regex/ (Rust syntax): ASCII punctuation as \\x{..}, so neither
    a regex operator nor the closing slash."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):02X}}}" for c in s)


class _Translator:
    def __init__(self, vocab: Vocabulary, leaf) -> None:
        self.split, self.special_ids, self.spelling, self.leaf = vocab.split, vocab.special_ids, vocab.spelling, leaf
        self.lines: list[str] = []
        self.subgrammars: list[dict] = []
        self._names = 0

    def _name(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}{self._names}"

    def literal(self, s: str) -> str:
        """Lark for the exact string ("" for none): special tokens as tokens, the rest as text."""
        return _pieces(self.split(s))

    def tail_expr(self, tail: list[str] | None) -> str:
        """Lark for one of the `tail` strings ("" for none, and for UNKNOWN: its follower writes itself)."""
        if tail is UNKNOWN:
            return ""
        alts = sorted({self.literal(s) for s in tail or []} - {""})
        if not alts:
            return ""
        expr = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
        return f"({expr})?" if "" in tail else expr

    def text(self, excludes: list[str], tail: list[str] | None, path: str = "") -> str:
        """Free text, then one of `tail`. Free text is plain text and special tokens (a model's
        reply may hold some, as "<|tool_calls_section_end|>"), never holding an exclude. A special
        token that an exclude or a following string names is kept out of free text altogether,
        and so is one whose text holds a plain exclude (xgrammar reads tokens as their text); a
        special token's spelling in plain text is excluded where the token itself is."""
        if tail is UNKNOWN:
            raise fail(path, "free text must be followed by a string (a const_string, its tag's end "
                              "or a trigger) or end the output: what follows it here is not one")
        spelled = [self.split(s) for s in excludes if s]
        banned = {x for p in spelled + [self.split(s) for s in tail or []] for x in p if isinstance(x, int)}
        plain = {p[0] for p in spelled if len(p) == 1 and isinstance(p[0], str)}
        plain |= {self.spelling(t) for p in spelled for t in p if isinstance(t, int)}
        banned |= {t for t in self.special_ids if any(x in self.spelling(t) for x in plain)}
        plain = sorted(plain)
        term = self._name("T")
        body = f"/{_TEXT}/" + (f" & ~/{_TEXT}(?:{'|'.join(map(_regex_escape, plain))}){_TEXT}/" if plain else "")
        opt = self._name("t")
        self.lines += [f"{term}: {body}", f"{opt}: {term}"]
        allowed = [t for t in self.special_ids if t not in banned]
        special = ""
        if allowed:
            special = self._name("s")
            self.lines.append(f"{special}: {token_set(allowed)}")
        alts = []
        for s in tail if tail else [""]:
            pieces = self.split(s)
            if pieces and isinstance(pieces[0], str):  # text, then this string: one lazy lexeme
                head = self._name("h")
                self.lines.append(f"{head}[lazy]: {term} {json.dumps(pieces[0], ensure_ascii=False)}")
                alts.append(f"{f'({opt}? {special})* ' if special else ''}{head} {_pieces(pieces[1:])}".strip())
            else:  # nothing, or a special token, follows: text cannot run into it
                alts.append(f"{opt}? {f'({special} {opt}?)* ' if special else ''}{self.literal(s)}".strip())
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def format(self, f: Any, path: str, tail: list[str] | None, ends: list[str]) -> str:
        """Lark for format `f` followed by one of the `tail` strings; `ends`: the end strings of
        the nearest enclosing tag, which free text inside it never contains."""
        if not isinstance(f, dict):
            raise fail(path, f"must be a format object, got {type(f).__name__}")
        kind = f.get("type", "tag")  # a typeless object is a tag
        if kind not in SUPPORTED:
            raise fail(path, f"format type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
        return getattr(self, f"_{kind}")(f, path, tail, ends)

    def _then(self, expr: str, tail) -> str:
        return f"{expr} {self.tail_expr(tail)}".strip()

    def _const_string(self, f, path, tail, ends):
        return self._then(self.literal(string_field(f, "value", path, allow_empty=True)), tail)

    def _sub(self, kind: str, value: Any, path: str) -> str:
        try:
            text = self.leaf(kind, value)
        except E.ConstraintError as e:
            raise fail(path, e.message, e.reason) from None
        except ValueError as e:  # the leaf's own parameter check (SamplingParamsError)
            reason = E.INVALID_SCHEMA if kind == "json" else E.INVALID_GRAMMAR
            raise fail(path, str(e).removeprefix(f"structured_outputs.{kind} "), reason) from None
        # a leaf is llguidance's JSON form (one grammar), or Lark text as the grammar kind gives it
        entry = json.loads(text)["grammars"][0] if text.lstrip().startswith("{") else {"lark_grammar": text}
        entry["name"] = self._name("g")
        self.subgrammars.append(entry)
        return "@" + entry["name"]

    def _json_schema(self, f, path, tail, ends):
        if f.get("style", "json") != "json" or f.get("any_order"):
            raise fail(path, 'only "style": "json" with properties in order is supported')
        if "json_schema" not in f:
            raise fail(path, 'needs "json_schema"')
        schema = f["json_schema"]
        value = schema if isinstance(schema, dict) else json.dumps(schema)  # true / false / not a schema: as text
        return self._then(self._sub("json", value, path + ".json_schema"), tail)

    def _regex(self, f, path, tail, ends):
        return self._then(self._sub("regex", string_field(f, "pattern", path), path + ".pattern"), tail)

    def _grammar(self, f, path, tail, ends):
        return self._then(self._sub("grammar", string_field(f, "grammar", path), path + ".grammar"), tail)

    def _any_text(self, f, path, tail, ends):
        if f.get("max_tokens") is not None or f.get("max_chars") is not None:
            raise fail(path, "max_tokens and max_chars budgets are not supported")
        return self.text([x for x in strings_field(f, "excludes", path, []) if x] + ends, tail, path)

    def _sequence(self, f, path, tail, ends):
        elements = elements_field(f, path)
        out, i, n = [], 0, len(elements)
        while i < n:
            nxt = elements[i + 1] if i + 1 < n else None
            lead, rest = leading_string(nxt)
            if lead:
                # an element, then a string (a const_string, a tag's begin): the element takes it
                # as its tail (free text's lazy lexeme ends at it); the tag goes on after it
                out.append(self.format(elements[i], f"{path}.elements[{i}]", [lead], ends))
                if rest is not None:
                    out.append(self.format(rest, f"{path}.elements[{i + 1}]", tail if i + 2 == n else UNKNOWN, ends))
                i += 2
                if i == n and rest is None:
                    out.append(self.tail_expr(tail))
                continue
            out.append(self.format(elements[i], f"{path}.elements[{i}]", tail if i == n - 1 else UNKNOWN, ends))
            i += 1
        return " ".join(x for x in out if x)

    def _or(self, f, path, tail, ends):
        alts = [self.format(el, f"{path}.elements[{i}]", tail, ends) for i, el in enumerate(elements_field(f, path))]
        return "(" + " | ".join(alts) + ")"

    def _repeat_of(self, f, path, tail, ends, op):
        content = f.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text":  # any_text repeated is any_text
            return self.format(content, path + ".content", tail, ends)
        return self._then(f"({self.format(content, path + '.content', UNKNOWN, ends)}){op}", tail)

    def _optional(self, f, path, tail, ends):
        return self._repeat_of(f, path, tail, ends, "?")

    def _plus(self, f, path, tail, ends):
        return self._repeat_of(f, path, tail, ends, "+")

    def _star(self, f, path, tail, ends):
        return self._repeat_of(f, path, tail, ends, "*")

    def _repeat(self, f, path, tail, ends):
        lo, hi = f.get("min"), f.get("max")
        if not (is_int(lo) and is_int(hi) and lo >= 0 and (hi == -1 or hi >= lo)):
            raise fail(path, '"min" and "max" must be integers with 0 <= min <= max (max -1: no limit)')
        if hi == 0:  # never: only what follows
            return self.tail_expr(tail)
        return self._repeat_of(f, path, tail, ends, f"{{{lo},{'' if hi == -1 else hi}}}")

    def _tag(self, f, path, tail, ends):
        begin, end = tag_parts(f, path)
        content = self.format(f.get("content"), path + ".content", end, [e for e in end if e])
        return self._then(f"{self.literal(begin)} {content}".strip(), tail)

    def _tags(self, f, path) -> list[tuple[str, dict]]:
        tags = f.get("tags")
        if not isinstance(tags, list) or not tags:
            raise fail(path, 'needs a non-empty "tags" list')
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise fail(f"{path}.tags[{i}]", "must be a tag object")
        return [(f"{path}.tags[{i}]", t) for i, t in enumerate(tags)]

    def _triggered_tags(self, f, path, tail, ends):
        triggers = strings_field(f, "triggers", path, None)
        if not triggers or not all(triggers):
            raise fail(path, 'needs a non-empty "triggers" list of non-empty strings')
        at_least_one, stop_after_first = flag_field(f, "at_least_one", path), flag_field(f, "stop_after_first", path)
        tags = self._tags(f, path)
        # the whole tags, where one must come first (no text before it)
        any_tag = "(" + " | ".join(self.format(t, p, None, ends) for p, t in tags) + ")" if at_least_one else ""
        if at_least_one and stop_after_first:  # exactly one tag, no text around it
            return self._then(any_tag, tail)
        groups: dict[str, list[str]] = {t: [] for t in triggers}  # trigger -> the rest of its tags
        for p, t in tags:
            begin, _ = tag_parts(t, p)
            matching = [tr for tr in triggers if begin.startswith(tr)]
            if len(matching) != 1:
                raise fail(p, f"begin {begin!r} must start with exactly one trigger, not {len(matching)}")
            groups[matching[0]].append(self.format(dict(t, begin=begin[len(matching[0]):]), p, None, ends))
        excludes = triggers + strings_field(f, "excludes", path, []) + ends
        dispatch = "(" + " | ".join(f"{self.text(excludes, [tr], path)} ({' | '.join(groups[tr])})"
                                    for tr in triggers if groups[tr]) + ")"
        rest = self.text(excludes, tail, path)
        if stop_after_first:  # text, and at most one tag to end it
            return f"({rest} | {self._then(dispatch, tail)})"
        return f"{any_tag} {dispatch}* {rest}".strip()

    def _tags_with_separator(self, f, path, tail, ends):
        sep = string_field(f, "separator", path, allow_empty=True)
        one = "(" + " | ".join(self.format(t, p, None, ends) for p, t in self._tags(f, path)) + ")"
        if flag_field(f, "stop_after_first", path):
            body = one
        else:
            body = f"{one} ({self.literal(sep) if sep else ''} {one})*"
        if not flag_field(f, "at_least_one", path):
            body = f"({body})?"
        return self._then(body, tail)
