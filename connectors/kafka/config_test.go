package kafka

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl/plain"
	"gopkg.in/yaml.v3"
)

// testPKI is a CA with a server certificate for 127.0.0.1 / "broker.test"
// and a client certificate, written as PEM files.
type testPKI struct {
	caFile, certFile, keyFile, otherCAFile string
	server                                 tls.Certificate
	pool                                   *x509.CertPool
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func newCA(t *testing.T, cn string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key, der
}

func leaf(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, usage x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: "broker.test"},
		DNSNames:     []string{"broker.test"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return der, key
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	ca, caKey, caDER := newCA(t, "trajflow test CA")
	_, _, otherDER := newCA(t, "unrelated CA")
	p := testPKI{
		caFile:      filepath.Join(dir, "ca.pem"),
		otherCAFile: filepath.Join(dir, "other-ca.pem"),
		certFile:    filepath.Join(dir, "client.pem"),
		keyFile:     filepath.Join(dir, "client-key.pem"),
		pool:        x509.NewCertPool(),
	}
	p.pool.AddCert(ca)
	writePEM(t, p.caFile, "CERTIFICATE", caDER)
	writePEM(t, p.otherCAFile, "CERTIFICATE", otherDER)

	cDER, cKey := leaf(t, ca, caKey, 3, x509.ExtKeyUsageClientAuth)
	writePEM(t, p.certFile, "CERTIFICATE", cDER)
	kDER, err := x509.MarshalPKCS8PrivateKey(cKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, p.keyFile, "PRIVATE KEY", kDER)

	sDER, sKey := leaf(t, ca, caKey, 2, x509.ExtKeyUsageServerAuth)
	p.server = tls.Certificate{Certificate: [][]byte{sDER}, PrivateKey: sKey}
	return p
}

func TestClientConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  ClientConfig
		ok   bool
	}{
		{"zero", ClientConfig{}, true},
		{"plain brokers", ClientConfig{Brokers: []string{"127.0.0.1:9092", "[::1]:9093"}}, true},
		{"broker without port", ClientConfig{Brokers: []string{"kafka"}}, false},
		{"negative timeout", ClientConfig{DialTimeout: -time.Second}, false},
		{"tls files without enable", ClientConfig{TLS: TLSConfig{CAFile: "ca.pem"}}, false},
		{"insecure without enable", ClientConfig{TLS: TLSConfig{InsecureSkipVerify: true}}, false},
		{"cert without key", ClientConfig{TLS: TLSConfig{Enable: true, CertFile: "c.pem"}}, false},
		{"key without cert", ClientConfig{TLS: TLSConfig{Enable: true, KeyFile: "k.pem"}}, false},
		{"tls on", ClientConfig{TLS: TLSConfig{Enable: true}}, true},
		{"sasl plain", ClientConfig{SASL: SASLConfig{Mechanism: SASLPlain, Username: "u", Password: "p"}}, true},
		{"sasl scram", ClientConfig{SASL: SASLConfig{Mechanism: SASLScramSHA512, Username: "u"}}, true},
		{"sasl no user", ClientConfig{SASL: SASLConfig{Mechanism: SASLScramSHA256, Password: "p"}}, false},
		{"sasl unknown", ClientConfig{SASL: SASLConfig{Mechanism: "gssapi", Username: "u"}}, false},
		{"credentials without mechanism", ClientConfig{SASL: SASLConfig{Username: "u", Password: "p"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if (err == nil) != tc.ok {
				t.Fatalf("Validate() = %v, want ok=%t", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("error %v does not wrap ErrInvalidConfig", err)
			}
			if _, derr := tc.cfg.Dialer(); (derr == nil) != tc.ok {
				t.Fatalf("Dialer() = %v, want ok=%t", derr, tc.ok)
			}
			if _, terr := tc.cfg.Transport(); (terr == nil) != tc.ok {
				t.Fatalf("Transport() = %v, want ok=%t", terr, tc.ok)
			}
		})
	}
}

func TestClientConfigBuild(t *testing.T) {
	p := newTestPKI(t)
	cc := ClientConfig{
		Brokers:     []string{"127.0.0.1:9092"},
		ClientID:    "rollout-3",
		DialTimeout: 3 * time.Second,
		TLS:         TLSConfig{Enable: true, CAFile: p.caFile, CertFile: p.certFile, KeyFile: p.keyFile, ServerName: "broker.test"},
		SASL:        SASLConfig{Mechanism: SASLPlain, Username: "alice", Password: "s3cret"},
	}
	d, err := cc.Dialer()
	if err != nil {
		t.Fatal(err)
	}
	if d.ClientID != "rollout-3" || d.Timeout != 3*time.Second || d.TLS == nil || d.SASLMechanism == nil {
		t.Fatalf("Dialer = %+v", d)
	}
	tc := d.TLS
	if tc.InsecureSkipVerify || tc.ServerName != "broker.test" || tc.MinVersion != tls.VersionTLS12 || len(tc.Certificates) != 1 || tc.RootCAs == nil {
		t.Fatalf("tls.Config = %+v", tc)
	}
	if !tc.RootCAs.Equal(p.pool) {
		t.Fatal("RootCAs is not the CA file's pool")
	}
	if pm, ok := d.SASLMechanism.(plain.Mechanism); !ok || pm.Username != "alice" || pm.Password != "s3cret" {
		t.Fatalf("SASL mechanism = %#v", d.SASLMechanism)
	}
	tr, err := cc.Transport()
	if err != nil {
		t.Fatal(err)
	}
	if tr.ClientID != "rollout-3" || tr.DialTimeout != 3*time.Second || tr.TLS == nil || tr.SASL == nil || tr.SASL.Name() != "PLAIN" {
		t.Fatalf("Transport = %+v", tr)
	}
	for m, name := range map[SASLMechanism]string{SASLScramSHA256: "SCRAM-SHA-256", SASLScramSHA512: "SCRAM-SHA-512"} {
		c := cc
		c.SASL.Mechanism = m
		mech, err := c.SASLMechanism()
		if err != nil || mech.Name() != name {
			t.Fatalf("%s: %v %v", m, mech, err)
		}
	}
	if d, err := (ClientConfig{}).Dialer(); err != nil || d.TLS != nil || d.SASLMechanism != nil || d.Timeout != DefaultDialTimeout {
		t.Fatalf("plaintext Dialer = %+v, %v", d, err)
	}

	bad := filepath.Join(t.TempDir(), "bad.pem")
	if err := os.WriteFile(bad, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		tls  TLSConfig
	}{
		{"missing ca", TLSConfig{Enable: true, CAFile: filepath.Join(t.TempDir(), "none.pem")}},
		{"ca not pem", TLSConfig{Enable: true, CAFile: bad}},
		{"key is not the cert's", TLSConfig{Enable: true, CertFile: p.certFile, KeyFile: bad}},
		{"cert and key swapped", TLSConfig{Enable: true, CertFile: p.keyFile, KeyFile: p.certFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ClientConfig{TLS: tc.tls}.TLSClientConfig()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("got %v", err)
			}
		})
	}
}

func TestClientConfigRedaction(t *testing.T) {
	const pw = "hunter2-very-secret"
	cc := ClientConfig{
		Brokers: []string{"b1:9092"},
		SASL:    SASLConfig{Mechanism: SASLScramSHA256, Username: "svc", Password: pw},
	}
	var logged bytes.Buffer
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("cfg", "kafka", cc, "ptr", &cc, "secret", cc.SASL.Password)
	slog.New(slog.NewTextHandler(&logged, nil)).Info("cfg", "kafka", cc, "sasl", cc.SASL)
	js, err := json.Marshal(cc)
	if err != nil {
		t.Fatal(err)
	}
	ym, err := yaml.Marshal(cc)
	if err != nil {
		t.Fatal(err)
	}
	outputs := map[string]string{
		"String":   cc.String(),
		"%v":       fmt.Sprintf("%v", cc),
		"%+v":      fmt.Sprintf("%+v", cc),
		"%#v":      fmt.Sprintf("%#v", cc),
		"%v ptr":   fmt.Sprintf("%v", &cc),
		"%+v sasl": fmt.Sprintf("%+v", cc.SASL),
		"%#v sasl": fmt.Sprintf("%#v", cc.SASL),
		"%s pw":    fmt.Sprintf("%s", cc.SASL.Password),
		"%q pw":    fmt.Sprintf("%q", cc.SASL.Password),
		"%x pw":    fmt.Sprintf("%x", cc.SASL.Password),
		"slog":     logged.String(),
		"json":     string(js),
		"yaml":     string(ym),
	}
	for name, out := range outputs {
		if strings.Contains(out, pw) || strings.Contains(out, fmt.Sprintf("%x", pw)) {
			t.Errorf("%s leaks the password: %s", name, out)
		}
	}
	for _, name := range []string{"String", "%v", "%+v", "slog", "json", "yaml"} {
		if !strings.Contains(outputs[name], redacted) {
			t.Errorf("%s does not show the password as redacted: %s", name, outputs[name])
		}
		if !strings.Contains(outputs[name], "svc") {
			t.Errorf("%s hides the username: %s", name, outputs[name])
		}
	}
	if got := (ClientConfig{}).String(); strings.Contains(got, redacted) {
		t.Errorf("empty password shown as redacted: %s", got)
	}
	// Decoding reads the real value.
	var back ClientConfig
	src := "brokers: [\"b1:9092\"]\nsasl:\n  mechanism: scram-sha-256\n  username: svc\n  password: " + pw + "\n"
	if err := yaml.Unmarshal([]byte(src), &back); err != nil {
		t.Fatal(err)
	}
	if back.SASL.Password.Reveal() != pw || back.SASL.Mechanism != SASLScramSHA256 {
		t.Fatalf("yaml decode: %+v / %q", back.SASL, back.SASL.Password.Reveal())
	}
	var jback SASLConfig
	if err := json.Unmarshal([]byte(`{"mechanism":"plain","username":"u","password":"`+pw+`"}`), &jback); err != nil || jback.Password.Reveal() != pw {
		t.Fatalf("json decode: %v %q", err, jback.Password.Reveal())
	}
}

func TestParseSASLMechanism(t *testing.T) {
	for in, want := range map[string]SASLMechanism{
		"": SASLNone, "none": SASLNone, "PLAIN": SASLPlain, " plain ": SASLPlain,
		"SCRAM-SHA-256": SASLScramSHA256, "scram_sha_512": SASLScramSHA512,
	} {
		if got, err := ParseSASLMechanism(in); err != nil || got != want {
			t.Errorf("ParseSASLMechanism(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"gssapi", "oauthbearer", "scram-sha-1", "plain2"} {
		if _, err := ParseSASLMechanism(in); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("ParseSASLMechanism(%q) = %v", in, err)
		}
	}
}

func FuzzParseSASLMechanism(f *testing.F) {
	for _, s := range []string{"", "plain", "SCRAM_SHA_256", "scram-sha-512", "x", "\x00\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseSASLMechanism(s)
		if err != nil {
			if !errors.Is(err, ErrInvalidConfig) || m != SASLNone {
				t.Fatalf("%q: %q %v", s, m, err)
			}
			return
		}
		switch m {
		case SASLNone, SASLPlain, SASLScramSHA256, SASLScramSHA512:
		default:
			t.Fatalf("%q parsed to unknown %q", s, m)
		}
		if again, err := ParseSASLMechanism(string(m)); err != nil || again != m {
			t.Fatalf("%q: round trip %q -> %q %v", s, m, again, err)
		}
	})
}

// TestClientConfigAgainstSecureBroker runs Transport (admin client) and
// Dialer (reader path) against the embedded broker with mutual TLS and each
// SASL mechanism, and checks that a wrong password, a wrong CA and a missing
// client certificate are refused.
func TestClientConfigAgainstSecureBroker(t *testing.T) {
	p := newTestPKI(t)
	users := []BrokerUser{
		{Mechanism: SASLPlain, Username: "plain-user", Password: "pw-plain"},
		{Mechanism: SASLScramSHA256, Username: "scram256-user", Password: "pw-256"},
		{Mechanism: SASLScramSHA512, Username: "scram512-user", Password: "pw-512"},
	}
	b := startTestBroker(t, BrokerConfig{
		TLS: &tls.Config{
			Certificates: []tls.Certificate{p.server},
			ClientCAs:    p.pool,
			ClientAuth:   tls.RequireAndVerifyClientCert,
			MinVersion:   tls.VersionTLS12,
		},
		Users: users,
	})
	base := ClientConfig{
		Brokers:     []string{b.Addr()},
		ClientID:    "secure-test",
		DialTimeout: 3 * time.Second,
		TLS:         TLSConfig{Enable: true, CAFile: p.caFile, CertFile: p.certFile, KeyFile: p.keyFile, ServerName: "broker.test"},
	}
	ctx := testCtx(t, 20*time.Second)
	for i, u := range users {
		t.Run(string(u.Mechanism), func(t *testing.T) {
			cc := base
			cc.SASL = SASLConfig{Mechanism: u.Mechanism, Username: u.Username, Password: u.Password}
			topic := fmt.Sprintf("secure-%d", i)
			if err := CreateTopics(ctx, cc, nil, []TopicSpec{{Name: topic}}); err != nil {
				t.Fatalf("CreateTopics over TLS+SASL: %v", err)
			}
			w := newWriter(t, cc, topic, 0)
			if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("k"), Value: []byte(u.Username)}); err != nil {
				t.Fatalf("write: %v", err)
			}
			d, err := cc.Dialer()
			if err != nil {
				t.Fatal(err)
			}
			conn, err := d.DialLeader(ctx, "tcp", b.Addr(), topic, 0)
			if err != nil {
				t.Fatalf("DialLeader: %v", err)
			}
			defer conn.Close()
			_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			m, err := conn.ReadMessage(1 << 20)
			if err != nil || string(m.Value) != u.Username {
				t.Fatalf("read back: %v %q", err, m.Value)
			}

			wrong := cc
			wrong.SASL.Password = "wrong"
			_, err = ListTopics(ctx, wrong, nil)
			if err == nil {
				t.Fatal("wrong password accepted")
			}
			t.Logf("wrong password refused: %v", err)
		})
	}
	refused := map[string]ClientConfig{}
	c := base
	c.SASL = SASLConfig{Mechanism: SASLPlain, Username: "plain-user", Password: "pw-plain"}
	noCert := c
	noCert.TLS.CertFile, noCert.TLS.KeyFile = "", ""
	refused["no client certificate"] = noCert
	otherCA := c
	otherCA.TLS.CAFile = p.otherCAFile
	refused["unknown CA"] = otherCA
	wrongName := c
	wrongName.TLS.ServerName = "other.test"
	refused["wrong server name"] = wrongName
	plainText := c
	plainText.TLS = TLSConfig{}
	refused["plaintext"] = plainText
	noSASL := base
	refused["no SASL"] = noSASL
	for name, cc := range refused {
		t.Run(name, func(t *testing.T) {
			short := testCtx(t, 4*time.Second)
			_, err := ListTopics(short, cc, nil)
			if err == nil {
				t.Fatal("accepted")
			}
			t.Logf("refused: %v", err)
		})
	}
}
