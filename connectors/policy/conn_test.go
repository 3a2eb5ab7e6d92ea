package policy_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"

	"github.com/trajflow/trajflow/connectors/policy"
)

// TestConnTokenize: the shared /tokenize call sends the prompt without
// special tokens and reads the ids back; an answer without tokens or an
// undecodable one is a bad_response infrastructure error naming the call.
func TestConnTokenize(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       []int32
		reason     string
	}{
		{"ids", `{"tokens": [5, 7, 11], "count": 3}`, []int32{5, 7, 11}, ""},
		{"empty list", `{"tokens": []}`, []int32{}, ""},
		{"no tokens", `{"count": 3}`, nil, policy.ReasonBadResponse},
		{"not JSON", `tokens: 5`, nil, policy.ReasonBadResponse},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got map[string]any
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method != http.MethodPost || r.URL.Path != "/tokenize" {
					http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusNotFound)
					return
				}
				if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
				w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			c := &policy.Conn{Addr: srv.URL}
			ids, err := c.Tokenize(context.Background(), "TASK K2")
			if got["prompt"] != "TASK K2" || got["add_special_tokens"] != false {
				t.Errorf("request body %v, want prompt and add_special_tokens false", got)
			}
			if tc.reason == "" {
				if err != nil || !slices.Equal(ids, tc.want) {
					t.Fatalf("Tokenize = %v, %v; want %v", ids, err, tc.want)
				}
				return
			}
			var ie *policy.InfraError
			if !errors.As(err, &ie) || ie.Reason != tc.reason || ie.Addr != srv.URL {
				t.Fatalf("Tokenize error %v; want an infrastructure error %s from %s", err, tc.reason, srv.URL)
			}
		})
	}
}
