package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
)

// DefaultDialTimeout bounds connection establishment (TCP, TLS handshake and
// SASL exchange) when ClientConfig.DialTimeout is zero.
const DefaultDialTimeout = 10 * time.Second

// ErrInvalidConfig is wrapped by every error that reports an unusable
// ClientConfig (bad mechanism, half a key pair, unreadable PEM file, ...).
var ErrInvalidConfig = errors.New("kafka: invalid client config")

// Secret is a string that never prints: String, GoString, fmt verbs,
// slog and the text/JSON/YAML marshalers all render a non-empty Secret as
// "[REDACTED]". Decoding from YAML or JSON reads the plain string. Use
// Reveal to obtain the value where it is really needed (building a SASL
// mechanism).
type Secret string

const redacted = "[REDACTED]"

func (s Secret) mask() string {
	if s == "" {
		return ""
	}
	return redacted
}

// String returns "[REDACTED]" for a non-empty secret and "" otherwise.
func (s Secret) String() string { return s.mask() }

// GoString keeps %#v from printing the secret.
func (s Secret) GoString() string { return fmt.Sprintf("%q", s.mask()) }

// LogValue keeps slog from printing the secret.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.mask()) }

// MarshalText renders the redacted form, so encoding a config never leaks
// the secret (the encoded form cannot be decoded back into the secret).
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.mask()), nil }

// Reveal returns the secret value.
func (s Secret) Reveal() string { return string(s) }

// SASLMechanism names a SASL mechanism accepted by ClientConfig.
type SASLMechanism string

// The supported SASL mechanisms. The empty mechanism means no SASL.
const (
	SASLNone        SASLMechanism = ""
	SASLPlain       SASLMechanism = "plain"
	SASLScramSHA256 SASLMechanism = "scram-sha-256"
	SASLScramSHA512 SASLMechanism = "scram-sha-512"
)

// ParseSASLMechanism accepts the mechanism names case-insensitively, with
// '_' allowed in place of '-' ("SCRAM_SHA_256", "PLAIN", "scram-sha-512"),
// and "" or "none" for no SASL. Anything else is an error wrapping
// ErrInvalidConfig.
func ParseSASLMechanism(s string) (SASLMechanism, error) {
	n := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(s)), "_", "-")
	switch n {
	case "", "none":
		return SASLNone, nil
	case string(SASLPlain):
		return SASLPlain, nil
	case string(SASLScramSHA256):
		return SASLScramSHA256, nil
	case string(SASLScramSHA512):
		return SASLScramSHA512, nil
	}
	return SASLNone, fmt.Errorf("%w: unknown SASL mechanism %q (want plain, scram-sha-256 or scram-sha-512)", ErrInvalidConfig, s)
}

// wireName is the mechanism's wire name as Kafka spells it.
func (m SASLMechanism) wireName() string {
	switch m {
	case SASLPlain:
		return "PLAIN"
	case SASLScramSHA256:
		return "SCRAM-SHA-256"
	case SASLScramSHA512:
		return "SCRAM-SHA-512"
	}
	return ""
}

// TLSConfig configures TLS to the brokers. Certificate verification is on
// unless InsecureSkipVerify is set explicitly.
type TLSConfig struct {
	// Enable turns TLS on. Setting any other field without Enable is a
	// configuration error rather than a silent plaintext connection.
	Enable bool `yaml:"enable" json:"enable"`
	// CAFile is a PEM bundle of CA certificates used to verify the
	// brokers; empty means the system roots.
	CAFile string `yaml:"ca_file" json:"ca_file"`
	// CertFile and KeyFile are a PEM client certificate and its key for
	// mutual TLS; both or neither.
	CertFile string `yaml:"cert_file" json:"cert_file"`
	KeyFile  string `yaml:"key_file" json:"key_file"`
	// ServerName overrides the name checked against the broker
	// certificate; empty means the host part of the broker address.
	ServerName string `yaml:"server_name" json:"server_name"`
	// InsecureSkipVerify disables certificate verification. Never the
	// default; only for local testing.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify" json:"insecure_skip_verify"`
}

func (t TLSConfig) anySet() bool {
	return t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// SASLConfig configures SASL authentication.
type SASLConfig struct {
	// Mechanism is one of plain, scram-sha-256, scram-sha-512; empty
	// disables SASL.
	Mechanism SASLMechanism `yaml:"mechanism" json:"mechanism"`
	Username  string        `yaml:"username" json:"username"`
	// Password never prints (see Secret).
	Password Secret `yaml:"password" json:"password"`
}

// ClientConfig holds everything a kafka-go client needs to reach a cluster.
// The zero value with Brokers set is a plaintext, unauthenticated client.
// Printing a ClientConfig (fmt, %v, %+v, %#v, slog) never shows the SASL
// password.
type ClientConfig struct {
	Brokers []string `yaml:"brokers" json:"brokers"`
	// ClientID is sent with every request; an operator's consumer-group
	// reader sends it with "/<group>/<random>" appended (its own, which
	// the runtime uses to find its group membership: pipeline's member
	// keeper).
	ClientID string `yaml:"client_id" json:"client_id"`
	// DialTimeout bounds TCP connect + TLS handshake + SASL exchange;
	// zero means DefaultDialTimeout.
	DialTimeout time.Duration `yaml:"dial_timeout" json:"dial_timeout"`
	TLS         TLSConfig     `yaml:"tls" json:"tls"`
	SASL        SASLConfig    `yaml:"sasl" json:"sasl"`
}

// String describes the config with the password redacted.
func (c ClientConfig) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "brokers=%s client_id=%q", strings.Join(c.Brokers, ","), c.ClientID)
	if c.DialTimeout != 0 {
		fmt.Fprintf(&b, " dial_timeout=%s", c.DialTimeout)
	}
	if c.TLS.Enable {
		fmt.Fprintf(&b, " tls=on ca_file=%q cert_file=%q key_file=%q server_name=%q insecure_skip_verify=%t",
			c.TLS.CAFile, c.TLS.CertFile, c.TLS.KeyFile, c.TLS.ServerName, c.TLS.InsecureSkipVerify)
	} else {
		b.WriteString(" tls=off")
	}
	if c.SASL.Mechanism != SASLNone {
		fmt.Fprintf(&b, " sasl=%s username=%q password=%s", c.SASL.Mechanism, c.SASL.Username, c.SASL.Password.mask())
	} else {
		b.WriteString(" sasl=off")
	}
	return b.String()
}

// GoString keeps %#v from printing the password.
func (c ClientConfig) GoString() string { return "kafka.ClientConfig{" + c.String() + "}" }

// LogValue renders the config as a slog group with the password redacted.
func (c ClientConfig) LogValue() slog.Value {
	attrs := []slog.Attr{
		slog.String("brokers", strings.Join(c.Brokers, ",")),
		slog.String("client_id", c.ClientID),
		slog.Bool("tls", c.TLS.Enable),
	}
	if c.DialTimeout != 0 {
		attrs = append(attrs, slog.Duration("dial_timeout", c.DialTimeout))
	}
	if c.TLS.Enable {
		attrs = append(attrs,
			slog.String("tls_ca_file", c.TLS.CAFile),
			slog.String("tls_cert_file", c.TLS.CertFile),
			slog.String("tls_key_file", c.TLS.KeyFile),
			slog.String("tls_server_name", c.TLS.ServerName),
			slog.Bool("tls_insecure_skip_verify", c.TLS.InsecureSkipVerify))
	}
	attrs = append(attrs, slog.String("sasl", string(c.SASL.Mechanism)))
	if c.SASL.Mechanism != SASLNone {
		attrs = append(attrs,
			slog.String("sasl_username", c.SASL.Username),
			slog.String("sasl_password", c.SASL.Password.mask()))
	}
	return slog.GroupValue(attrs...)
}

// Validate checks the config without touching the network or the file
// system: known SASL mechanism with a username, a complete client key pair,
// TLS fields only with TLS enabled, a non-negative timeout. Broker addresses,
// when present, must be host:port. Errors wrap ErrInvalidConfig.
func (c ClientConfig) Validate() error {
	var errs []error
	for _, b := range c.Brokers {
		if _, _, err := net.SplitHostPort(b); err != nil {
			errs = append(errs, fmt.Errorf("%w: broker address %q: %v", ErrInvalidConfig, b, err))
		}
	}
	if c.DialTimeout < 0 {
		errs = append(errs, fmt.Errorf("%w: negative dial timeout %s", ErrInvalidConfig, c.DialTimeout))
	}
	if !c.TLS.Enable && c.TLS.anySet() {
		errs = append(errs, fmt.Errorf("%w: tls fields set but tls.enable is false", ErrInvalidConfig))
	}
	if (c.TLS.CertFile == "") != (c.TLS.KeyFile == "") {
		errs = append(errs, fmt.Errorf("%w: tls cert_file and key_file must be given together", ErrInvalidConfig))
	}
	if _, err := ParseSASLMechanism(string(c.SASL.Mechanism)); err != nil {
		errs = append(errs, err)
	} else if c.SASL.Mechanism != SASLNone && c.SASL.Username == "" {
		errs = append(errs, fmt.Errorf("%w: sasl %s needs a username", ErrInvalidConfig, c.SASL.Mechanism))
	} else if c.SASL.Mechanism == SASLNone && (c.SASL.Username != "" || c.SASL.Password != "") {
		errs = append(errs, fmt.Errorf("%w: sasl credentials set without a mechanism", ErrInvalidConfig))
	}
	return errors.Join(errs...)
}

// TLSClientConfig builds the *tls.Config, reading the PEM files; nil (and no
// error) when TLS is disabled. The minimum version is TLS 1.2.
func (c ClientConfig) TLSClientConfig() (*tls.Config, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if !c.TLS.Enable {
		return nil, nil
	}
	tc := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         c.TLS.ServerName,
		InsecureSkipVerify: c.TLS.InsecureSkipVerify, //nolint:gosec // explicit opt-in only
	}
	if c.TLS.CAFile != "" {
		pem, err := os.ReadFile(c.TLS.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%w: reading tls ca_file: %w", ErrInvalidConfig, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: tls ca_file %q holds no PEM certificate", ErrInvalidConfig, c.TLS.CAFile)
		}
		tc.RootCAs = pool
	}
	if c.TLS.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.TLS.CertFile, c.TLS.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: loading tls client key pair: %w", ErrInvalidConfig, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// SASLMechanism builds the kafka-go SASL mechanism; nil (and no error) when
// SASL is disabled.
func (c ClientConfig) SASLMechanism() (sasl.Mechanism, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	switch c.SASL.Mechanism {
	case SASLPlain:
		return plain.Mechanism{Username: c.SASL.Username, Password: c.SASL.Password.Reveal()}, nil
	case SASLScramSHA256, SASLScramSHA512:
		algo := scram.SHA256
		if c.SASL.Mechanism == SASLScramSHA512 {
			algo = scram.SHA512
		}
		m, err := scram.Mechanism(algo, c.SASL.Username, c.SASL.Password.Reveal())
		if err != nil {
			return nil, fmt.Errorf("%w: sasl %s: %w", ErrInvalidConfig, c.SASL.Mechanism, err)
		}
		return m, nil
	}
	return nil, nil
}

func (c ClientConfig) dialTimeout() time.Duration {
	if c.DialTimeout > 0 {
		return c.DialTimeout
	}
	return DefaultDialTimeout
}

// security returns the TLS configuration and SASL mechanism (each nil when
// not configured).
func (c ClientConfig) security() (*tls.Config, sasl.Mechanism, error) {
	tc, err := c.TLSClientConfig()
	if err != nil {
		return nil, nil, err
	}
	mech, err := c.SASLMechanism()
	if err != nil {
		return nil, nil, err
	}
	return tc, mech, nil
}

// Dialer builds a *kafka.Dialer for kafka.ReaderConfig.Dialer (and
// kafka.DialContext / DialLeader) carrying the client id, timeout, TLS and
// SASL settings.
func (c ClientConfig) Dialer() (*kafkago.Dialer, error) {
	tc, mech, err := c.security()
	if err != nil {
		return nil, err
	}
	d := &kafkago.Dialer{
		ClientID:      c.ClientID,
		Timeout:       c.dialTimeout(),
		DualStack:     true,
		TLS:           tc,
		SASLMechanism: mech,
	}
	d.DialFunc = dialFunc(tc)
	return d, nil
}

// dialFunc is the dial of a Dialer or Transport: ProbingDial for plaintext
// listeners, ConnectDial for TLS ones (a hung broker fails the dial either
// way; see ProbingDial).
func dialFunc(tc *tls.Config) func(context.Context, string, string) (net.Conn, error) {
	if tc == nil {
		return ProbingDial
	}
	return ConnectDial
}

// Transport builds a *kafka.Transport for kafka.Writer.Transport and
// kafka.Client.Transport, refreshing its metadata every MetadataTTL. Call
// CloseIdleConnections on it when done.
func (c ClientConfig) Transport() (*kafkago.Transport, error) {
	tc, mech, err := c.security()
	if err != nil {
		return nil, err
	}
	return &kafkago.Transport{
		Dial:        dialFunc(tc),
		ClientID:    c.ClientID,
		DialTimeout: c.dialTimeout(),
		MetadataTTL: MetadataTTL,
		TLS:         tc,
		SASL:        mech,
	}, nil
}
