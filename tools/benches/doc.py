"""docs/BENCHMARKS.md's generated sections: each benchmark's between
its own pair of markers,

    <!-- bench NAME: begin -->
    ...
    <!-- bench NAME: end -->

rewritten by every run of it; everything outside the markers is written
by people and left alone.
"""
import re

MARKER = re.compile(r"<!-- bench ([\w-]+): (begin|end) -->")


class MarkerError(Exception):
    """A document's markers are not in begin/end pairs, one per name."""


def begin(name):
    return f"<!-- bench {name}: begin -->"


def end(name):
    return f"<!-- bench {name}: end -->"


def sections(text):
    """{name: (start of the begin marker, end of the end marker)} of every
    marker pair in text; MarkerError where they do not pair up."""
    found, open_name, start = {}, None, 0
    for m in MARKER.finditer(text):
        name, which = m.groups()
        if which == "begin":
            if open_name is not None:
                raise MarkerError(f"{begin(name)} inside the section of {open_name}")
            if name in found:
                raise MarkerError(f"a second section of {name}")
            open_name, start = name, m.start()
        else:
            if open_name != name:
                raise MarkerError(f"{end(name)} without its begin marker")
            found[name] = (start, m.end())
            open_name = None
    if open_name is not None:
        raise MarkerError(f"{begin(open_name)} without its end marker")
    return found


def replace(text, name, body, title=None):
    """text with name's section holding body. Without a section of that
    name, one is added at the end under a heading `## title`
    (MarkerError if no title is given)."""
    block = f"{begin(name)}\n{body.strip()}\n{end(name)}"
    where = sections(text).get(name)
    if where is None:
        if title is None:
            raise MarkerError(f"no section of {name}")
        return text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    return text[:where[0]] + block + text[where[1]:]


def markdown_body(text):
    """A benchmark's printed detail made fit for a section: its headings
    made bold paragraphs (the document's own headings stay its own), a
    blank line on either side of each table."""
    keep = []
    for line in text.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = f"**{line.lstrip('# ').strip()}**"
        if line and keep and keep[-1] != "" and line.startswith("|") != keep[-1].startswith("|"):
            keep.append("")
        if line or (keep and keep[-1] != ""):
            keep.append(line)
    return "\n".join(keep).strip()
