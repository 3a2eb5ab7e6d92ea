package llamatest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestStartNeedsEnvironment(t *testing.T) {
	t.Setenv(EnvServer, "")
	if _, err := StartContext(context.Background(), Options{}); err == nil || !strings.Contains(err.Error(), EnvServer) {
		t.Fatalf("without %s: %v", EnvServer, err)
	}
	t.Setenv(EnvServer, filepath.Join(t.TempDir(), "missing"))
	if _, err := StartContext(context.Background(), Options{}); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("with a missing binary: %v", err)
	}
	t.Setenv(EnvServer, os.Args[0])
	t.Setenv(EnvModel, "")
	if _, err := StartContext(context.Background(), Options{}); err == nil || !strings.Contains(err.Error(), EnvModel) {
		t.Fatalf("without %s: %v", EnvModel, err)
	}
	t.Setenv(EnvModel, os.Args[0]) // not a GGUF file
	if _, err := StartContext(context.Background(), Options{}); err == nil || !strings.Contains(err.Error(), "not a GGUF file") {
		t.Fatalf("with a non-GGUF model: %v", err)
	}
	if _, err := StartContext(context.Background(), Options{ModelsDir: os.Args[0]}); err == nil || !strings.Contains(err.Error(), "not a folder") {
		t.Fatalf("with a file as models dir: %v", err)
	}
}
