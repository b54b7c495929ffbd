"""The JSON text of a sample's token ids or log-probs (an ``array``), for the journal and the
checkpoint's ``controller.json``.

WHY not ``json.dumps(values.tolist())``: the standard encoder writes each float through
``float.__repr__``, about 0.7 us a log-probability, so a finished 3K-token sample cost the
journal's writer thread ~2 ms of CPU, the largest share of the controller's CPU per sample at
reasoning lengths (``docs/results/controller_scale.md``), and one such call holds the GIL, so the
event loop, for as long. orjson writes the same numbers ~15x faster. The values read back are the
same doubles (both write the shortest text that reads back as the same double; orjson may spell an
exponent differently, ``1e-05`` as ``1e-5``). orjson writes NaN and infinities as ``null``, which
would not read back: an array holding one is written by ``json.dumps`` (``NaN``, ``-Infinity``), as
before.
"""

from __future__ import annotations

import json
from array import array

import numpy as np
import orjson

_FLOATS = {"f": np.float32, "d": np.float64}


def array_json(values: array[int] | array[float]) -> bytes:
    """``values`` as a JSON list with ``json.dumps``' separators (``", "``), read back as
    ``json.loads(json.dumps(values.tolist()))`` would be."""
    items = values.tolist()
    dtype = _FLOATS.get(values.typecode)
    if dtype is not None and len(values) and not np.isfinite(np.frombuffer(values, dtype=dtype)).all():
        return json.dumps(items).encode()
    # a list of numbers holds no string: every comma is a separator
    return orjson.dumps(items).replace(b",", b", ")
