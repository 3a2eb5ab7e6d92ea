// Package schemas defines every record kind of trajflow: its Go row type
// (types.go), its Arrow schema and codec (one file per kind), the JSON
// documents of the control plane and the Kafka headers.
//
// Data-plane kinds travel as one Arrow IPC stream per message (schema with
// MetaKind/MetaVersion metadata, one record batch, end-of-stream marker):
//
//	TaskAttempts          *Codec[TaskAttempt]      task.go
//	Trajectories          *Codec[Trajectory]       trajectory.go
//	RewardComponents      *Codec[RewardComponent]  reward.go
//	RewardedTrajectories  *Codec[Rewarded]         rewarded.go
//	ScoredTrajectories    *Codec[Scored]           scored.go
//	PackedBatches         *PackedBatchCodec        packed.go
//
// The Arrow schema of a kind is derived from its row type, one column per
// field:
//
//   - the column name is the field's json tag; an embedded struct
//     contributes its columns in place (Rewarded = Trajectory's columns,
//     then its own), as encoding/json does;
//   - int32, int64, float32, float64, uint8 map to the Arrow primitive of
//     the same width, bool to boolean, string to utf8;
//   - a nested struct maps to struct<...> of its own columns;
//   - []E maps to list<E> with non-nullable elements. Lists are not
//     nullable except ref_logprobs (nullableLists, codec.go), where a nil
//     slice is stored as null; elsewhere an empty list decodes as nil.
//
// Nothing is nullable otherwise. The engine that writes and reads the
// streams (column derivation, framing checks, the loader that maps a
// stream onto the known schema without Arrow's reader, the writer that
// writes Arrow's bytes straight from the rows, the output buffer pool)
// lives in internal/rowipc, behind Codec.
//
// A file of many messages of one kind (the output of `trajflow stage`) is
// one IPC stream of many record batches, one per message: Arrow's readers
// read it as is; SplitStream cuts it into the single-batch messages
// Decode reads, and DecodeAll does both (multistream.go).
//
// Control-plane kinds are JSON documents {"kind","version","data"}:
// EncodeRelease/DecodeRelease (PolicyRelease) and EncodeCensus/DecodeCensus
// (CensusEvent) in jsondoc.go and censusjson.go; EncodeWindow
// (WindowRecord), EncodeIncident (Incident) and EncodeUpdate
// (UpdateRecord) in control.go. Kafka header names are in headers.go.
//
// Every decoder returns an error wrapping ErrDecode for input it cannot
// read and a *VersionError for a message of another kind or an unknown
// version; PeekKind reads the kind of a stream from its schema message
// alone. NewCatalog lists every kind, header and the quarantine layout
// (with the topics a caller supplies) and Describe prints them.
// Files of several record batches (what the offline tools read and write)
// are read with Codec.DecodeStream, ReadStream or DecodeAll; every stream,
// one batch or many, must end with the end-of-stream marker, so a stream
// cut between two record batches is an error, never a shorter stream.
package schemas
