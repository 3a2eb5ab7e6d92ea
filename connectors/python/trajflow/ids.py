"""Deterministic record ids and trace context of schemas/ids.go and
operators/stagekit, and Go-compatible JSON."""

from __future__ import annotations

import hashlib
import json

ID_DOMAIN = "trajflow/id/v1"


def make_id(kind: str, *parts: str) -> str:
    h = hashlib.sha256()
    for s in (ID_DOMAIN, kind) + parts:
        b = s.encode()
        h.update(str(len(b)).encode() + b":" + b)
    return h.hexdigest()[:32]


def derived_id(stage: str, parent: str) -> str:
    """schemas.DerivedID."""
    return make_id("derived", stage, parent)


def batch_id(run_id: str, index: int) -> str:
    """schemas.BatchID."""
    return make_id("batch", run_id, str(int(index)))


def _trace(trace_id: str, span_id: str) -> str:
    span = derived_id("trace", span_id)[:16]
    trace = trace_id if len(trace_id) == 32 else derived_id("trace", trace_id)
    return f"00-{trace}-{span}-01"


def traceparent(record_id: str) -> str:
    """stagekit.TraceParent: the trace of the record id itself."""
    return _trace(record_id, record_id)


def headers(kind: str, record_id: str, version: int = 1, trace: str | None = None) -> list[tuple[str, bytes]]:
    """stagekit.Headers: kind, version, id and traceparent."""
    return [("trajflow-kind", kind.encode()), ("trajflow-version", str(version).encode()),
            ("trajflow-id", record_id.encode()), ("traceparent", (trace or traceparent(record_id)).encode())]


def go_json(obj, indent: str | None = None) -> bytes:
    """JSON as Go's encoding/json writes it: no spaces (or MarshalIndent
    with indent), non-ASCII as UTF-8, and <, >, &, U+2028, U+2029 escaped."""
    if indent is None:
        s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    else:
        s = json.dumps(obj, ensure_ascii=False, indent=len(indent), allow_nan=False)
    for a, b in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(a, b)
    return s.encode()


CENSUS_FIELDS = [("event_id", False), ("run_id", False), ("attempt_id", False), ("task_id", True),
                 ("group_id", True), ("kind", False), ("stage", False), ("reason", True), ("infra", True),
                 ("batch_id", True), ("update", True), ("policy_version", True), ("tokens", True),
                 ("stale_tokens", True), ("reward", True), ("latency_us", True), ("at_us", False)]


def census_record(ev: dict) -> tuple[bytes, bytes, list]:
    """(key, value, headers) of a census event as stagekit.Census builds
    it: event id derived from (kind, stage, reason, attempt), fields in
    schemas/censusjson.go order with omitempty, keyed by attempt id, in the
    attempt's trace."""
    ev = dict(ev)
    if not ev.get("event_id"):
        ev["event_id"] = derived_id(f"census/{ev['kind']}/{ev['stage']}/{ev.get('reason', '')}", ev["attempt_id"])
    data = {}
    for k, omit in CENSUS_FIELDS:
        v = ev.get(k, "" if k in ("task_id", "group_id", "reason", "batch_id") else 0)
        if omit and not v:
            continue
        data[k] = v
    body = go_json({"kind": "census_event", "version": 1, "data": data})
    trace = _trace(ev["attempt_id"], ev["event_id"]) if ev["attempt_id"] else traceparent(ev["event_id"])
    return ev["attempt_id"].encode(), body, headers("census_event", ev["event_id"], trace=trace)


def incident_record(inc: dict) -> tuple[bytes, bytes, list]:
    """stagekit.IncidentOutput: the incident document (schemas.Incident in
    the {"kind","version","data"} envelope), keyed by attempt id, with the
    standard headers in the attempt's trace."""
    inc = dict(inc)
    if not inc.get("incident_id"):
        inc["incident_id"] = derived_id(f"incident/{inc['stage']}/{inc['reason']}", inc["attempt_id"])
    order = ["incident_id", "run_id", "attempt_id", "task_id", "stage", "reason", "detail", "source", "at_us"]
    data = {k: inc.get(k, "" if k != "at_us" else 0) for k in order}
    body = go_json({"kind": "incident", "version": 1, "data": data})
    return inc["attempt_id"].encode(), body, headers("incident", inc["incident_id"], trace=traceparent(inc["attempt_id"]))


def update_document(rec: dict) -> bytes:
    """The update record document (schemas.UpdateRecord in the envelope)."""
    return go_json({"kind": "update_record", "version": 1, "data": rec}, indent="  ")


def read_update_document(b: bytes) -> dict:
    """The update record of a document written by update_document or by the
    Go train stage (schemas.EncodeUpdate); kind and version are checked."""
    doc = json.loads(b)
    if doc.get("kind") != "update_record" or doc.get("version") != 1 or "data" not in doc:
        raise ValueError(f"not an update_record v1 document (kind {doc.get('kind')!r}, version {doc.get('version')!r})")
    return doc["data"]
