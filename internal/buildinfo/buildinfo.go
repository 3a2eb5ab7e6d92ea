// Package buildinfo says which build of trajflow is running: the module
// version, the VCS revision the binary was built from and the Go version,
// as the Go toolchain records them (runtime/debug.ReadBuildInfo).
// `trajflow version`, the trajflow_build_info metric and the service
// attributes of traces read them here.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Module is the module path of trajflow.
const Module = "github.com/trajflow/trajflow"

// Info is what the toolchain recorded about this binary.
type Info struct {
	// Module and Version are the main module's path and version
	// ("(devel)" for a build from a checkout, a tag for `go install
	// module@version`).
	Module  string
	Version string
	// Revision is the VCS revision (empty when the build was not
	// stamped: -buildvcs=false, or no repository around the sources);
	// Time its commit time and Modified whether the tree had local
	// changes.
	Revision string
	Time     string
	Modified bool
	// Go is the Go version the binary was built with.
	Go string
}

// Read returns the build information of the running binary.
func Read() Info {
	info := Info{Module: Module, Version: "(unknown)", Go: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return info
	}
	if bi.Main.Path != "" {
		info.Module = bi.Main.Path
	}
	if bi.Main.Version != "" {
		info.Version = bi.Main.Version
	}
	if bi.GoVersion != "" {
		info.Go = bi.GoVersion
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.time":
			info.Time = s.Value
		case "vcs.modified":
			info.Modified = s.Value == "true"
		}
	}
	return info
}

// RevisionOrUnknown is Revision, "+dirty" when the tree was modified, or a
// sentence saying why there is none.
func (i Info) RevisionOrUnknown() string {
	switch {
	case i.Revision == "":
		return "unknown (the build was not stamped with a VCS revision: built outside a git checkout or with -buildvcs=false)"
	case i.Modified:
		return i.Revision + "+dirty"
	}
	return i.Revision
}

// String is the one-line form `trajflow version` prints first.
func (i Info) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "trajflow %s (%s)", i.Version, i.Module)
	if i.Revision != "" {
		r := i.Revision
		if len(r) > 12 {
			r = r[:12]
		}
		if i.Modified {
			r += "+dirty"
		}
		fmt.Fprintf(&b, " revision %s", r)
	}
	fmt.Fprintf(&b, " %s", i.Go)
	return b.String()
}
