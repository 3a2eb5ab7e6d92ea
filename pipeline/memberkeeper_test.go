package pipeline

import (
	"strings"
	"testing"
)

func TestKeepDecision(t *testing.T) {
	tests := []struct {
		name         string
		mine         string
		view         groupView
		next, remove string
	}{
		{"stable, ours noted", "", groupView{"Stable", []string{"a"}}, "a", ""},
		{"stable, same id kept", "a", groupView{"Stable", []string{"a"}}, "a", ""},
		{"stable after a new join: the new id noted", "a", groupView{"Stable", []string{"b"}}, "b", ""},
		{"plain rebalance: our id alone, kept", "a", groupView{"PreparingRebalance", []string{"a"}}, "a", ""},
		{"rejoined as new beside the noted id: removed", "a", groupView{"PreparingRebalance", []string{"a", "b"}}, "", "a"},
		{"two of ours seen stable: the noted one removed", "a", groupView{"Stable", []string{"b", "a"}}, "", "a"},
		{"two of ours, none noted: nothing removed", "", groupView{"PreparingRebalance", []string{"a", "b"}}, "", ""},
		{"two of ours, the noted one gone: nothing removed", "a", groupView{"PreparingRebalance", []string{"b", "c"}}, "a", ""},
		{"group empty", "a", groupView{"Empty", nil}, "a", ""},
		{"not ours while rebalancing: noted id kept", "a", groupView{"CompletingRebalance", nil}, "a", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			next, remove := keepDecision(tt.mine, tt.view)
			if next != tt.next || remove != tt.remove {
				t.Errorf("keepDecision(%q, %+v) = (%q, %q), want (%q, %q)", tt.mine, tt.view, next, remove, tt.next, tt.remove)
			}
		})
	}
}

func TestMemberClientIDUnique(t *testing.T) {
	a, b := memberClientID("", "run.pack"), memberClientID("", "run.pack")
	if a == b {
		t.Fatalf("two readers got one client id %q", a)
	}
	if !strings.HasPrefix(a, "trajflow/run.pack/") {
		t.Errorf("client id %q: want the default base and the group first", a)
	}
	if c := memberClientID("team-a", "g"); !strings.HasPrefix(c, "team-a/g/") {
		t.Errorf("client id %q does not keep the configured one", c)
	}
}
