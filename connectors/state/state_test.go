package state

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestStorePersistsAcrossReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 100; i++ {
		if err := s.Set([]byte(fmt.Sprintf("dedup/%03d", i)), []byte{byte(i)}, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SetInt64([]byte("cursor/batch"), 41); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	n := 0
	err = s.Scan(context.Background(), []byte("dedup/"), func(k, v []byte) error {
		if want := fmt.Sprintf("dedup/%03d", n); string(k) != want || v[0] != byte(n) {
			return fmt.Errorf("key %d = %q/%v, want %q", n, k, v, want)
		}
		n++
		return nil
	})
	if err != nil || n != 100 {
		t.Fatalf("scan: n=%d err=%v", n, err)
	}
	if c, err := s.GetInt64([]byte("cursor/batch"), -1); err != nil || c != 41 {
		t.Fatalf("cursor = %d, %v", c, err)
	}
	if c, err := s.GetInt64([]byte("cursor/none"), -1); err != nil || c != -1 {
		t.Fatalf("missing cursor = %d, %v", c, err)
	}
	if _, err := s.Get([]byte("nope")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get missing = %v", err)
	}
	if err := s.Delete([]byte("dedup/000")); err != nil {
		t.Fatal(err)
	}
	if ok, _ := s.Has([]byte("dedup/000")); ok {
		t.Fatal("deleted key still present")
	}
}

func TestStoreTTLExpires(t *testing.T) {
	s, err := Open("", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Expiry is kept in whole seconds (the store's expires-at is a Unix
	// second, expired once the clock reaches it): a 1 s TTL set just
	// before a second boundary is gone at the boundary. 2 s leaves at
	// least one whole second to see the key.
	if err := s.Set([]byte("k"), []byte("v"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if ok, _ := s.Has([]byte("k")); !ok {
		t.Fatal("key missing right after set")
	}
	time.Sleep(2100 * time.Millisecond)
	if ok, _ := s.Has([]byte("k")); ok {
		t.Fatal("key with 2s TTL still present after 2.1s")
	}
}

func TestIDSetSurvivesReopenAndKeepsPrefixesApart(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	a, b := s.IDSet("a/", 0), s.IDSet("b/", 0)
	if err := a.Add("x"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := b.Has("x"); ok {
		t.Fatal("an id added to one set is visible in another")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if ok, err := s.IDSet("a/", 0).Has("x"); !ok || err != nil {
		t.Fatalf("id lost across reopen: %v %v", ok, err)
	}
}

// TestNilStoreClose: a stage that never opened its store can close it.
func TestNilStoreClose(t *testing.T) {
	var s *Store
	if err := s.Close(); err != nil {
		t.Fatalf("Close on a nil Store: %v", err)
	}
}
