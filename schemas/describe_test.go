package schemas

import (
	"strings"
	"testing"
)

func TestDescribe(t *testing.T) {
	var b strings.Builder
	if err := Describe(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)
	for _, want := range []string{
		"task_attempt v1", "trajectory v2", "reward_component v1", "rewarded_trajectory v2",
		"scored_trajectory v2", "weight_ack v1", "chat_template_hash", "packed_batch v1", "policy_release v1", "census_event v1",
		"turns", "list<item: struct<index: int32", "ref_logprobs", "(nullable)", "action_mask",
		"list<item: uint8", "reward_total", "group ", "checkpoint_hash", "at_us",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("Describe output lacks %q", want)
		}
	}
}
