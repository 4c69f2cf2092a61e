"""``builtin:mixed``: a heterogeneous built-in corpus made of several kinds of text on this machine.

DiPaCo's routing pays only when the data has structure to find, so this corpus mixes distinct
kinds of text that a fresh Linux machine (or our own Python) already holds, downloading nothing:

- ``python``: the standard library's ``.py`` sources;
- ``c``: C headers under ``/usr/include``;
- ``man``: English manual pages (``/usr/share/man/man[1-8]``), roff turned into plain text;
- ``man-intl``: translated manual pages (``/usr/share/man/<lang>/``);
- ``messages``: gettext catalogues (``/usr/share/locale/*/LC_MESSAGES/*.mo``), one text per
  (language, domain) made of its translated strings;
- ``licenses``: ``/usr/share/common-licenses/*`` and ``/usr/share/doc/*/copyright``.

Each kind fills a budget of ``KIND_BUDGET_CHARS`` characters, taking files in an order fixed by
a salted hash of their relative path (so a budget samples the whole set, not its first folder).
Symlinks, files over ``MAX_FILE_BYTES``, repeated texts and unreadable files are skipped. Texts
are cut by ``split_text``; ids are ``<kind>/<relative path>#<piece>``, and the final order sorts
by a hash of the id, so kinds interleave. A kind whose files are missing is absent; fewer than
three kinds is a ``DataError``. Same files on disk, same documents in the same order.
"""

from __future__ import annotations

import bz2
import functools
import gettext
import gzip
import hashlib
import logging
import lzma
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dipaco.data.corpus import split_text, stdlib_files, stdlib_root
from dipaco.data.document import Document
from dipaco.errors import DataError

log = logging.getLogger(__name__)

KIND_BUDGET_CHARS = 12_000_000  # characters of documents per kind
MAX_FILE_BYTES = 1_000_000  # larger files are skipped
MAX_GROUP_SHARE = 0.1  # of a kind's budget, for one family of files (see _group)
MIN_KINDS = 3
ORDER_SALT = "dipaco-mixed-v1"

# The folders read; module-level so a test (or an unusual machine) can point them elsewhere.
PYTHON_ROOT: Path = stdlib_root()
C_ROOT = Path("/usr/include")
MAN_ROOT = Path("/usr/share/man")
LOCALE_ROOT = Path("/usr/share/locale")
LICENSE_ROOTS: tuple[tuple[Path, str], ...] = (  # (folder, glob pattern)
    (Path("/usr/share/common-licenses"), "*"),
    (Path("/usr/share/doc"), "*/copyright"),
)

KINDS = ("python", "c", "man", "man-intl", "messages", "licenses")
_DECOMPRESS: dict[str, Callable[[bytes], bytes]] = {
    ".gz": gzip.decompress,
    ".bz2": bz2.decompress,
    ".xz": lzma.decompress,
}
_ENGLISH_MAN = re.compile(r"man[1-8]")


def source_kind(doc_id: str) -> str:
    """The kind of text a document id names: the part before its first ``/``.

    ``man-intl/de/...`` is ``man-intl``; the stdlib corpus gives ``stdlib`` and ``pydoc``; an
    id without a ``/`` is ``other``.
    """
    kind, sep, _ = doc_id.partition("/")
    return kind if sep else "other"


# --- roff to text ------------------------------------------------------------------------------

_GLYPHS = {
    "em": "—", "en": "–", "hy": "-", "mi": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "bu": "•", "co": "©", "rg": "®", "tm": "™", "mu": "×", "di": "÷",
    "de": "°", "ga": "`", "aa": "´", "ha": "^", "ti": "~", "rs": "\\", "sl": "/", "ba": "|",
    "br": "|", "or": "|", "ul": "_", "ru": "_", "->": "→", "<-": "←", "<=": "≤", ">=": "≥",
    "!=": "≠", "+-": "±", "pl": "+", "eq": "=", "sc": "§", "dg": "†", "Fo": "«", "Fc": "»",
    "lB": "[", "rB": "]", "lC": "{", "rC": "}", "la": "⟨", "ra": "⟩", "at": "@", "sh": "#",
    "Do": "$", "Eu": "€", "rA": "⇒", "ua": "↑", "da": "↓", "ss": "ß", "R": "®", "Tm": "™", "Aq": "'",
}  # fmt: skip
# \(:u is ü: an accent mark and a letter, composed.
_ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", ",": "\u0327", "o": "\u030a", "v": "\u030c"}  # fmt: skip
_CHARS = {"-": "-", "e": "\\", "\\": "\\", "~": " ", " ": " ", "0": " ", "t": "\t", "'": "´"}
_SILENT = set("&|^%:c)/,{}!?")
_ESCAPE = re.compile(
    r"""\\(?:
      ".*                                            # comment to the end of the line
    | f(?:\[[^\]\n]*\]|\(..|.)                       # font change
    | s[-+]?(?:\(\d\d|\[[^\]\n]*\]|\d)               # type size
    | \((?P<g2>..) | \[(?P<gn>[^\]\n]*)\]            # named glyph
    | \*(?:\((?P<s2>..)|\[(?P<sn>[^\]\n]*)\]|(?P<s1>.))  # string
    | [nFgmMVY$k](?:\(..|\[[^\]\n]*\]|.)             # registers, colours, ...
    | [hvwlLoXNDbzHSxRABZ]'[^'\n]*'                  # escapes with a quoted argument
    | (?P<ch>.)
    )""",
    re.VERBOSE,
)
_REQUEST = re.compile(r"[.'][ \t]*(\S*)[ \t]*(.*)")
_ARG = re.compile(r'"((?:[^"]|"")*)"?|((?:\\.|\S)+)')
_HEADINGS = frozenset({"SH", "SS", "Sh", "Ss"})
_PARAGRAPHS = frozenset({"PP", "P", "LP", "TP", "TQ", "HP", "Pp", "Lp", "sp", "IP", "It"})
_ALTERNATING = frozenset({"BR", "RB", "IR", "RI", "BI", "IB"})
_DROPPED = frozenset(
    "TH RS RE EE EX TE TS UE ME YS DT PD AT UC IX Sm Dd Dt Os Bl El Bd Ed Bf Ef Bk Ek Rs Re".split()
)
_MDOC_CALLS = frozenset("Ar Cm Ic Li Nm No Ns Op Oo Oc Pa Va Ev Dv Em Sy Dq Sq Pq Ql Xo Xc".split())


def _escape(match: re.Match[str]) -> str:
    glyph = match["g2"] or match["gn"] or match["s2"] or match["sn"] or match["s1"]
    if glyph is not None:
        if glyph.startswith("u") and len(glyph) >= 5:
            try:
                return chr(int(glyph[1:].split("_")[0], 16))
            except ValueError:
                return ""
        if len(glyph) == 2 and glyph[0] in _ACCENTS and glyph[1].isalpha():
            return unicodedata.normalize("NFC", glyph[1] + _ACCENTS[glyph[0]])
        return _GLYPHS.get(glyph, "")
    ch = match["ch"]
    if ch is None or ch in _SILENT:
        return ""
    return _CHARS.get(ch, ch)


def _args(rest: str) -> list[str]:
    return [
        _ESCAPE.sub(_escape, q.replace('""', '"') if q is not None and w == "" else w)
        for q, w in _ARG.findall(rest)
    ]


def _mdoc_words(args: list[str]) -> str:
    words: list[str] = []
    dash = False
    for arg in args:
        if arg == "Fl":
            dash = True
        elif arg not in _MDOC_CALLS:
            words.append("-" + arg if dash else arg)
            dash = False
    return " ".join(words + (["-"] if dash else []))


def roff_to_text(src: str) -> str:
    """Plain, readable text from a man page's roff (man or mdoc macros); not a typesetter."""
    out: list[str] = []
    skip_to: str | None = None
    name_of_page = ""  # mdoc's .Nm with no argument repeats the page's name
    for line in src.replace("\\\n", "").splitlines():
        if skip_to is not None:
            if line.startswith(skip_to) or (skip_to == "." and line.rstrip().endswith(".")):
                skip_to = None
            continue
        if line[:1] not in (".", "'"):
            out.append(_ESCAPE.sub(_escape, line))
            continue
        match = _REQUEST.match(line)
        name, rest = (match[1], match[2]) if match else ("", "")
        if name.startswith("\\") or not name or name in _DROPPED:
            continue
        if name in ("de", "am", "ig"):
            skip_to = ".."  # a macro definition or a block comment
        elif name == "TS":
            skip_to = "."  # a table's options and format lines end at a line ending with "."
        elif name in _HEADINGS:
            out += ["", " ".join(_args(rest)), ""] if rest else [""]
        elif name in _PARAGRAPHS:
            out.append("")
            if name in ("IP", "It") and rest:
                out.append(_mdoc_words(_args(rest)) if name == "It" else _args(rest)[0])
        elif name in _ALTERNATING:
            out.append("".join(_args(rest)))
        elif name == "Nm":
            name_of_page = name_of_page or " ".join(_args(rest))
            out.append(_mdoc_words(_args(rest)) if rest else name_of_page)
        elif name == "Xr":
            args = _args(rest)
            out.append(f"{args[0]}({args[1]})" + "".join(args[2:]) if len(args) > 1 else rest)
        elif name == "Fl" or (name[0].isupper() and rest):
            out.append(_mdoc_words([name, *_args(rest)] if name == "Fl" else _args(rest)))
        # every other request (lowercase troff primitives, empty macros) is dropped
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


# --- gettext catalogues ------------------------------------------------------------------------


def catalogue_text(path: Path) -> str:
    """The translated strings of a ``.mo`` catalogue, one per line, header left out."""
    with open(path, "rb") as f:
        catalog: dict[object, str] = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
    # Plural translations have keys (msgid, n): each form is a string of its own.
    return "\n".join(value for key, value in catalog.items() if key != "" and value.strip())


# --- the sources -------------------------------------------------------------------------------


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if not p.is_symlink()) if root.is_dir() else []


def _candidates(kind: str) -> tuple[list[tuple[str, Path]], list[Path]]:
    """``(relative name, file)`` pairs of a kind, and the folders looked at."""
    if kind == "python":
        return [(p.relative_to(PYTHON_ROOT).as_posix(), p) for p in stdlib_files(PYTHON_ROOT)], [
            PYTHON_ROOT
        ]
    if kind == "c":
        return [(p.relative_to(C_ROOT).as_posix(), p) for p in _files(C_ROOT, "**/*.h")], [C_ROOT]
    if kind == "messages":
        return [
            (f"{p.parent.parent.name}/{p.stem}", p)
            for p in _files(LOCALE_ROOT, "*/LC_MESSAGES/*.mo")
            if not p.stem.startswith("iso_")
        ], [LOCALE_ROOT]
    if kind == "licenses":
        pairs = [
            (f"{root.name}/{p.relative_to(root).as_posix()}", p)
            for root, pattern in LICENSE_ROOTS
            for p in _files(root, pattern)
            if p.is_file()
        ]
        return pairs, [root for root, _ in LICENSE_ROOTS]
    langs = sorted(d.name for d in MAN_ROOT.iterdir() if d.is_dir()) if MAN_ROOT.is_dir() else []
    if kind == "man":
        dirs = [d for d in langs if _ENGLISH_MAN.fullmatch(d)]
    else:
        dirs = [f"{d}/man[1-8]" for d in langs if not d.startswith("man")]
    pairs = [
        (p.relative_to(MAN_ROOT).as_posix(), p) for d in dirs for p in _files(MAN_ROOT, f"{d}/*")
    ]
    return pairs, [MAN_ROOT]


def _read(kind: str, path: Path) -> str:
    if kind == "messages":
        return catalogue_text(path)
    data = path.read_bytes()
    if kind.startswith("man"):
        data = _DECOMPRESS.get(path.suffix, bytes)(data)
        return roff_to_text(data.decode("utf-8", errors="replace"))
    return data.decode("utf-8", errors="replace")


def _hash_order(kind: str, pairs: Iterable[tuple[str, Path]]) -> list[tuple[str, Path]]:
    def key(pair: tuple[str, Path]) -> tuple[bytes, str]:
        return hashlib.sha256(f"{ORDER_SALT}:{kind}/{pair[0]}".encode()).digest(), pair[0]

    return sorted(sorted(pairs), key=key)


def _group(kind: str, rel: str) -> str | None:
    """The family a file belongs to, for ``MAX_GROUP_SHARE``; None: not capped."""
    if kind.startswith("man"):  # gcloud_*, git-*, ...: one generator can ship thousands of pages
        return re.split(r"[-_.]", rel.rsplit("/", 1)[-1], maxsplit=1)[0]
    if kind == "c" and "/" in rel:  # llvm-14/, linux/, node/, ...
        return rel.split("/", 1)[0]
    return None


def _kind_documents(kind: str, budget: int) -> Iterator[Document]:
    pairs, _ = _candidates(kind)
    seen: set[str] = set()
    groups: dict[str | None, int] = {}
    used = skipped_big = skipped_bad = repeated = capped = 0
    for rel, path in _hash_order(kind, pairs):
        if used >= budget:
            break
        group = _group(kind, rel)
        if group is not None and groups.get(group, 0) >= MAX_GROUP_SHARE * budget:
            capped += 1
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                skipped_big += 1
                continue
            real = os.path.realpath(path)
            text = "" if real in seen else _read(kind, path)
        except Exception:  # unreadable, corrupt or unparsable: skipped, counted
            skipped_bad += 1
            continue
        digest = hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()
        if real in seen or digest in seen:
            repeated += 1
            continue
        seen.update((real, digest))
        for i, piece in enumerate(split_text(text)):
            used += len(piece)
            groups[group] = groups.get(group, 0) + len(piece)
            yield Document(f"{kind}/{rel}#{i}", piece)
    log.debug(
        "builtin:mixed %s: %d chars; skipped %d large, %d unreadable, %d repeated, %d capped files",
        *(kind, used, skipped_big, skipped_bad, repeated, capped),
    )


def build_mixed_corpus(budget_chars: int = KIND_BUDGET_CHARS) -> list[Document]:
    """Build the whole mixed corpus from the folders named above (uncached)."""
    docs = [doc for kind in KINDS for doc in _kind_documents(kind, budget_chars)]
    found = sorted({source_kind(d.doc_id) for d in docs}, key=KINDS.index)
    if len(found) < MIN_KINDS:
        looked = sorted({str(p) for kind in KINDS for p in _candidates(kind)[1]})
        raise DataError(
            f"builtin:mixed needs at least {MIN_KINDS} kinds of text, found "
            f"{len(found)} ({', '.join(found) or 'none'}); looked in {', '.join(looked)}"
        )
    docs.sort(key=lambda d: hashlib.sha256(d.doc_id.encode()).digest())
    comp = mixed_composition(docs)
    log.info(
        "builtin:mixed: %d documents; %s",
        len(docs),
        ", ".join(
            f"{k} {v['documents']} docs / {v['characters']:,} chars" for k, v in comp.items()
        ),
    )
    return docs


@functools.lru_cache(maxsize=2)
def _full_mixed(budget_chars: int) -> tuple[Document, ...]:
    return tuple(build_mixed_corpus(budget_chars))


def mixed_corpus(
    max_docs: int | None = None, budget_chars: int = KIND_BUDGET_CHARS
) -> list[Document]:
    """The mixed corpus in its fixed order; ``max_docs`` takes an even spread over all of it.
    ``budget_chars``: characters of each kind (``builtin:mixed:N`` asks for N million: larger
    paths need a larger corpus; a kind the machine has less of gives what it has)."""
    docs = _full_mixed(budget_chars)
    if max_docs is None or max_docs >= len(docs):
        return list(docs)
    return [docs[i * len(docs) // max_docs] for i in range(max_docs)]


def mixed_composition(docs: Iterable[Document]) -> dict[str, dict]:
    """Per kind (in ``KINDS`` order, others after): its documents and characters."""
    comp: dict[str, dict] = {}
    for doc in docs:
        entry = comp.setdefault(source_kind(doc.doc_id), {"documents": 0, "characters": 0})
        entry["documents"] += 1
        entry["characters"] += len(doc.text)
    order = {k: i for i, k in enumerate(KINDS)}
    return {k: comp[k] for k in sorted(comp, key=lambda k: (order.get(k, len(KINDS)), k))}
