package policy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Conn sends JSON calls to one server. The zero value is not usable: Addr
// is required.
type Conn struct {
	// Addr is the base URL ("http://127.0.0.1:8080"), no trailing slash.
	Addr string
	// HTTP is the client (nil: a client with its own pooled transport).
	HTTP *http.Client
	// Timeout bounds each call (0: none besides ctx).
	Timeout time.Duration
	// MaxBody bounds a response body (0: 64 MiB).
	MaxBody int64
	// Trace, when set, sees every call's request and response bodies
	// (status 0 when no response came); for logs.
	Trace func(method, path string, req []byte, status int, resp []byte)
}

// NewConn returns a Conn for addr with a transport of its own that keeps
// up to maxIdle connections to the server alive.
func NewConn(addr string, timeout time.Duration, maxIdle int) (*Conn, error) {
	addr = strings.TrimRight(addr, "/")
	if !strings.HasPrefix(addr, "http://") && !strings.HasPrefix(addr, "https://") {
		return nil, fmt.Errorf("%w: server address %q must be an http:// or https:// URL", ErrConfig, addr)
	}
	if maxIdle <= 0 {
		maxIdle = 16
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = maxIdle
	tr.MaxIdleConnsPerHost = maxIdle
	return &Conn{Addr: addr, HTTP: &http.Client{Transport: tr}, Timeout: timeout}, nil
}

// Close drops the idle connections of the Conn's transport.
func (c *Conn) Close() {
	if c.HTTP != nil {
		c.HTTP.CloseIdleConnections()
	}
}

// Call sends method path with in as its JSON body (nil: no body) and
// decodes a 2xx JSON answer into out (nil: the body is read and dropped).
// Failures are *InfraError (unreachable, timeout, server_error, rejected,
// bad_response, nan_logprob for a NaN or Infinity token in the body; a
// redirect is never followed: it is a bad_response naming its Location),
// except that ctx ending is returned as ctx's error, wrapped.
func (c *Conn) Call(ctx context.Context, method, path string, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return fmt.Errorf("policy: %s %s%s: encode request: %w", method, c.Addr, path, err)
		}
	}
	status, resp, err := c.do(ctx, method, path, body)
	if c.Trace != nil {
		c.Trace(method, path, body, status, resp)
	}
	if err != nil {
		return err
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(resp, out); err != nil {
		if NonFiniteToken(resp) {
			return &InfraError{Reason: ReasonNaNLogprob, Addr: c.Addr, Detail: fmt.Sprintf("%s %s: the body holds a NaN or Infinity literal", method, path), Err: err}
		}
		return &InfraError{Reason: ReasonBadResponse, Addr: c.Addr, Detail: fmt.Sprintf("%s %s: decode %d-byte body", method, path, len(resp)), Err: err}
	}
	return nil
}

func (c *Conn) do(ctx context.Context, method, path string, body []byte) (int, []byte, error) {
	if err := ctx.Err(); err != nil {
		return 0, nil, fmt.Errorf("policy: %s %s%s: %w", method, c.Addr, path, err)
	}
	rctx, cancel := ctx, context.CancelFunc(func() {})
	if c.Timeout > 0 {
		rctx, cancel = context.WithTimeout(ctx, c.Timeout)
	}
	defer cancel()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(rctx, method, c.Addr+path, rd)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %s %s%s: %v", ErrConfig, method, c.Addr, path, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := http.DefaultClient
	if c.HTTP != nil {
		hc = c.HTTP
	}
	// A redirect is never followed: an answer from another server would be
	// recorded as this server's (its version, its log-probs), and a POST
	// would be sent twice. The 3xx is refused below.
	noFollow := *hc
	noFollow.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	res, err := noFollow.Do(req)
	if err != nil {
		return 0, nil, c.transportError(ctx, rctx, method, path, "send", err)
	}
	defer res.Body.Close()
	limit := c.MaxBody
	if limit <= 0 {
		limit = 64 << 20
	}
	resp, err := io.ReadAll(io.LimitReader(res.Body, limit+1))
	if err != nil {
		if ctx.Err() == nil && rctx.Err() == nil {
			return res.StatusCode, resp, &InfraError{Reason: ReasonBadResponse, Addr: c.Addr,
				Detail: fmt.Sprintf("%s %s: body cut after %d bytes", method, path, len(resp)), Err: err}
		}
		return res.StatusCode, resp, c.transportError(ctx, rctx, method, path, "read", err)
	}
	if int64(len(resp)) > limit {
		return res.StatusCode, resp[:limit], Infra(ReasonBadResponse, c.Addr, "%s %s: body over %d bytes", method, path, limit)
	}
	if res.StatusCode >= 300 && res.StatusCode <= 399 {
		ie := Infra(ReasonBadResponse, c.Addr, "%s %s: status %d: redirect to %q refused (a policy server must answer itself)", method, path, res.StatusCode, res.Header.Get("Location"))
		ie.Status = res.StatusCode
		return res.StatusCode, resp, ie
	}
	if res.StatusCode < 200 || res.StatusCode > 299 {
		reason := ReasonServerError
		if res.StatusCode >= 400 && res.StatusCode < 500 {
			reason = ReasonRejected
		}
		ie := Infra(reason, c.Addr, "%s %s: status %d: %s", method, path, res.StatusCode, snippet(resp))
		if ra := res.Header.Get("Retry-After"); ra != "" {
			ie.Detail += fmt.Sprintf(" (Retry-After %s)", strconv.Quote(ra))
		}
		ie.Status = res.StatusCode
		return res.StatusCode, resp, ie
	}
	return res.StatusCode, resp, nil
}

// transportError classifies a failed send or read: ctx ending is the
// caller's, the per-call deadline a timeout, anything else unreachable.
func (c *Conn) transportError(ctx, rctx context.Context, method, path, what string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("policy: %s %s%s: %w", method, c.Addr, path, ctx.Err())
	}
	if errors.Is(rctx.Err(), context.DeadlineExceeded) {
		return &InfraError{Reason: ReasonTimeout, Addr: c.Addr, Detail: fmt.Sprintf("%s %s: no answer within %v", method, path, c.Timeout), Err: context.DeadlineExceeded}
	}
	return &InfraError{Reason: ReasonUnreachable, Addr: c.Addr, Detail: fmt.Sprintf("%s %s: %s", method, path, what), Err: err}
}

func snippet(b []byte) string {
	const n = 512
	s := strings.TrimSpace(string(b))
	if len(s) > n {
		s = s[:n] + "..."
	}
	return strconv.Quote(s)
}

// NonFiniteToken reports whether a JSON-like body holds a NaN, Infinity or
// -Infinity literal outside strings (what Python's json module writes for
// non-finite floats, and what Go's decoder rejects as a syntax error).
func NonFiniteToken(b []byte) bool {
	in := false
	for i := 0; i < len(b); i++ {
		switch ch := b[i]; {
		case in && ch == '\\':
			i++
		case ch == '"':
			in = !in
		case !in && (ch == 'N' || ch == 'I'):
			if bytes.HasPrefix(b[i:], []byte("NaN")) || bytes.HasPrefix(b[i:], []byte("Infinity")) {
				return true
			}
		}
	}
	return false
}

// Float is a JSON number decoded without loss: out-of-range literals
// become ±Inf or 0 (to be refused by the checks, not by the decoder), and
// Set records that the field was present and not null.
type Float struct {
	V   float64
	Set bool
}

// UnmarshalJSON implements json.Unmarshaler.
func (f *Float) UnmarshalJSON(b []byte) error {
	s := string(b)
	if s == "null" {
		*f = Float{}
		return nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return fmt.Errorf("number %s: %w", s, err)
	}
	*f = Float{V: v, Set: true}
	return nil
}

// MarshalJSON implements json.Marshaler (null when unset).
func (f Float) MarshalJSON() ([]byte, error) {
	if !f.Set {
		return []byte("null"), nil
	}
	if math.IsNaN(f.V) || math.IsInf(f.V, 0) {
		return nil, fmt.Errorf("policy: non-finite number %v", f.V)
	}
	return strconv.AppendFloat(nil, f.V, 'g', -1, 64), nil
}

// Tokenize is the /tokenize call SGLang and vLLM share: POST /tokenize
// {prompt: text, add_special_tokens: false} answered by {tokens: [...]}. An
// answer without tokens is an *InfraError (bad_response).
func (c *Conn) Tokenize(ctx context.Context, text string) ([]int32, error) {
	var resp struct {
		Tokens *[]int32 `json:"tokens"`
	}
	if err := c.Call(ctx, "POST", "/tokenize", map[string]any{"prompt": text, "add_special_tokens": false}, &resp); err != nil {
		return nil, err
	}
	if resp.Tokens == nil {
		return nil, Infra(ReasonBadResponse, c.Addr, "POST /tokenize: missing tokens")
	}
	return *resp.Tokens, nil
}
