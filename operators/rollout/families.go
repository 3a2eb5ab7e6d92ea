package rollout

import (
	"errors"
	"fmt"
	"strings"
)

// Environment artifacts of the built-in families, as a learning contract
// names them (artifacts.environment).
const (
	ArtifactKV     = "builtin:env/kv-env@v1"
	ArtifactLedger = "builtin:env/ledger-env@v1"
	ArtifactText   = "builtin:env/text-env@v1"
)

// Families lists the built-in families.
func Families() []string { return []string{FamilyKV, FamilyLedger, FamilyText} }

// FamilyOfArtifact returns the built-in family a contract's environment
// artifact names. Any other artifact is an error: an environment that is
// not built in is reached through an environment service, not a registry.
func FamilyOfArtifact(env string) (string, error) {
	switch env {
	case ArtifactKV:
		return FamilyKV, nil
	case ArtifactLedger:
		return FamilyLedger, nil
	case ArtifactText:
		return FamilyText, nil
	}
	if strings.HasPrefix(env, "builtin:env/") {
		return "", fmt.Errorf("rollout: artifacts.environment %q: no such built-in environment (have %s, %s, %s)", env, ArtifactKV, ArtifactLedger, ArtifactText)
	}
	return "", fmt.Errorf("%w: artifacts.environment %q is not a built-in environment", ErrNotBuiltin, env)
}

// ErrNotBuiltin is wrapped by FamilyOfArtifact for an environment that is
// not one of the built-in families (a run of an environment of its own:
// the stages that run the environment need it given to them).
var ErrNotBuiltin = errors.New("rollout: not a built-in environment")

// NewFamilyRegistry returns the default registry of family.
func NewFamilyRegistry(family string) (*Registry, error) {
	cfg, err := DefaultFamilyConfig(family)
	if err != nil {
		return nil, err
	}
	return NewRegistry(cfg)
}

// RegistryForArtifact returns the default registry of the built-in family
// a contract's artifacts.environment names (FamilyOfArtifact).
func RegistryForArtifact(env string) (*Registry, error) {
	f, err := FamilyOfArtifact(env)
	if err != nil {
		return nil, err
	}
	return NewFamilyRegistry(f)
}
