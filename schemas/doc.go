// Package schemas defines every record kind of trajflow: its Go row type
// (types.go), its Arrow schema and codec (one file per kind), and the JSON
// documents of the control plane.
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
// A file of many messages of one kind (the output of `trajflow stage`) is
// one IPC stream of many record batches, one per message: Arrow's readers
// read it as is; SplitStream cuts it into the single-batch messages
// Decode reads, and DecodeAll does both (multistream.go).
//
// Control-plane kinds are JSON documents {"kind","version","data"}:
// EncodeRelease/DecodeRelease (PolicyRelease) and EncodeCensus/DecodeCensus
// (CensusEvent), in jsondoc.go.
//
// Column names are the json tags of the row types, in snake case. Every
// decoder returns an error wrapping ErrDecode for input it cannot read and
// a *VersionError for a message of another kind or an unknown version;
// PeekKind reads the kind of a stream from its schema message alone.
// Files of several record batches (what the offline tools read and write)
// are read with Codec.DecodeStream or ReadStream; every stream, one batch
// or many, must end with the end-of-stream marker, so a stream cut between
// two record batches is an error, never a shorter stream.
// Describe prints all schemas.
package schemas
