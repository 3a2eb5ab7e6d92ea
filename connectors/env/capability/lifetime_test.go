package capability

import (
	"bytes"
	"errors"
	"testing"
	"time"
)

// signed mints a token with an arbitrary expiry, as a misconfigured or
// hostile issuer holding the key would.
func signed(key []byte, c Claims) string {
	p := c.payload()
	return b64.EncodeToString(p) + "." + b64.EncodeToString(mac(key, p))
}

// TestVerifierRefusesExpiryBeyondMaxTTL: a token that expires further
// ahead than the maximum lifetime plus ClockSlack is refused as
// malformed, however well it is signed.
func TestVerifierRefusesExpiryBeyondMaxTTL(t *testing.T) {
	key := bytes.Repeat([]byte{7}, KeySize)
	now := time.Unix(1700000000, 0)
	clk := func() time.Time { return now }
	def, err := NewVerifier(key, clk)
	if err != nil {
		t.Fatal(err)
	}
	hour := def.WithMaxTTL(time.Hour)
	action := []byte("x")
	claims := func(exp time.Time) Claims {
		return Claims{Run: "r", Episode: "e", Seq: 1, ActionHash: ActionHash(action), Expires: exp}
	}
	for _, c := range []struct {
		name string
		v    *Verifier
		exp  time.Time
		ok   bool
	}{
		{"default ttl", def, now.Add(30 * time.Second), true},
		{"max ttl", def, now.Add(DefaultMaxTTL), true},
		{"max ttl plus slack", def, now.Add(DefaultMaxTTL + ClockSlack), true},
		{"past max ttl plus slack", def, now.Add(DefaultMaxTTL + ClockSlack + time.Second), false},
		{"2^62 microseconds", def, time.UnixMicro(1 << 62), false},
		{"an hour, default max", def, now.Add(time.Hour), false},
		{"an hour, max an hour", hour, now.Add(time.Hour), true},
		{"two hours, max an hour", hour, now.Add(2 * time.Hour), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.v.Verify(signed(key, claims(c.exp)), "r", "e", 1, action)
			if c.ok && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if !c.ok && (!errors.Is(err, ErrLifetime) || !errors.Is(err, ErrMalformed)) {
				t.Fatalf("Verify = %v, want ErrLifetime (malformed)", err)
			}
		})
	}
	if def.WithMaxTTL(0).MaxTTL() != DefaultMaxTTL || def.MaxTTL() != DefaultMaxTTL {
		t.Fatal("default maximum lifetime not DefaultMaxTTL")
	}
}
