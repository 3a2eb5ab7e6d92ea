// Package capability implements the environment-action capability tokens of
// docs/SYSTEMS.md §12 and §16: every action an agent sends to an environment carries
// a short-lived token, minted by the control plane with a key held per run,
// scoped to one episode and one action sequence number and bound to the
// action's bytes (HMAC-SHA256). The environment side (Guard) refuses
// forged, expired, replayed, out-of-order and mis-scoped actions, executes
// each accepted action at most once, persists its outcome before
// acknowledging, and answers status queries so that a client retrying after
// an ambiguous timeout asks before re-executing (Client.Do; docs/SYSTEMS.md §12:
// "A retry after ambiguous timeout must query action status before
// re-execution").
//
// Tokens carry no secret: the key never leaves the issuer and the guard
// (docs/SYSTEMS.md §16: "never mount cluster credentials in tool sandboxes"), and
// a token is useless for any other episode, sequence number or action.
package capability

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
)

// KeySize is the length of a run key in bytes.
const KeySize = 32

// Errors returned by Guard.Check and Guard.Execute. Every refusal wraps
// ErrRefused, so callers can tell a refused action from an execution error.
var (
	ErrRefused   = errors.New("capability: action refused")
	ErrMalformed = fmt.Errorf("%w: malformed token", ErrRefused)
	// ErrLifetime: the token expires further ahead than the verifier's
	// maximum token lifetime plus ClockSlack (a malformed token).
	ErrLifetime   = fmt.Errorf("%w: expiry beyond the maximum token lifetime", ErrMalformed)
	ErrForged     = fmt.Errorf("%w: bad signature", ErrRefused)
	ErrExpired    = fmt.Errorf("%w: token expired", ErrRefused)
	ErrScope      = fmt.Errorf("%w: token scoped to another run, episode, sequence number or action", ErrRefused)
	ErrReplayed   = fmt.Errorf("%w: sequence number already used", ErrRefused)
	ErrOutOfOrder = fmt.Errorf("%w: sequence number ahead of the next expected one", ErrRefused)
	ErrClosed     = fmt.Errorf("%w: episode closed", ErrRefused)
	// ErrKey reports an unusable key.
	ErrKey = errors.New("capability: key must be 32 bytes")
)

// NewKey returns a fresh random run key.
func NewKey() ([]byte, error) {
	k := make([]byte, KeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, fmt.Errorf("capability: key: %w", err)
	}
	return k, nil
}

// Claims is what a token grants: executing the action whose SHA-256 is
// ActionHash as sequence number Seq of episode Episode of run Run, until
// Expires.
type Claims struct {
	Run        string
	Episode    string
	Seq        uint64
	ActionHash [32]byte
	Expires    time.Time
}

// ActionHash is the digest a token binds an action to.
func ActionHash(action []byte) [32]byte { return sha256.Sum256(action) }

const tokenVersion = 1

// payload is the canonical, length-prefixed encoding of the claims; the
// MAC covers exactly these bytes, so no field can bleed into another.
func (c Claims) payload() []byte {
	var b bytes.Buffer
	b.WriteByte(tokenVersion)
	putString(&b, c.Run)
	putString(&b, c.Episode)
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], c.Seq)
	b.Write(n[:])
	b.Write(c.ActionHash[:])
	binary.BigEndian.PutUint64(n[:], uint64(c.Expires.UnixMicro()))
	b.Write(n[:])
	return b.Bytes()
}

func putString(b *bytes.Buffer, s string) {
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(s)))
	b.Write(n[:])
	b.WriteString(s)
}

func parsePayload(p []byte) (Claims, error) {
	var c Claims
	if len(p) < 1 || p[0] != tokenVersion {
		return c, fmt.Errorf("%w: version", ErrMalformed)
	}
	p = p[1:]
	var ok bool
	if c.Run, p, ok = getString(p); !ok {
		return c, fmt.Errorf("%w: run", ErrMalformed)
	}
	if c.Episode, p, ok = getString(p); !ok {
		return c, fmt.Errorf("%w: episode", ErrMalformed)
	}
	if len(p) != 8+32+8 {
		return c, fmt.Errorf("%w: length", ErrMalformed)
	}
	c.Seq = binary.BigEndian.Uint64(p)
	copy(c.ActionHash[:], p[8:40])
	c.Expires = time.UnixMicro(int64(binary.BigEndian.Uint64(p[40:])))
	return c, nil
}

func getString(p []byte) (string, []byte, bool) {
	if len(p) < 4 {
		return "", nil, false
	}
	n := binary.BigEndian.Uint32(p)
	if uint64(n) > uint64(len(p)-4) {
		return "", nil, false
	}
	return string(p[4 : 4+n]), p[4+n:], true
}

func mac(key, payload []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write(payload)
	return h.Sum(nil)
}

var b64 = base64.RawURLEncoding

// Issuer mints tokens for one run. It is safe for concurrent use.
type Issuer struct {
	key []byte
	run string
	ttl time.Duration
	now func() time.Time
}

// NewIssuer returns an issuer of tokens valid for ttl, signed with key
// (KeySize bytes, one per run). now may be nil (time.Now).
func NewIssuer(key []byte, run string, ttl time.Duration, now func() time.Time) (*Issuer, error) {
	if len(key) != KeySize {
		return nil, ErrKey
	}
	if ttl <= 0 {
		return nil, errors.New("capability: ttl must be positive")
	}
	if now == nil {
		now = time.Now
	}
	return &Issuer{key: bytes.Clone(key), run: run, ttl: ttl, now: now}, nil
}

// Issue returns the token for executing action as sequence number seq of
// episode.
func (i *Issuer) Issue(episode string, seq uint64, action []byte) string {
	c := Claims{Run: i.run, Episode: episode, Seq: seq, ActionHash: ActionHash(action), Expires: i.now().Add(i.ttl)}
	p := c.payload()
	return b64.EncodeToString(p) + "." + b64.EncodeToString(mac(i.key, p))
}

// verify checks the token's signature and expiry and returns its claims.
func verify(key []byte, token string, now time.Time) (Claims, error) {
	ps, ms, ok := strings.Cut(token, ".")
	if !ok {
		return Claims{}, fmt.Errorf("%w: no signature", ErrMalformed)
	}
	p, err := b64.DecodeString(ps)
	if err != nil {
		return Claims{}, fmt.Errorf("%w: payload: %v", ErrMalformed, err)
	}
	m, err := b64.DecodeString(ms)
	if err != nil {
		return Claims{}, fmt.Errorf("%w: signature: %v", ErrMalformed, err)
	}
	if !hmac.Equal(m, mac(key, p)) {
		return Claims{}, ErrForged
	}
	c, err := parsePayload(p)
	if err != nil {
		return Claims{}, err
	}
	if !now.Before(c.Expires) {
		return Claims{}, fmt.Errorf("%w: at %s", ErrExpired, c.Expires.UTC().Format(time.RFC3339Nano))
	}
	return c, nil
}

// DefaultMaxTTL is the longest token lifetime a verifier accepts unless
// told otherwise (Verifier.WithMaxTTL); issuers mint tokens for 30 s by
// default.
const DefaultMaxTTL = 10 * time.Minute

// ClockSlack is added to a verifier's maximum token lifetime for the
// clock difference between the issuer and the verifier.
const ClockSlack = 30 * time.Second

// Verifier checks tokens on the environment side without keeping any
// state: Guard uses it in process, and an environment service that keeps
// its own (persisted) sequence numbers uses it directly. It is safe for
// concurrent use.
//
// A token whose expiry lies further ahead than the maximum token lifetime
// plus ClockSlack is refused (ErrLifetime, an ErrMalformed): no issuer
// mints one, and accepting it would make a captured token good forever.
type Verifier struct {
	key    []byte
	now    func() time.Time
	maxTTL time.Duration
}

// NewVerifier returns a verifier of tokens signed with key, with the
// maximum token lifetime DefaultMaxTTL. now may be nil (time.Now).
func NewVerifier(key []byte, now func() time.Time) (*Verifier, error) {
	if len(key) != KeySize {
		return nil, ErrKey
	}
	if now == nil {
		now = time.Now
	}
	return &Verifier{key: bytes.Clone(key), now: now, maxTTL: DefaultMaxTTL}, nil
}

// WithMaxTTL returns a verifier like v whose maximum token lifetime is d
// (d <= 0: DefaultMaxTTL).
func (v *Verifier) WithMaxTTL(d time.Duration) *Verifier {
	if d <= 0 {
		d = DefaultMaxTTL
	}
	w := *v
	w.maxTTL = d
	return &w
}

// MaxTTL is the verifier's maximum token lifetime.
func (v *Verifier) MaxTTL() time.Duration { return v.maxTTL }

// Verify checks that token is well formed (ErrMalformed; ErrLifetime for
// an expiry more than the maximum token lifetime plus ClockSlack ahead),
// signed with the verifier's key (ErrForged), not expired (ErrExpired) and
// grants exactly action as sequence number seq of episode of run
// (ErrScope). It returns the token's claims.
func (v *Verifier) Verify(token, run, episode string, seq uint64, action []byte) (Claims, error) {
	now := v.now()
	c, err := verify(v.key, token, now)
	if err != nil {
		return Claims{}, err
	}
	if limit := now.Add(v.maxTTL + ClockSlack); c.Expires.After(limit) {
		return Claims{}, fmt.Errorf("%w: expires %s, more than %s (plus %s) ahead", ErrLifetime,
			c.Expires.UTC().Format(time.RFC3339Nano), v.maxTTL, ClockSlack)
	}
	if c.Run != run || c.Episode != episode || c.Seq != seq || c.ActionHash != ActionHash(action) {
		return Claims{}, ErrScope
	}
	return c, nil
}
