// Package peers measures trajflow beside the data planes RL systems use
// between rollout and trainer: Ray's object store and actor calls (as veRL
// passes DataProto batches), ZeroMQ push/pull with msgpack payloads (as
// prime-rl does), and raw Kafka clients with no operator work (kafka-go and
// franz-go: the broker's own limit for each client).
//
// The peers (bench/peers/python, bench/peers/zmqpeer) move the same bytes
// over the same hops as trajflow — rollout → validate → reward → advantage →
// pack → trainer — without doing the stages' work: every hop's message is the
// one trajflow's own stage produced for that group, exported once into a
// corpus (WriteCorpus) from the same synthetic rollouts (bench/synth, same
// seed, same heavy-tailed lengths and groups). Run alternates every system
// in one command and writes one table.
package peers

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// corpusMagic starts a corpus file.
const corpusMagic = "TFPEERS1"

// Hops are the topics a group's messages travel, in order: hop h is the
// input of stage h (validate, reward, advantage, pack).
var Hops = []string{"trajectories", "valid", "rewarded", "scored"}

// CorpusHeader describes a corpus file.
type CorpusHeader struct {
	Groups       int          `json:"groups"`
	Batches      int          `json:"batches"`
	Hops         []string     `json:"hops"`
	ContractHash string       `json:"contract_hash"`
	Synth        synth.Config `json:"synth"`
	// Bytes per hop (the batches hop last), over all groups.
	HopBytes []int64 `json:"hop_bytes"`
}

// CorpusGroup is one group's messages on every hop.
type CorpusGroup struct {
	Index          int64
	Tokens, Action int64
	// Hops[h] are the messages on hop h keyed by the group (none: the
	// group was decided before that hop, e.g. every member refused, or
	// the hop was not read: ReadCorpusHops).
	Hops [][][]byte
	// Bytes is the size of the group's messages on every hop (set by
	// ReadCorpusHops, read or skipped).
	Bytes int64
}

// CorpusBatch is one packed batch and the number of groups the pack stage
// had read when it produced it (cumulative).
type CorpusBatch struct {
	After int
	Value []byte
	Size  int // len(Value), also when Value was not read (ReadCorpusHops)
}

// Corpus is what each hop carried for groups 0..n-1 of the bench source.
type Corpus struct {
	Header  CorpusHeader
	Groups  []CorpusGroup
	Batches []CorpusBatch
}

// BuildCorpus runs validate → reward → advantage → pack over groups
// 0..n-1 of s (as the bench source produces them) through the stages' own
// Process functions and records every hop's messages. s takes its RunID,
// contract hash, group size and turns from c.
func BuildCorpus(ctx context.Context, c *contract.Contract, s synth.Config, n int) (*Corpus, error) {
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		return nil, err
	}
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = c.RunID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	gen := s.NewGenerator(0)
	deps := operators.Deps{Contract: c, Topics: topics, VocabSize: s.Vocab, PartialGroupTimeout: time.Second, WindowMaxWait: 2 * time.Second}
	hopTopic := []string{topics.Trajectories, topics.Valid, topics.Rewarded, topics.Scored}
	stages := make([]pipeline.Stage, len(hopTopic))
	dir, err := os.MkdirTemp("", "trajflow-corpus-")
	if err != nil {
		return nil, fmt.Errorf("peers: corpus state: %w", err)
	}
	defer os.RemoveAll(dir)
	for i, name := range []string{"validate", "reward", "advantage", "pack"} {
		st, err := operators.New(name, deps)
		if err != nil {
			return nil, fmt.Errorf("peers: stage %s: %w", name, err)
		}
		if sr, ok := st.(pipeline.Starter); ok {
			env := pipeline.NewEnv(pipeline.EnvConfig{Logger: slog.New(slog.DiscardHandler), Scanner: pipeline.MemScanner{}, StateDir: fmt.Sprintf("%s/%s", dir, name)})
			defer env.Close()
			if err := sr.Start(ctx, env); err != nil {
				return nil, fmt.Errorf("peers: start %s: %w", name, err)
			}
		}
		stages[i] = st
	}
	pack := stages[3]
	rel, err := schemas.EncodeRelease(schemas.PolicyRelease{PolicyVersion: s.PolicyVersion, TrainingStep: s.PolicyVersion,
		ContractHash: c.Hash(), CreatedAt: time.Now().UTC().Format(time.RFC3339), Ready: true})
	if err != nil {
		return nil, err
	}
	if _, err := pack.Process(ctx, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Policy}, Key: []byte("policy"), Value: rel}); err != nil {
		return nil, fmt.Errorf("peers: pack policy: %w", err)
	}
	cp := &Corpus{Header: CorpusHeader{Groups: n, Hops: Hops, ContractHash: c.Hash(), Synth: s, HopBytes: make([]int64, len(Hops)+1)}}
	byKey := map[string]int{}
	packed := 0 // groups pack has read
	var offset int64
	var deliver func(i int, m pipeline.Message) error
	route := func(i int, res pipeline.Result) error {
		for _, o := range res.Outputs {
			v := append([]byte(nil), o.Value...)
			if o.Release != nil {
				o.Release()
			}
			switch o.Topic {
			case topics.Batches:
				cp.Batches = append(cp.Batches, CorpusBatch{After: packed, Value: v, Size: len(v)})
				cp.Header.HopBytes[len(Hops)] += int64(len(v))
				continue
			}
			for j := i + 1; j < len(hopTopic); j++ {
				if o.Topic != hopTopic[j] {
					continue
				}
				if g, ok := byKey[string(o.Key)]; ok {
					cp.Groups[g].Hops[j] = append(cp.Groups[g].Hops[j], v)
					cp.Groups[g].Bytes += int64(len(v))
					cp.Header.HopBytes[j] += int64(len(v))
				}
				offset++
				m := pipeline.Message{Ref: pipeline.Ref{Topic: o.Topic, Offset: offset}, Key: o.Key, Value: v, Headers: o.Headers}
				if err := deliver(j, m); err != nil {
					return err
				}
			}
		}
		return nil
	}
	deliver = func(i int, m pipeline.Message) error {
		if i == 3 {
			packed++
		}
		res, err := stages[i].Process(ctx, m)
		if err != nil {
			ref, ok := pipeline.AsRefusal(err)
			if !ok {
				return fmt.Errorf("peers: %s: %w", stages[i].Name(), err)
			}
			res = pipeline.Result{Outputs: ref.Also}
		}
		return route(i, res)
	}
	for g := int64(0); g < int64(n); g++ {
		rows := gen.Group(g)
		v, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			return nil, fmt.Errorf("peers: encode group %d: %w", g, err)
		}
		cg := CorpusGroup{Index: g, Hops: make([][][]byte, len(Hops))}
		for k := range rows {
			all, act := synth.Tokens(&rows[k])
			cg.Tokens += int64(all)
			cg.Action += int64(act)
		}
		cg.Hops[0], cg.Bytes = [][]byte{v}, int64(len(v))
		cp.Header.HopBytes[0] += int64(len(v))
		byKey[rows[0].GroupID] = len(cp.Groups)
		cp.Groups = append(cp.Groups, cg)
		offset++
		if err := deliver(0, pipeline.Message{Ref: pipeline.Ref{Topic: topics.Trajectories, Offset: offset}, Key: []byte(rows[0].GroupID), Value: v}); err != nil {
			return nil, err
		}
	}
	// Groups still open wait for the partial-group timeout; the window for
	// its maximum wait: a clock past both closes them.
	later := time.Now().Add(time.Hour)
	for i, st := range stages {
		if tk, ok := st.(pipeline.Ticker); ok {
			res, err := tk.Tick(ctx, later)
			if err != nil {
				return nil, fmt.Errorf("peers: tick %s: %w", st.Name(), err)
			}
			if err := route(i, res); err != nil {
				return nil, err
			}
		}
	}
	if len(cp.Batches) == 0 {
		return nil, fmt.Errorf("peers: %d groups filled no batch: export more", n)
	}
	cp.Header.Batches = len(cp.Batches)
	return cp, nil
}

// Write writes the corpus: the magic, a length-prefixed JSON header, then
// per group its index, tokens, action tokens and each hop's messages
// (count, then length-prefixed bytes), then per batch the groups read
// before it and its bytes. Integers are little-endian.
func (cp *Corpus) Write(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("peers: corpus: %w", err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	hdr, err := json.Marshal(cp.Header)
	if err != nil {
		f.Close()
		return err
	}
	var werr error
	u32 := func(v int) {
		if werr == nil {
			werr = binary.Write(w, binary.LittleEndian, uint32(v))
		}
	}
	u64 := func(v int64) {
		if werr == nil {
			werr = binary.Write(w, binary.LittleEndian, uint64(v))
		}
	}
	blob := func(b []byte) {
		u32(len(b))
		if werr == nil {
			_, werr = w.Write(b)
		}
	}
	if _, err := w.WriteString(corpusMagic); err != nil {
		f.Close()
		return err
	}
	blob(hdr)
	for _, g := range cp.Groups {
		u64(g.Index)
		u32(int(g.Tokens))
		u32(int(g.Action))
		for _, msgs := range g.Hops {
			u32(len(msgs))
			for _, m := range msgs {
				blob(m)
			}
		}
	}
	for _, b := range cp.Batches {
		u32(b.After)
		blob(b.Value)
	}
	if werr == nil {
		werr = w.Flush()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return fmt.Errorf("peers: write corpus %s: %w", path, werr)
	}
	return nil
}

// ReadCorpus reads a corpus file written by Write.
func ReadCorpus(path string) (*Corpus, error) {
	return ReadCorpusHops(path, nil, true)
}

// ReadCorpusHops reads a corpus file keeping only the messages of the hops
// listed in hops (nil: every hop) and, with batches, the packed batches:
// a peer's stage process holds what it sends, not the whole corpus. The
// sizes of the messages it skips are still counted (CorpusGroup.Bytes,
// CorpusBatch.Size).
func ReadCorpusHops(path string, hops []int, batches bool) (*Corpus, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("peers: corpus: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("peers: corpus: %w", err)
	}
	r := bufio.NewReaderSize(f, 1<<20)
	fail := func(what string, err error) (*Corpus, error) {
		return nil, fmt.Errorf("peers: corpus %s: %s: %w", path, what, err)
	}
	magic := make([]byte, len(corpusMagic))
	if _, err := io.ReadFull(r, magic); err != nil || string(magic) != corpusMagic {
		return fail("magic", errors.Join(err, errors.New("not a corpus file")))
	}
	u32 := func() (int, error) {
		var v uint32
		err := binary.Read(r, binary.LittleEndian, &v)
		return int(v), err
	}
	// blob reads a length-prefixed message, or skips it (nil) unless keep.
	// A length is the file's claim: one the file cannot hold is refused
	// before it sizes the message.
	blob := func(keep bool) ([]byte, int, error) {
		n, err := u32()
		if err != nil {
			return nil, 0, err
		}
		if int64(n) > fi.Size() {
			return nil, 0, fmt.Errorf("message of %d bytes, more than the %d-byte file holds", n, fi.Size())
		}
		if !keep {
			_, err = r.Discard(n)
			return nil, n, err
		}
		b := make([]byte, n)
		_, err = io.ReadFull(r, b)
		return b, n, err
	}
	hdr, _, err := blob(true)
	if err != nil {
		return fail("header", err)
	}
	cp := &Corpus{}
	if err := json.Unmarshal(hdr, &cp.Header); err != nil {
		return fail("header", err)
	}
	keep := func(h int) bool { return hops == nil || slices.Contains(hops, h) }
	for g := 0; g < cp.Header.Groups; g++ {
		var idx uint64
		if err := binary.Read(r, binary.LittleEndian, &idx); err != nil {
			return fail(fmt.Sprintf("group %d", g), err)
		}
		tok, err1 := u32()
		act, err2 := u32()
		if err := errors.Join(err1, err2); err != nil {
			return fail(fmt.Sprintf("group %d", g), err)
		}
		cg := CorpusGroup{Index: int64(idx), Tokens: int64(tok), Action: int64(act), Hops: make([][][]byte, len(cp.Header.Hops))}
		for h := range cg.Hops {
			k, err := u32()
			if err != nil {
				return fail(fmt.Sprintf("group %d hop %d", g, h), err)
			}
			for ; k > 0; k-- {
				b, n, err := blob(keep(h))
				if err != nil {
					return fail(fmt.Sprintf("group %d hop %d", g, h), err)
				}
				cg.Bytes += int64(n)
				if b != nil {
					cg.Hops[h] = append(cg.Hops[h], b)
				}
			}
		}
		cp.Groups = append(cp.Groups, cg)
	}
	for i := 0; i < cp.Header.Batches; i++ {
		after, err := u32()
		if err != nil {
			return fail(fmt.Sprintf("batch %d", i), err)
		}
		b, n, err := blob(batches)
		if err != nil {
			return fail(fmt.Sprintf("batch %d", i), err)
		}
		cp.Batches = append(cp.Batches, CorpusBatch{After: after, Value: b, Size: n})
	}
	return cp, nil
}

// BatchDue is the index of the batch the pack stage emits after reading
// its packed-th group (counted from 1 over a run; the corpus repeats every
// len(Groups) groups), or -1.
func (cp *Corpus) BatchDue(packed int64) int {
	pos := int((packed-1)%int64(len(cp.Groups))) + 1
	for k, b := range cp.Batches {
		if b.After == pos {
			return k
		}
	}
	return -1
}
