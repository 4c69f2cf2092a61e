"""Loading a saved router of either kind by the ``format`` field of its JSON."""

from __future__ import annotations

import os

from dipaco.errors import CorruptFileError
from dipaco.routing import discriminative, kmeans
from dipaco.routing.discriminative import LogisticRouter
from dipaco.routing.kmeans import KMeansRouter
from dipaco.routing.saved import parse_router, read_router_json

Router = KMeansRouter | LogisticRouter

_PARSERS = {
    kmeans.FORMAT: KMeansRouter._from_json_dict,
    discriminative.FORMAT: LogisticRouter._from_json_dict,
}


def load_router(path: str | os.PathLike[str]) -> Router:
    """A KMeansRouter or LogisticRouter, whichever the file holds.

    DataError if the file is missing; CorruptFileError if it is not JSON, names an unknown
    format, or fails the router's validation.
    """
    obj = read_router_json(path)
    fmt = obj.get("format") if isinstance(obj, dict) else None
    parse = _PARSERS.get(fmt) if isinstance(fmt, str) else None
    if parse is None:
        raise CorruptFileError(
            f"router file {path} has unknown format {fmt!r}; expected one of {sorted(_PARSERS)}"
        )
    return parse_router(path, obj, parse)
