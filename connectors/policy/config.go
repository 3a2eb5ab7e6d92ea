package policy

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"
)

// ClientConfig is what every protocol client is configured with.
type ClientConfig struct {
	// Addr is the server's base URL, "http://host:port".
	Addr string
	// Timeout bounds each HTTP call (0: 60 s). A call past it fails with
	// an InfraError of reason timeout.
	Timeout time.Duration
	// Concurrency bounds the requests of one Generate in flight at once
	// (0: 8).
	Concurrency int
	// Want is the version requirement of Generate (GenerateEach takes its
	// own). The zero value accepts any version.
	Want Want
	// TokenizerHash is the tokenizer the caller expects (a release
	// manifest's tokenizer_hash); "" accepts the server's. When both the
	// server and this name one and they differ, Identity fails.
	TokenizerHash string
	// HTTP is the HTTP client (nil: one with its own transport).
	HTTP *http.Client
	// Trace sees every call's request and response bodies (for logs).
	Trace func(method, path string, req []byte, status int, resp []byte)
}

// Defaults of ClientConfig.
const (
	DefaultTimeout     = 60 * time.Second
	DefaultConcurrency = 8
)

// Resolve fills the defaults and returns the Conn of c.
func (c *ClientConfig) Resolve() (*Conn, error) {
	if c.Timeout < 0 || c.Concurrency < 0 {
		return nil, fmt.Errorf("%w: timeout %v and concurrency %d must not be negative", ErrConfig, c.Timeout, c.Concurrency)
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	conn, err := NewConn(c.Addr, c.Timeout, c.Concurrency)
	if err != nil {
		return nil, err
	}
	c.Addr = conn.Addr
	if c.HTTP != nil {
		conn.HTTP = c.HTTP
	}
	conn.Trace = c.Trace
	return conn, nil
}

// ResolveTokenizer picks the tokenizer hash of an identity from the one
// the server reports and the one configured.
func (c *ClientConfig) ResolveTokenizer(server string) (string, error) {
	switch {
	case server == "":
		return c.TokenizerHash, nil
	case c.TokenizerHash != "" && c.TokenizerHash != server:
		return "", fmt.Errorf("%w: the server at %s reports tokenizer %s, the client expects %s", ErrConfig, c.Addr, server, c.TokenizerHash)
	}
	return server, nil
}

// IdentityCache fetches an identity once and keeps it.
type IdentityCache struct {
	mu  sync.Mutex
	id  *Identity
	err error
}

// Get returns the cached identity, fetching it first if needed. A failed
// fetch is not cached (the server may come up later).
func (ic *IdentityCache) Get(ctx context.Context, fetch func(context.Context) (Identity, error)) (Identity, error) {
	ic.mu.Lock()
	defer ic.mu.Unlock()
	if ic.id != nil {
		return *ic.id, nil
	}
	id, err := fetch(ctx)
	if err != nil {
		return Identity{}, err
	}
	ic.id = &id
	return id, nil
}

// Cached returns the identity if fetched (the zero Identity otherwise).
func (ic *IdentityCache) Cached() Identity {
	ic.mu.Lock()
	defer ic.mu.Unlock()
	if ic.id == nil {
		return Identity{}
	}
	return *ic.id
}

// Forget drops the cached identity (after a server restart or a version
// change that may change it).
func (ic *IdentityCache) Forget() {
	ic.mu.Lock()
	ic.id = nil
	ic.mu.Unlock()
}
