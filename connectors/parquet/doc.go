// Package parquet writes a run's topics to Parquet snapshots and reads them
// back, verified, for replay, the attempt census and analysts (pipeline
// document §1: every model score must be traceable back through each arrow).
//
// # Layout
//
// Files are partitioned Hive-style so that pyarrow datasets and DuckDB read
// one topic of a whole run with one glob:
//
//	DIR/run=<run>/topic=<short topic>/partition=<p>/<first>-<last>.parquet
//	DIR/run=<run>/topic=<short topic>/partition=<p>/_<first>-<last>.parquet.sha256
//	DIR/run=<run>/contract.yaml   the resolved learning contract
//	DIR/run=<run>/run.json        RunInfo: contract hash, vocabulary size, writer
//
// <first> and <last> are the first and last Kafka offsets the file holds,
// zero-padded to 20 digits so that names sort in offset order. The
// .sha256 sidecar holds the hex sha256 of the whole Parquet file: any
// changed byte of a snapshot is detected before it is decoded.
//
// An entry named like a snapshot file that is not a regular file (a
// named pipe, a device, a symbolic link that does not resolve to a
// regular file inside its run directory), or a file under a directory
// that is not partition=<number>, is listed damaged (File.Err) and never
// opened; readers report it as they report a file that does not verify.
// No file is read past the size it had when opened (ReadRegular).
//
// # Data plane and control plane
//
// Data-plane topics (tasks, trajectories, valid, rewarded, scored,
// batches) carry Arrow IPC streams. Their files are written with pqarrow
// from the record batches themselves, with the Arrow schema stored in the
// file (pyarrow reads int32 token lists as int32 and the action mask as
// list<uint8>), zstd, and no dictionary encoding on list columns. Every row
// carries the lineage columns _offset, _key, _headers, _time_us and
// _sha256 (the sha256 of the Kafka value of the message the row came
// from). Replay re-encodes the rows of each message with the schemas
// codecs and checks that sha256: the snapshot reproduces every message
// byte for byte.
//
// Control-plane topics (census, incidents, policy, windows, quarantine)
// are written with parquet-go's generic struct writer: typed columns for
// analysts, plus the raw value (_value) that replay re-emits. They share
// one row type (ControlRow), so a column a topic's documents do not have
// reads as its zero value (0, "", false), never null: query one topic's
// directory with that topic's columns (the census's reward is 0 in every
// row; the rewards are on the rewarded topic), or parse _value, the
// document itself.
//
// # Lineage
//
// Each file's Parquet key-value metadata (keys Meta*) records the topic,
// the partition, the first and last offsets, the message count, the schema
// kind and version, the contract hash, the writer version and the sha256
// of the messages it holds (offset, key, headers, time and value of each,
// in offset order). Messages of a data-plane topic that do not decode as
// the topic's kind are kept whole in the metadata (MetaRaw), so offsets
// stay contiguous.
//
// # Durability
//
// A file is written to a temporary name in its own directory, fsynced,
// its sidecar written the same way, both renamed into place and the
// directory fsynced: a crash never leaves a file that readers would take as
// whole. The snapshot stage holds its inputs until the file holding them is
// durable, so the consumer group's committed offset never passes data that
// is not on disk; at start it skips offsets already written, so a restart
// after SIGKILL writes no duplicates and leaves offsets contiguous.
package parquet
