"""AckProducer compresses the topics the contract's topics.compression
names, and only those: the record batches in the broker's log carry the
codec, and consumers read the same bytes."""

import pathlib
import struct
import subprocess

import pytest

from conftest import ROOT
from fleet import Procs, start_broker
from trajflow.kafka import AckProducer, scan

RUN = "comp"
# Kafka's codec ids (record batch attributes & 7).
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def batch_codecs(segment: pathlib.Path) -> list:
    """The codec of every record batch of a segment file of the embedded
    broker's log (record batches back to back, Kafka's wire format)."""
    raw = segment.read_bytes()
    out, pos = [], 0
    while pos + 23 <= len(raw):
        length = struct.unpack(">i", raw[pos + 8:pos + 12])[0]
        attributes = struct.unpack(">h", raw[pos + 21:pos + 23])[0]
        out.append(attributes & 7)
        pos += 12 + length
    return out


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_producer_compresses_the_topics_configured(tf_bin, tmp_path, codec):
    procs = Procs(str(tmp_path))
    log = tmp_path / "log"
    try:
        broker = start_broker(procs, tf_bin, "--data", str(log))
        src = (ROOT / "testdata" / "contracts" / "demo.yaml").read_text().replace("run_id: demo", f"run_id: {RUN}")
        cp = tmp_path / "c.yaml"
        cp.write_text(src)
        subprocess.run([tf_bin, "topics", "create", "--brokers", broker, "--contract", str(cp)], check=True,
                       capture_output=True, timeout=60)
        p = AckProducer(broker, compression={f"{RUN}.census": codec})
        values = [(b"event %d; " % i) * 400 for i in range(20)]
        p.send([(f"{RUN}.census", b"k", v, []) for v in values] + [(f"{RUN}.incidents", b"k", v, []) for v in values])
        p.close()
        for short in ("census", "incidents"):
            got = []
            scan(broker, f"{RUN}.{short}", got.append)
            assert sorted(m.value for m in got) == sorted(values), short
    finally:
        procs.stop()
    codecs = {}
    for short in ("census", "incidents"):
        segs = sorted(log.glob(f"partitions/{RUN}.{short}-*/*.dat"))
        assert segs, f"no segment of {RUN}.{short} under {log}"
        codecs[short] = {c for s in segs for c in batch_codecs(s)}
    assert codecs == {"census": {CODEC_IDS[codec]}, "incidents": {0}}


def test_unknown_codec_refused():
    with pytest.raises(ValueError, match="brotli"):
        AckProducer("127.0.0.1:1", compression={"x.census": "brotli"})
