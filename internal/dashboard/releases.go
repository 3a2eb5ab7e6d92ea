package dashboard

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Releases is what the release directory of a run holds: the manifest of
// every policy version, the trainer's update record of every version >= 1,
// and the verdict of checking each checkpoint against its manifest.
type Releases struct {
	Dir       string
	Manifests map[int64]schemas.PolicyRelease
	Updates   []schemas.UpdateRecord // by version
	// Checks holds the verification of every checkpoint (hash and model
	// configuration against the manifest), by version.
	Checks   map[int64]ReleaseCheck
	Problems []string
	models   map[int64]*model.Model
}

// ReleaseCheck is the verification of one release's checkpoint.
type ReleaseCheck struct {
	Version int64  `json:"version"`
	OK      bool   `json:"ok"`
	Error   string `json:"error,omitempty"`
}

var releaseName = regexp.MustCompile(`^policy-v(\d{8})\.(json|update\.json)$`)

// readReleases reads dir. Checkpoints already verified in prev (releases
// are written once, atomically) are not read again.
func readReleases(dir string, prev *Releases) (*Releases, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("dashboard: release directory: %w", err)
	}
	r := &Releases{Dir: dir, Manifests: map[int64]schemas.PolicyRelease{}, Checks: map[int64]ReleaseCheck{}, models: map[int64]*model.Model{}}
	for _, e := range ents {
		m := releaseName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		v, _ := strconv.ParseInt(m[1], 10, 64)
		b, err := pipeline.ReadURI(filepath.Join(dir, e.Name())) // a regular file of bounded size, never a pipe
		if err != nil {
			r.Problems = append(r.Problems, fmt.Sprintf("%s: %v", e.Name(), err))
			continue
		}
		if m[2] == "update.json" {
			u, err := schemas.DecodeUpdate(b)
			if err != nil {
				r.Problems = append(r.Problems, fmt.Sprintf("%s: %v", e.Name(), err))
				continue
			}
			r.Updates = append(r.Updates, u)
			continue
		}
		var rel schemas.PolicyRelease
		if err := json.Unmarshal(b, &rel); err != nil || rel.PolicyVersion != v {
			r.Problems = append(r.Problems, fmt.Sprintf("%s: not the manifest of version %d: %v", e.Name(), v, err))
			continue
		}
		r.Manifests[v] = rel
	}
	slices.SortFunc(r.Updates, func(a, b schemas.UpdateRecord) int { return int(a.Version - b.Version) })
	for v, rel := range r.Manifests {
		if prev != nil {
			if c, ok := prev.Checks[v]; ok && prev.Manifests[v] == rel {
				r.Checks[v] = c
				if mdl := prev.models[v]; mdl != nil {
					r.models[v] = mdl
				}
				continue
			}
		}
		r.Checks[v] = r.verify(rel)
	}
	return r, nil
}

// verify loads a release's checkpoint from the release directory (by
// name: the manifest's URI names the directory it was written in) and
// checks its hash and model configuration.
func (r *Releases) verify(rel schemas.PolicyRelease) ReleaseCheck {
	c := ReleaseCheck{Version: rel.PolicyVersion}
	b, err := pipeline.ReadURI(filepath.Join(r.Dir, gpu.CheckpointName(rel.PolicyVersion)))
	if err == nil {
		var m *model.Model
		if m, err = gpu.ModelFromRelease(rel, b); err == nil {
			r.models[rel.PolicyVersion] = m
			c.OK = true
			return c
		}
	}
	c.Error = err.Error()
	return c
}

// Model returns the verified model of a version, if there is one.
func (r *Releases) Model(v int64) (*model.Model, bool) {
	if r == nil {
		return nil, false
	}
	m, ok := r.models[v]
	return m, ok
}

// Versions lists the versions with a verified checkpoint, ascending.
func (r *Releases) Versions() []int64 {
	if r == nil {
		return nil
	}
	var vs []int64
	for v := range r.models {
		vs = append(vs, v)
	}
	slices.Sort(vs)
	return vs
}

// Update returns the update record that produced version v.
func (r *Releases) Update(v int64) (schemas.UpdateRecord, bool) {
	if r == nil {
		return schemas.UpdateRecord{}, false
	}
	i, ok := slices.BinarySearchFunc(r.Updates, v, func(u schemas.UpdateRecord, v int64) int { return int(u.Version - v) })
	if !ok {
		return schemas.UpdateRecord{}, false
	}
	return r.Updates[i], true
}

// UpdateOfBatch returns the update record that trained batch id.
func (r *Releases) UpdateOfBatch(id string) (schemas.UpdateRecord, bool) {
	if r == nil {
		return schemas.UpdateRecord{}, false
	}
	for _, u := range r.Updates {
		if u.BatchID == id {
			return u, true
		}
	}
	return schemas.UpdateRecord{}, false
}
