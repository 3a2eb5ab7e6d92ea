"""Text forms of Go's strconv that trajflow's identifiers hash.

The identifiers of the Go side (sampler ids, contract hashes) are SHA-256 of
text written with Go's ``strconv.FormatFloat(f, 'g', -1, 64)``,
``strconv.Itoa`` and ``strconv.Quote``; these functions write the same bytes.
"""

from __future__ import annotations

import hashlib
import math
from decimal import Decimal


def format_float_g(f: float) -> str:
    """Go's ``strconv.FormatFloat(f, 'g', -1, 64)``: the shortest decimal
    that round-trips; %e form (at least two exponent digits) when the decimal
    exponent is < -4 or >= 6, so 1e6 is "1e+06", 123456.0 is "123456" and
    1e-06 is "1e-06"."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "-0" if math.copysign(1.0, f) < 0 else "0"
    out = "-" if f < 0 else ""
    _, digits, exponent = Decimal(repr(abs(f))).as_tuple()
    ds = "".join(map(str, digits))
    dp = len(ds) + exponent  # value = 0.ds * 10**dp
    stripped = ds.lstrip("0")
    dp -= len(ds) - len(stripped)
    ds = stripped.rstrip("0")
    nd, exp = len(ds), dp - 1
    if exp < -4 or exp >= 6:
        out += ds[0] + ("." + ds[1:] if nd > 1 else "")
        return out + "e" + ("-" if exp < 0 else "+") + "%02d" % abs(exp)
    if dp <= 0:
        return out + "0." + "0" * (-dp) + ds
    if dp >= nd:
        return out + ds + "0" * (dp - nd)
    return out + ds[:dp] + "." + ds[dp:]


_ESC = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t", "\v": r"\v",
        "\\": "\\\\", '"': '\\"'}


def quote(s: str) -> str:
    """Go's ``strconv.Quote`` for the strings a contract holds: printable
    characters as they are, the C escapes, other control characters as
    \\xNN, and other non-printable runes as \\uNNNN or \\UNNNNNNNN."""
    out = ['"']
    for ch in s:
        if ch in _ESC:
            out.append(_ESC[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append("\\x%02x" % ord(ch))
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x10000:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append("\\U%08x" % ord(ch))
    out.append('"')
    return "".join(out)


def hash_strings(*parts: str) -> str:
    """gpu/model's hashStrings: "sha256:<hex>" of len(p) ':' p for every part."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode()
        h.update(str(len(b)).encode())
        h.update(b":")
        h.update(b)
    return "sha256:" + h.hexdigest()
