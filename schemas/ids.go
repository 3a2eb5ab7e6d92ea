package schemas

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// Deterministic identifiers (docs/SYSTEMS.md §14: "deterministic identifiers
// from run/task/attempt/turn"). An identifier is the first 16 bytes of the
// SHA-256 of a versioned, length-prefixed tuple, written as 32 hex digits.
// Length prefixes make the encoding injective: ("ab","c") and ("a","bc")
// never collide. The same inputs give the same id in every process, so a
// redelivered record reproduces the id of the original and downstream
// consumers can deduplicate by it.

const idDomain = "trajflow/id/v1"

func makeID(kind string, parts ...string) string {
	h := sha256.New()
	var buf [20]byte
	write := func(s string) {
		h.Write(strconv.AppendInt(buf[:0], int64(len(s)), 10))
		h.Write([]byte{':'})
		h.Write([]byte(s))
	}
	write(idDomain)
	write(kind)
	for _, p := range parts {
		write(p)
	}
	sum := h.Sum(nil)
	return hex.EncodeToString(sum[:16])
}

func itoa(v int64) string { return strconv.FormatInt(v, 10) }

// GroupID names one group of G attempts of the same task (docs/PIPELINE.md §6): the
// index-th group drawn for taskID in run runID. It is the Kafka key of every
// record of the group, so one advantage instance sees the whole group.
func GroupID(runID, taskID string, index int64) string {
	return makeID("group", runID, taskID, itoa(index))
}

// AttemptID names one attempt: member `member` of group groupID, retry
// number `attempt` (0 for the first try). Infrastructure retries get a new
// attempt number and so a new id; redelivery of the same attempt does not.
func AttemptID(runID, taskID, groupID string, member, attempt int32) string {
	return makeID("attempt", runID, taskID, groupID, itoa(int64(member)), itoa(int64(attempt)))
}

// TurnID names turn `turn` of an attempt.
func TurnID(attemptID string, turn int32) string {
	return makeID("turn", attemptID, itoa(int64(turn)))
}

// BatchID names the index-th packed batch of a run. Batch indexes are
// assigned by the pack window in order, so a replay that reproduces the
// window reproduces the ids.
func BatchID(runID string, index int64) string {
	return makeID("batch", runID, itoa(index))
}

// DerivedID names a record derived from parent by stage (for example the
// reward record of a trajectory), so every stage's output id is a pure
// function of its input id.
func DerivedID(stage, parentID string) string {
	return makeID("derived", stage, parentID)
}

// SeedFor derives a 64-bit seed for a random stream from the contract seed
// and a record id (docs/GUARANTEES.md "Determinism rules"): the same attempt and turn draw
// the same numbers whichever process runs them.
func SeedFor(contractSeed int64, id string, stream string) uint64 {
	h := sha256.New()
	var buf [20]byte
	h.Write([]byte("trajflow/seed/v1:"))
	h.Write(strconv.AppendInt(buf[:0], contractSeed, 10))
	h.Write([]byte{':'})
	h.Write([]byte(stream))
	h.Write([]byte{':'})
	h.Write([]byte(id))
	sum := h.Sum(nil)
	var v uint64
	for i := 0; i < 8; i++ {
		v = v<<8 | uint64(sum[i])
	}
	return v
}
